"""How far bf16 training drifts from fp32, with gradients accumulated (and reduced) in fp32 or in bf16
(`distributed.grad_dtype`): the same run, seed and data three times, losses compared step by step.

    python bench/bench_precision.py                                # 50 steps, accumulation 16, ZeRO-3
    python bench/bench_precision.py --steps 50 --accum 16 --json out.json distributed.zero_stage=1

Each run is `pretrain train configs/tiny.yaml` in its own process (1 rank, micro-batch 2). Prints the
mean and largest |loss - fp32 loss| over the steps, and over the last 10; figures in docs/performance.md.
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
RUNS = {"fp32": ["train.precision=fp32"],
        "bf16, fp32 gradients": ["train.precision=bf16", "distributed.grad_dtype=fp32"],
        "bf16, bf16 gradients": ["train.precision=bf16", "distributed.grad_dtype=bf16"]}


def losses(overrides: list[str]) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pretrain", "train", str(REPO / "configs" / "tiny.yaml"), *overrides,
               f"train.run_dir={tmp}/run", "logging.wandb=disabled", "logging.progress=false", "logging.log_every=1"]
        env = dict(os.environ, OMP_NUM_THREADS="2", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{overrides}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--accum", type=int, default=16)
    p.add_argument("--json")
    p.add_argument("overrides", nargs="*", default=["distributed.zero_stage=3"])
    a = p.parse_args()
    common = [f"train.max_steps={a.steps}", "train.micro_batch_size=2", f"train.global_batch_size={2 * a.accum}",
              "train.eval_every=0", "schedule.warmup_steps=5", *a.overrides]
    result = {name: losses(common + extra) for name, extra in RUNS.items()}
    ref = result["fp32"]
    print(f"{a.steps} steps, gradient accumulation {a.accum}, {' '.join(a.overrides)}; final fp32 loss {ref[a.steps]:.4f}\n")
    print("| run | mean abs diff | max abs diff | mean abs diff, last 10 steps |")
    print("|---|---|---|---|")
    rows = {}
    for name, got in result.items():
        diffs = [abs(got[s] - ref[s]) for s in sorted(ref)]
        rows[name] = {"mean": sum(diffs) / len(diffs), "max": max(diffs), "last10": sum(diffs[-10:]) / 10}
        print(f"| {name} | {rows[name]['mean']:.4f} | {rows[name]['max']:.4f} | {rows[name]['last10']:.4f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"losses": result, "diffs": rows}, indent=1))


if __name__ == "__main__":
    main()
