"""slurm/pretrain.sbatch run by bash outside Slurm in dry-run mode: no cluster needed."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = "configs/tiny.yaml"


def dry_run(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    return subprocess.run(["bash", "slurm/pretrain.sbatch", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**base, "PRETRAIN_DRY_RUN": "1", **env})


def launch_line(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.startswith("launch: srun ")]
    return line


def test_one_process_per_gpu_and_one_on_cpu():
    r = dry_run(CONFIG, GPUS_PER_NODE="8")
    assert r.returncode == 0, r.stderr
    assert "--nnodes=1 --nproc-per-node=8" in launch_line(r.stdout)
    r = dry_run(CONFIG, GPUS_PER_NODE="0")
    assert r.returncode == 0, r.stderr
    assert "--nnodes=1 --nproc-per-node=1" in launch_line(r.stdout)


def test_resume_auto_comes_before_user_overrides():
    r = dry_run(CONFIG, "checkpoint.resume=none", "train.run_dir=runs/a b", GPUS_PER_NODE="0")
    assert r.returncode == 0, r.stderr
    assert "\n  resume: none\n" in r.stdout  # the user's override wins
    assert launch_line(r.stdout).endswith(
        f"train {CONFIG} checkpoint.resume=auto checkpoint.resume=none 'train.run_dir=runs/a b'")


def test_bad_config_or_no_config_fails_with_one_line():
    r = dry_run(CONFIG, "train.max_stpes=5", GPUS_PER_NODE="0")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "max_stpes" in r.stderr
    assert "launch:" not in r.stdout
    r = dry_run()
    assert r.returncode == 2 and r.stderr.startswith("usage: sbatch slurm/pretrain.sbatch CONFIG")
