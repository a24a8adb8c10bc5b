"""Host syncs per optimizer step, by precision and ZeRO stage: every point where the host waits for
the device (`item`, `tolist`, `__bool__`, `__float__`, `__int__`, `cpu`, `numpy`), counted inside
`Trainer.train_step` with a TorchFunctionMode and attributed to our code or DeepSpeed's by the
innermost caller outside torch. Reads of tensors that live on the host on a GPU machine too (the
loader's batches, torch AdamW's step counters) are counted apart and are not syncs there. On a GPU each one stalls the CPU until every queued kernel has run,
so they cost launch overlap; on CPU they cost nothing, but they are counted all the same, so this
figure stands in for a GPU measurement.

    python bench/bench_host_syncs.py                                  # the default matrix
    python bench/bench_host_syncs.py --setups bf16:0,bf16:3 --accum 4 --json out.json

Each setup runs `pretrain train configs/tiny.yaml` in its own process for --steps steps with
gradient accumulation --accum; the first step is left out (start-up work). Prints a table per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Runs inside the training process: wraps Trainer.train_step, then runs the CLI.
CHILD = r"""
import collections, json, os, sys, traceback
import torch
from torch.overrides import TorchFunctionMode
import pretrain.trainer as trainer_module

SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.cpu, torch.Tensor.numpy}
counts = []  # per step: Counter of (owner, "file:line function")

def owner():
    stack = traceback.extract_stack()[:-2]
    # torch's AdamW reads its step counters (host tensors; fused AdamW on a GPU reads none) and the
    # loader fills batches on the host: neither waits for a device.
    if any("/torch/optim/" in frame.filename for frame in stack):
        return "host", "torch.optim step counters"
    for frame in reversed(stack):
        f = frame.filename
        if "/torch/" in f or f == "<string>":
            continue
        where = f"{os.path.basename(f)}:{frame.lineno} {frame.name}"
        if "/deepspeed/" in f:
            return "deepspeed", where
        if "/data_pipeline/" in f:
            return "host", where
        if "/pretrain/" in f:
            return "ours", where
        return "other", where
    return "other", "?"

class Count(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            counts[-1][owner()] += 1
        return func(*args, **(kwargs or {}))

step = trainer_module.Trainer.train_step
def counted(self):
    counts.append(collections.Counter())
    with Count():
        return step(self)
trainer_module.Trainer.train_step = counted

from pretrain.cli import main
try:
    code = main(sys.argv[1:])
finally:
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.environ["SYNC_OUT"], "w") as f:
            json.dump([[[k[0], k[1], v] for k, v in c.items()] for c in counts], f)
sys.exit(code)
"""


def measure(setup: str, steps: int, accum: int, extra: list[str]) -> dict:
    precision, stage = setup.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "syncs.json"
        overrides = [f"train.precision={precision}", f"distributed.zero_stage={stage}",
                     f"train.max_steps={steps}", "train.micro_batch_size=2", f"train.global_batch_size={2 * accum}",
                     "data.seq_len=64", "logging.wandb=disabled", "logging.progress=false", "train.eval_every=0",
                     "data.validation=[]", f"train.run_dir={tmp}/run", *extra]
        env = dict(os.environ, SYNC_OUT=str(out), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONWARNINGS="ignore", WANDB_SILENT="true")
        proc = subprocess.run([sys.executable, "-c", CHILD, "train", str(REPO / "configs" / "tiny.yaml"),
                               *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"{setup}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        per_step = json.loads(out.read_text())[1:]  # the first step does start-up work
    totals: dict[str, dict[str, int]] = {"ours": {}, "deepspeed": {}, "other": {}, "host": {}}
    for step in per_step:
        for who, where, n in step:
            totals[who][where] = totals[who].get(where, 0) + n
    n = len(per_step)
    return {"setup": setup, "steps": n, "accum": accum,
            **{who: sum(places.values()) / n for who, places in totals.items()},
            "places": {who: {w: c / n for w, c in places.items()} for who, places in totals.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--setups", default="fp32:0,bf16:0,bf16:1,bf16:2,bf16:3,fp32:3",
                   help="precision:zero_stage, comma-separated")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("overrides", nargs="*", help="extra run-config overrides")
    a = p.parse_args()
    rows = [measure(s, a.steps, a.accum, a.overrides) for s in a.setups.split(",")]
    print(f"host syncs per optimizer step (gradient accumulation {a.accum}, {rows[0]['steps']} steps each)\n")
    print("| precision:stage | ours | DeepSpeed | other | where (DeepSpeed) |")
    print("|---|---|---|---|---|")  # (host-only reads are in --json)
    for r in rows:
        where = ", ".join(f"{w} x{c:g}" for w, c in sorted(r["places"]["deepspeed"].items(), key=lambda x: -x[1])[:3])
        print(f"| {r['setup']} | {r['ours']:g} | {r['deepspeed']:g} | {r['other']:g} | {where} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
