"""Checkpoint save/load time and size against a plain copy of the same bytes, in one run.

    python bench/bench_checkpoint.py --preset tiny
    python bench/bench_checkpoint.py --preset 125m

Trains 1 step (1 process, ZeRO-3, fp32 on CPU), saves, resumes (verify + load), then copies the
checkpoint folder with shutil.copytree; prints MB/s of each. Figures go in docs/checkpoints.md.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(run_dir: Path, preset: str, steps: int, resume: bool) -> None:
    cmd = [sys.executable, "-m", "pretrain", "train", str(REPO / "configs" / "tiny.yaml"), f"model.preset={preset}",
           "model.max_seq_len=256", "data.seq_len=64", "train.micro_batch_size=1", f"train.max_steps={steps}",
           "logging.wandb=disabled", "logging.progress=false", f"train.run_dir={run_dir}",
           "checkpoint.resume=" + ("auto" if resume else "none")]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        run = Path(tmp) / "run"
        train(run, a.preset, 1, resume=False)
        train(run, a.preset, 2, resume=True)  # verify + load step 1, train 1 step, save step 2
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        save = next(r for r in records if "checkpoint/save_s" in r)
        load = next(r for r in records if "checkpoint/load_s" in r)
        ckpt = run / "checkpoints" / "step_00000001"
        if not ckpt.exists():
            ckpt = run / "checkpoints" / "step_00000002"
        size = save["checkpoint/size_mb"]
        t0 = time.perf_counter()
        shutil.copytree(ckpt, Path(tmp) / "copy")
        copy_s = time.perf_counter() - t0
        print(f"preset {a.preset}: checkpoint {size:.1f} MB")
        print(f"  save   {save['checkpoint/save_s']:.2f} s  {size / save['checkpoint/save_s']:.0f} MB/s "
              f"(DeepSpeed shards + manifest checksums)")
        print(f"  verify {load['checkpoint/verify_s']:.2f} s  {size / load['checkpoint/verify_s']:.0f} MB/s (checksums)")
        print(f"  load   {load['checkpoint/load_s']:.2f} s  {size / load['checkpoint/load_s']:.0f} MB/s")
        print(f"  copy   {copy_s:.2f} s  {size / copy_s:.0f} MB/s (shutil.copytree of the same files)")


if __name__ == "__main__":
    main()
