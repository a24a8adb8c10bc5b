"""How long a checkpoint save holds up training, against a plain copy of the same files.

    python bench/bench_checkpoint.py --preset tiny
    python bench/bench_checkpoint.py --preset 125m --json bench-checkpoint-125m.json

Trains 16 steps (1 process, ZeRO-3, fp32 on CPU) with a checkpoint every 4, then resumes once
(verify + load). A save blocks the loop only while the state is copied to host memory
(`checkpoint/blocking_s`); writing, fsync, checksums and the rename run in the background
(`checkpoint/write_s`, the whole save). The figures are medians over the saves after the first;
the copy (shutil.copytree of the final checkpoint, from the page cache) is timed three times
between them. Prints a table; --json writes it. Figures go in docs/performance.md.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EVERY = 4  # steps between saves: time for the previous save to finish, as in a real run


def train(run_dir: Path, preset: str, steps: int, resume: bool) -> None:
    cmd = [sys.executable, "-m", "pretrain", "train", str(REPO / "configs" / "tiny.yaml"), f"model.preset={preset}",
           "model.max_seq_len=256", "data.seq_len=64", "train.micro_batch_size=1", f"train.max_steps={steps}",
           "distributed.zero_stage=3", f"checkpoint.every={EVERY}", "checkpoint.keep_last=2", "logging.wandb=disabled",
           "logging.progress=false", f"train.run_dir={run_dir}", "train.eval_every=0", "data.validation=[]",
           "checkpoint.resume=" + ("auto" if resume else "none")]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)


def copy_time(src: Path, dst: Path) -> float:
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    shutil.copytree(src, dst)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        run = Path(tmp) / "run"
        train(run, a.preset, 4 * EVERY, resume=False)
        ckpt = run / "checkpoints" / f"step_{4 * EVERY:08d}"
        copies = [copy_time(ckpt, Path(tmp) / "copy") for _ in range(3)]
        train(run, a.preset, 4 * EVERY + 1, resume=True)  # verify + load, train 1 step, save
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    blocking = [r["checkpoint/blocking_s"] for r in records if "checkpoint/blocking_s" in r][1:4]
    write = [r["checkpoint/write_s"] for r in records if "checkpoint/write_s" in r][1:4]
    size = next(r["checkpoint/size_mb"] for r in records if "checkpoint/size_mb" in r)
    load = next(r for r in records if "checkpoint/load_s" in r)
    out = {"preset": a.preset, "size_mb": size, "blocking_s": statistics.median(blocking),
           "write_s": statistics.median(write), "copy_s": statistics.median(copies),
           "verify_s": load["checkpoint/verify_s"], "load_s": load["checkpoint/load_s"]}
    out["blocking_over_copy"] = out["blocking_s"] / out["copy_s"]
    print(f"preset {a.preset}: checkpoint {size:.1f} MB (fp32 weights + Adam moments)")
    print("| blocks the loop | whole save (background) | plain copy | blocking / copy | verify | load |")
    print("|---|---|---|---|---|---|")
    print(f"| {out['blocking_s']:.3f} s | {out['write_s']:.2f} s ({size / out['write_s']:.0f} MB/s) | "
          f"{out['copy_s']:.3f} s ({size / out['copy_s']:.0f} MB/s) | {out['blocking_over_copy']:.2f} | "
          f"{out['verify_s']:.2f} s | {out['load_s']:.2f} s |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
