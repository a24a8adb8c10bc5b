"""slurm/scaling_sweep.sbatch on the real 2-node test cluster: a planned sweep runs as a job array,
one task per run, throttled (%2: never more than 2 at once); a task signalled for preemption saves,
requeues itself and resumes; a
finished run's task does nothing; every run carries its sweep in its config and its W&B group."""

import csv
import re
import time

import pytest
import yaml

from helpers import read_metrics, read_wandb_records
from pretrain.cli import main

pytestmark = pytest.mark.slow

SCRIPT = "slurm/scaling_sweep.sbatch"
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1", "--nodes=1"]
CPU_ENV = {"GPUS_PER_NODE": "0"}
SMALL = ["data.seq_len=32", "train.micro_batch_size=4", "train.global_batch_size=4", "logging.log_every=1",
         "logging.wandb=offline", "logging.progress=false", "checkpoint.every=5", "train.eval_batches=1"]


def test_a_sweep_runs_as_a_job_array_and_a_preempted_task_resumes(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    # A budget of 6e8 FLOPs: runs of 25, 17 and 9 steps, each past the preemption in step 3 and past
    # a periodic checkpoint (every 5) after its resume.
    assert main(["scaling", "plan", "configs/scaling_tiny.yaml", *SMALL, "--budgets", "6e8", "--sizes", "3",
                 "--span", "4", "--out", str(sweep), "--name", "array-test"]) == 0
    rows = list(csv.DictReader(open(sweep / "manifest.csv")))
    runs = sorted({r["run"] for r in rows})
    assert len(runs) == 3 and min(int(r["steps"]) for r in rows) > 5
    # Every task is preempted in its step 3 (SIGUSR1, as the time-limit warning sends; PRETRAIN_FAULT
    # fires once per run dir, so the requeued task trains through).
    job = slurm_cluster.start(SCRIPT, [sweep], env={**CPU_ENV, "PRETRAIN_FAULT": "signal@step=3,signum=10"},
                              sbatch_opts=[*CPU_JOB, "--array=0-2%2"])
    running = 0  # the most tasks seen running at once: %2 allows 2 (polled: a third would show)
    deadline = time.monotonic() + 400
    while job.proc.poll() is None and time.monotonic() < deadline:
        out = slurm_cluster.run("squeue", "-h", "-r", "-j", str(job.job_id), "-t", "RUNNING", "-o", "%i", check=False)
        running = max(running, len(out.stdout.split()))
        time.sleep(0.3)
    r = job.wait(timeout=30)
    assert r.returncode == 0, r.output[-6000:]
    assert running == 2, running
    for run in runs:
        steps = {int(x["steps"]) for x in rows if x["run"] == run}.pop()
        assert (sweep / "runs" / run / "checkpoints" / f"step_{steps:08d}").is_dir(), (run, r.output[-4000:])
        assert [x["step"] for x in read_metrics(sweep / "runs" / run) if "eval/loss" in x][-1] == steps
    saved = re.findall(r"^pretrain: received SIGUSR1: saved step (\d+); exiting with 75", r.output, re.M)
    assert saved == ["3"] * 3, r.output[-6000:]
    assert len(re.findall(r"^resumed from .*step_00000003 at step 3$", r.output, re.M)) == 3, r.output[-6000:]
    # Each task requeued itself alone, by its array name (the array's id would requeue every task,
    # killing the running ones, which would then resume a second time).
    requeued = re.findall(r"pretrain: scontrol requeue (\S+): ok", r.output)
    assert sorted(requeued) == [f"{job.job_id}_{i}" for i in range(3)], r.output[-6000:]
    assert len(re.findall(r"^resumed from ", r.output, re.M)) == 3, r.output[-6000:]
    run1 = sweep / "runs" / _run_of(sweep, 1)
    # Task 1's run has every step once: the rerun continued where the preempted run saved.
    steps1 = [x["step"] for x in read_metrics(run1) if "train/loss" in x]
    assert steps1 == list(range(1, max(steps1) + 1))
    # The sweep's name travels with each run: its config and its W&B run's group.
    groups = {rec.run.run_group for rec in read_wandb_records(run1) if rec.WhichOneof("record_type") == "run"}
    assert groups - {""} == {"array-test"}, groups  # (a resumed run's update record may leave it unset)
    assert yaml.safe_load((run1 / "config.yaml").read_text())["scaling"]["sweep"] == "array-test"
    # Submitting again: every task finds its run finished and does nothing.
    r = slurm_cluster.submit(SCRIPT, [sweep], env=CPU_ENV, sbatch_opts=[*CPU_JOB, "--array=0-2"], timeout=120)
    assert r.returncode == 0 and r.output.count("finished before, nothing to do") == 3, r.output[-3000:]


def _run_of(sweep, index: int) -> str:
    from pretrain.scaling.run import planned_runs

    return planned_runs(sweep)[index]["run"]


def test_an_array_index_past_the_sweep_is_one_line(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    assert main(["scaling", "plan", "configs/scaling_tiny.yaml", *SMALL, "--budgets", "5e9", "--sizes", "3",
                 "--out", str(sweep)]) == 0
    start = time.monotonic()
    r = slurm_cluster.submit(SCRIPT, [sweep], env=CPU_ENV, sbatch_opts=[*CPU_JOB, "--array=7"], timeout=60)
    assert r.returncode != 0 and "pretrain: error: --config-of 7: the sweep has runs 0-2" in r.output, r.output
    assert time.monotonic() - start < 60
