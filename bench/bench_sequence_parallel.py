"""What Ulysses sequence parallelism costs in time on this machine: 2 ranks splitting each sequence
(distributed.sequence_parallel=2) against 2 data-parallel ranks, the same sequences and tokens per step.

    python bench/bench_sequence_parallel.py                          # tiny preset, sequences of 2048 tokens
    python bench/bench_sequence_parallel.py --seq-len 4096 --rounds 4 --json sp.json
    python bench/bench_sequence_parallel.py train.activation_checkpointing=1   # overrides for both

Both arms train `--sequences` (default 2) sequences of --seq-len tokens per step on 2 ranks under
torchrun (gloo on CPU): data parallel, each rank one sequence per micro-batch; sequence parallel,
both ranks every sequence, each with half of its tokens, one micro-batch per sequence. The FLOPs
are the same; sequence parallelism adds the all-to-alls around each attention (4 in forward, 4 in
backward, 4 more in the recomputation of a checkpointed block) and runs smaller matmuls. Each round
runs each arm once in fresh processes, in alternating order (A B, B A, ...), so that the machine's
noise hits both alike. Step time is each rank's `Trainer.train_step` wall time (data, forward,
backward, update), the median over the steps after --warmup, the slower rank's; the all-to-all
share is the time inside `all_to_all_single` over that step time, of the rank that spent less there
(on gloo a blocking call: a rank that arrives first also waits for its peer's compute); the
exchange share adds DeepSpeed's layout copies around it (its `single_all_to_all`). Prints a table;
--json writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"

# Runs `pretrain train` with every train_step and every all-to-all inside it timed; each rank writes
# its figures per step to STEPS_DIR.
DRIVER = r"""
import json, os, sys, time
import torch.distributed as dist
from deepspeed.sequence import layer
from pretrain import trainer
from pretrain.cli import main

steps, now = [], {"a2a_s": 0.0, "a2a_bytes": 0, "a2a_calls": 0, "exchange_s": 0.0}
all_to_all_single = dist.all_to_all_single


def timed(output, input, *args, **kwargs):
    t0 = time.perf_counter()
    work = all_to_all_single(output, input, *args, **kwargs)
    now["a2a_s"] += time.perf_counter() - t0
    n = dist.get_world_size(kwargs.get("group"))
    now["a2a_bytes"] += input.numel() * input.element_size() * (n - 1) // n  # sent: the rank keeps 1/n
    now["a2a_calls"] += 1
    return work


single_all_to_all = layer.single_all_to_all


def exchange(*args, **kwargs):  # DeepSpeed's layout copies around the all-to-all, and the all-to-all
    t0 = time.perf_counter()
    out = single_all_to_all(*args, **kwargs)
    now["exchange_s"] += time.perf_counter() - t0
    return out


train_step = trainer.Trainer.train_step


def step(self):
    now.update(a2a_s=0.0, a2a_bytes=0, a2a_calls=0, exchange_s=0.0)
    t0 = time.perf_counter()
    loss = train_step(self)
    steps.append({"step_s": time.perf_counter() - t0, **now})
    return loss


