"""How torch.compile splits the model: compiled graphs and graph breaks for the tiny model at ZeRO
stages 0 and 3, with and without activation checkpointing, compiling the whole model
(`train.compile`: DeepSpeed's engine.compile()) or each block and the LM head apart (torchtitan's way).

    python bench/bench_compile_graphs.py
    python bench/bench_compile_graphs.py --json out.json
    python bench/bench_compile_graphs.py --compute-clock   # with the straggler report's hooks, as training has them

Each case runs two forward/backward/optimizer steps of the engine the trainer builds (fp32, 1 process,
parameters partitioned under ZeRO-3) in its own process, then reads dynamo's counters. Figures in
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, torch
from pretrain.parallel import distributed
env = distributed.init("gloo")
from torch._dynamo.utils import counters
from pretrain.config import load_config
from pretrain.parallel.parallelize import build_engine, build_model, deepspeed_config
stage, ac, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = load_config(sys.argv[4], [f"distributed.zero_stage={stage}", f"train.activation_checkpointing={ac}",
                                "model.vocab_size=512", "train.micro_batch_size=2", "data.seq_len=64",
                                "distributed.param_persistence_threshold=0"])
ds = deepspeed_config(cfg, 1, "fp32")
model = build_model(cfg.model, cfg, ds, 0)
if mode == "blocks":
    for block in model.layers:
        block.compile()
    model.output.compile()
engine = build_engine(model, cfg, ds, env.device)
if sys.argv[5] == "1":  # the trainer's compute clock (straggler report), hooked in after DeepSpeed
    from pretrain.faults.stragglers import ComputeClock
    ComputeClock(engine.module, env.device, stage)
if mode == "whole":
    engine.compile()
x = torch.randint(0, 512, (2, 64))
for _ in range(2):
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
print("RESULT " + json.dumps({"graphs": counters["stats"]["unique_graphs"],
                              "breaks": sum(counters["graph_break"].values())}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json")
    p.add_argument("--compute-clock", action="store_true",
                   help="with the trainer's compute clock hooked in (as training has it)")
    a = p.parse_args()
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    rows = []
    print("| ZeRO stage | activation checkpointing | whole model: graphs / breaks | per block + head: graphs / breaks |")
    print("|---|---|---|---|")
    for stage in (0, 3):
        for ac in (0, 1):
            row = {"stage": stage, "ac": ac}
            for mode in ("whole", "blocks"):
                proc = subprocess.run([sys.executable, "-c", CHILD, str(stage), str(ac), mode,
                                       str(REPO / "configs" / "tiny.yaml"), str(int(a.compute_clock))], cwd=REPO, env=env,
                                      capture_output=True, text=True, timeout=900)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode or not lines:
                    raise SystemExit(f"stage {stage} ac {ac} {mode}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
                row[mode] = json.loads(lines[0][len("RESULT "):])
            rows.append(row)
            print(f"| {stage} | {'on' if ac else 'off'} | {row['whole']['graphs']} / {row['whole']['breaks']} | "
                  f"{row['blocks']['graphs']} / {row['blocks']['breaks']} |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
