"""Training throughput on this machine and the share of step time outside forward/backward/optimizer.

    python bench/bench_train.py                       # tiny preset, builtin data, 1 process
    python bench/bench_train.py --nproc 2             # 2 CPU ranks under torchrun (gloo)
    python bench/bench_train.py model.preset=125m ... # any overrides

Reads the run's metrics.jsonl: tokens/s, data-wait share (time blocked on the data loader) and
the share outside compute (data wait + logging + checkpoint checks + DeepSpeed's non-hook work:
everything but the forward, backward and optimizer calls), averaged over the logged windows after
the first (warm-up). Figures go in docs/training.md.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args = ["train", str(REPO / "configs" / "tiny.yaml"), f"train.max_steps={a.steps}", "logging.log_every=10",
                "logging.wandb=disabled", "logging.progress=false", f"train.run_dir={tmp}", *a.overrides]
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc)] if a.nproc > 1 \
            else [sys.executable]
        subprocess.run([*launcher, "-m", "pretrain", *args], check=True, cwd=REPO)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "perf/tokens_per_s" in r][1:]
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    print(f"tokens/s {mean('perf/tokens_per_s'):,.0f} (per device {mean('perf/tokens_per_s_per_device'):,.0f}), "
          f"step {mean('perf/step_time_s') * 1000:.0f} ms, data wait {mean('perf/data_wait_share'):.1%}, "
          f"outside fwd/bwd/optimizer {mean('perf/outside_compute_share'):.1%}")
    if a.json:
        keys = ("perf/tokens_per_s", "perf/tokens_per_s_per_device", "perf/step_time_s", "perf/data_wait_share",
                "perf/outside_compute_share")
        Path(a.json).write_text(json.dumps({"nproc": a.nproc, "overrides": a.overrides, **{k: mean(k) for k in keys}},
                                           indent=1))


if __name__ == "__main__":
    main()