dist.all_to_all_single = timed
layer.single_all_to_all = exchange
trainer.Trainer.train_step = step
rc = main(sys.argv[1:])
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(os.environ["STEPS_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "steps": steps}, f)
sys.exit(rc)
"""


def run(arm: str, a, overrides: list[str]) -> dict:
    """One arm in fresh processes: the slower rank's median step time and its all-to-all figures."""
    sp = ["distributed.sequence_parallel=2"] if arm == "SP=2" else []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false",
                   PYTHONWARNINGS="ignore", DS_ACCELERATOR="cpu", STEPS_DIR=tmp)
        driver = Path(tmp) / "driver.py"
        driver.write_text(DRIVER)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(driver), "train",
               str(TINY), f"data.seq_len={a.seq_len}", f"model.max_seq_len={a.seq_len}", "train.micro_batch_size=1",
               f"train.global_batch_size={a.sequences}", f"train.max_steps={a.steps}", "train.eval_every=0",
               "data.validation=[]", "logging.wandb=disabled", "logging.progress=false", f"logging.log_every={a.steps}",
               f"train.run_dir={tmp}/run", "train.precision=fp32", *overrides, *sp]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        ranks = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != 2:
        sys.exit(f"{arm} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    per_rank = []
    for r in ranks:
        timed = r["steps"][a.warmup:]
        per_rank.append({"step_s": statistics.median(s["step_s"] for s in timed),
                         "a2a_s": statistics.median(s["a2a_s"] for s in timed),
                         "exchange_s": statistics.median(s["exchange_s"] for s in timed),
                         "a2a_mib": timed[-1]["a2a_bytes"] / 2**20, "a2a_calls": timed[-1]["a2a_calls"]})
    # The step is the slower rank's; of the exchange time, the rank that waited less in it (a rank
    # that reaches an all-to-all first waits there for its peer: that is the peer's compute).
    step_s = max(r["step_s"] for r in per_rank)
    a2a_s, exchange_s = min(r["a2a_s"] for r in per_rank), min(r["exchange_s"] for r in per_rank)
    return {"step_s": step_s, "a2a_s": a2a_s, "exchange_s": exchange_s, "a2a_share": a2a_s / step_s,
            "exchange_share": exchange_s / step_s, "a2a_mib": per_rank[0]["a2a_mib"],
            "a2a_calls": per_rank[0]["a2a_calls"], "ranks": per_rank}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="config overrides for both arms")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--sequences", type=int, default=2, help="sequences per step (global batch)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank (2 ranks on 2 cores: 1)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    if a.steps <= a.warmup:
        sys.exit("--steps must be more than --warmup")
    rounds = []
    for i in range(a.rounds):
        got = {}
        for arm in (("DP=2", "SP=2") if i % 2 == 0 else ("SP=2", "DP=2")):
            got[arm] = run(arm, a, a.overrides)
        got["ratio"] = got["SP=2"]["step_s"] / got["DP=2"]["step_s"]
        rounds.append(got)
        print(f"round {i + 1}: DP=2 {got['DP=2']['step_s'] * 1000:7.0f} ms | "
              f"SP=2 {got['SP=2']['step_s'] * 1000:7.0f} ms "
              f"(all-to-all {got['SP=2']['a2a_share']:.1%}, exchange {got['SP=2']['exchange_share']:.1%}) | "
              f"SP / DP {got['ratio']:.3f}", flush=True)
    med = lambda arm, key: statistics.median(r[arm][key] for r in rounds)  # noqa: E731
    ratios = [r["ratio"] for r in rounds]
    tokens = a.sequences * a.seq_len
    sp = rounds[-1]["SP=2"]
    print()
    print(f"{a.sequences} x {a.seq_len} tokens per step, 2 ranks, configs/tiny.yaml, fp32, "
          f"overrides: {' '.join(a.overrides) or '-'}; medians of {a.rounds} rounds")
    print()
    print("| arm | step ms | tokens/s | all-to-all ms (share) | exchange ms (share) | all-to-all MiB sent per rank per step |")
    print("|---|---|---|---|---|---|")
    for arm in ("DP=2", "SP=2"):
        print(f"| {arm} | {med(arm, 'step_s') * 1000:.0f} | {tokens / med(arm, 'step_s'):,.0f} | "
              f"{med(arm, 'a2a_s') * 1000:.0f} ({med(arm, 'a2a_share'):.1%}) | "
              f"{med(arm, 'exchange_s') * 1000:.0f} ({med(arm, 'exchange_share'):.1%}) | "
              f"{rounds[-1][arm]['a2a_mib']:.2f} |")
    print()
    print(f"step time SP=2 / DP=2: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"{sp['a2a_calls']} all-to-alls per step")
    if a.json:
        import torch

        Path(a.json).write_text(json.dumps({
            "bench": "sequence_parallel", "seq_len": a.seq_len, "sequences": a.sequences, "overrides": a.overrides,
            "rounds": rounds, "median_ratio": statistics.median(ratios),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "torch": torch.__version__}}, indent=1))


if __name__ == "__main__":
    main()
