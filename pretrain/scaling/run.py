"""`pretrain scaling run DIR`: train the runs of a planned sweep on this machine, one after another.

A finished run (its last checkpoint is at its last step) is skipped; an interrupted one resumes
(`checkpoint.resume=auto`). Each run is a fresh `pretrain train` process (under torchrun with
--nproc > 1). `--index I` runs only the I-th run (what slurm/scaling_sweep.sbatch's array task I
does), and `--config-of I` prints its config path for the batch script. Runs trained under
another config than the one planned for them are refused before anything trains (plan.check_runs).
Ctrl-C stops the run in training after it saves (the trainer handles SIGINT as SIGTERM), then the
sweep.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from pretrain.errors import ConfigError, UserError
from pretrain.scaling.plan import check_runs, read_manifest


def planned_runs(sweep_dir: Path) -> list[dict]:
    """The sweep's runs in manifest order, once each: {run, config, steps}."""
    runs: dict[str, dict] = {}
    for row in read_manifest(sweep_dir):
        runs.setdefault(row["run"], {"run": row["run"], "config": row["config"], "steps": row["steps"]})
    return list(runs.values())


def _train(cmd: list[str]) -> tuple[int, bool]:
    """Run a trainer and wait for it: its exit code, and whether Ctrl-C was pressed. Ctrl-C reaches
    the trainer too (one process group): it saves and exits 75 (torchrun may report another code),
    so this process must not die of a KeyboardInterrupt first (subprocess.run would kill it)."""
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda *_: pressed.append(1))
    try:
        return subprocess.run(cmd).returncode, bool(pressed)
    finally:
        signal.signal(signal.SIGINT, previous)


def finished(run_dir: Path, steps: int) -> bool:
    from pretrain.checkpoint.layout import complete_checkpoints, read_meta

    done = complete_checkpoints(run_dir / "checkpoints")
    return bool(done) and read_meta(done[-1])["step"] >= steps


def run_sweep(sweep_dir: str, nproc: int = 1, index: int | None = None) -> None:
    sweep = Path(sweep_dir)
    runs = planned_runs(sweep)
    if index is not None:
        if not 0 <= index < len(runs):
            raise ConfigError(f"--index {index}: the sweep has runs 0-{len(runs) - 1}")
        runs = [runs[index]]
    check_runs(sweep, runs)
    failed = []
    for i, r in enumerate(runs, start=1):
        run_dir = sweep / "runs" / r["run"]
        if finished(run_dir, r["steps"]):
            print(f"[{i}/{len(runs)}] {r['run']}: finished, skipped", flush=True)
            continue
        print(f"[{i}/{len(runs)}] {r['run']}: training ({r['steps']} steps)", flush=True)
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] \
            if nproc > 1 else [sys.executable]
        code, interrupted = _train([*launcher, "-m", "pretrain", "train", r["config"], "checkpoint.resume=auto"])
        if code == 75 or interrupted:  # stopped by a signal after saving: stop the sweep too, resumable
            e = UserError(f"{r['run']} was stopped by a signal (checkpoint saved): run the sweep again to resume")
            e.exit_code = 75
            raise e
        if code:
            failed.append(f"{r['run']} (exit {code})")
    if failed:
        raise UserError(f"{len(failed)} run(s) failed: {', '.join(failed)}; the others are done. Fix the cause, then "
                        f"run `pretrain scaling run {sweep_dir}` again (finished runs are skipped)")


def config_of(sweep_dir: str, index: int) -> str:
    """The config of run `index`, or "" when that run is already finished."""
    runs = planned_runs(Path(sweep_dir))
    if not 0 <= index < len(runs):
        raise ConfigError(f"--config-of {index}: the sweep has runs 0-{len(runs) - 1}")
    r = runs[index]
    check_runs(Path(sweep_dir), [r])
    if finished(Path(sweep_dir) / "runs" / r["run"], r["steps"]):
        print(f"{r['run']}: finished, nothing to do", file=sys.stderr)  # stdout is the config path, for scripts
        return ""
    return r["config"]
