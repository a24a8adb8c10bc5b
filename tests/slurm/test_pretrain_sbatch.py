"""slurm/pretrain.sbatch running the real trainer on a real 2-node Slurm cluster (conftest.py).

Every job is `sbatch slurm/pretrain.sbatch configs/tiny.yaml ...` with GPUS_PER_NODE=0: one torchrun
agent and one training process per node, gloo. Checked: both nodes train one model; the time-limit
signal checkpoints, requeues and resumes into one loss curve and one W&B run; failures before and
after the launch fail the job; scancel saves and stops; a dry run starts nothing.
"""

import json
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from helpers import losses, read_metrics, run_train, wandb_history

pytestmark = pytest.mark.slow

SCRIPT = "slurm/pretrain.sbatch"
CONFIG = "configs/tiny.yaml"
# The test nodes have 2 CPUs and no GPUs: override the script's GPU-node defaults.
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1"]
CPU_ENV = {"GPUS_PER_NODE": "0"}
# A global batch of 4 sequences of 32 tokens: ~0.1-0.2 s a step with two ranks on this machine.
SEQ, BATCH = 32, 4
# The spike guard off: on 128-token batches the gradient norm is heavy-tailed (measured: 5 norms
# above mean + 6 std in 256 steps, then 3 within 50 steps, a rollback or, before the first
# checkpoint, exit 3). These jobs test the launch and the requeue; tests/test_resilience.py the guard.
FAST = [f"data.seq_len={SEQ}", "train.micro_batch_size=2", f"train.global_batch_size={BATCH}", "distributed.zero_stage=3",
        "logging.log_every=1", "logging.progress=false", "resilience.spike_sigma=0"]


def tail(text: str, n: int = 6000) -> str:
    """The end of a job log, for assertion messages (a full log has a line per step)."""
    return text if len(text) <= n else "...\n" + text[-n:]


def launch_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("launch: srun ")]
    assert lines, tail(output)
    return lines[0]


def train_steps(run_dir: Path) -> list[int]:
    """Steps of the training records in metrics.jsonl, in file order (repeats kept)."""
    return [r["step"] for r in read_metrics(run_dir) if "train/loss" in r]


def checkpoint(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def final_state(job, timeout: float = 30) -> str:
    """The job's state once every process has ended: `sbatch --wait` already returns while the
    job is COMPLETING (processes still saving). '' if Slurm purged it before we looked."""
    deadline, state = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        state = job.info().get("JobState", state)
        if state not in ("", "COMPLETING", "RUNNING", "PENDING", "REQUEUED"):
            return state
        time.sleep(0.2)
    return state


# ----------------------------------------------------------------------------- one job, two nodes

PLAIN_STEPS = 10


@pytest.fixture(scope="module")
def plain_job(slurm_cluster, tmp_path_factory):
    """A plain 2-node training job; the restart test compares its losses with this one's."""
    run_dir = tmp_path_factory.mktemp("plain")
    r = slurm_cluster.submit(SCRIPT, [CONFIG, *FAST, f"train.max_steps={PLAIN_STEPS}",
                                      "logging.wandb=disabled", f"train.run_dir={run_dir}"],
                             env=CPU_ENV, sbatch_opts=CPU_JOB, timeout=300)
    return SimpleNamespace(result=r, run_dir=run_dir)


def test_two_nodes_train_one_model(plain_job):
    r, run_dir = plain_job.result, plain_job.run_dir
    assert r.returncode == 0, tail(r.output)
    # One process per node, one process group: rank 0 reports a world of 2, once.
    assert len(re.findall(r"^model: .* \| world size 2 \|", r.output, re.M)) == 1, tail(r.output)
    assert re.search(rf"^done: {PLAIN_STEPS} steps, loss .*, run dir {run_dir}$", r.output, re.M)
    # One loss curve: every step logged once, by one rank, into one file.
    assert train_steps(run_dir) == list(range(1, PLAIN_STEPS + 1))
    ckpt = checkpoint(run_dir, PLAIN_STEPS)
    assert json.loads((ckpt / "meta.json").read_text())["world_size"] == 2
    # One ZeRO shard per rank: ranks 0 and 1 saved into the same checkpoint.
    assert sorted(p.name for p in ckpt.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert json.loads((ckpt / "data_state.json").read_text())["consumed"] == PLAIN_STEPS * BATCH

    line = launch_line(r.output)
    # Rendezvous on the first node, on a port of this job's own.
    port = 15000 + r.job_id % 937 * 16
    assert f"--rdzv-endpoint=node1:{port} --rdzv-id={r.job_id}-0" in line
    assert "--nnodes=2 --nproc-per-node=1" in line
    # A rerun resumes; the user's overrides come after, so they can still say otherwise.
    assert line.endswith(f"-m pretrain train {CONFIG} checkpoint.resume=auto {' '.join(FAST)} "
                         f"train.max_steps={PLAIN_STEPS} logging.wandb=disabled train.run_dir={run_dir}")


# ------------------------------------------------------------------ time limit -> requeue -> resume

# Slurm keeps time limits in whole minutes (--time=00:01:30 means 2:00) and checks them every 30 s,
# sending --signal=USR1@N at the first check less than N + 30 s before the end: with --time=1 and
# @10, 20-50 s into the run (measured); with --time=2 and @40, 50-80 s. The job must be training by
# then (a signal during start-up requeues it with nothing saved): a loaded 2-core machine took over
# 20 s to start both nodes' ranks.
TIME_LIMIT = ["--time=2", "--signal=USR1@40"]
# The first run must outlast the signal (at most 80 s into the job) however fast the machine is:
# every step sleeps SLOW_S (PRETRAIN_FAULT slow, on every rank), so REQUEUE_STEPS steps take over
# 90 s of training after the start-up, on an idle machine as on a loaded one. (The losses are
# those of a run without the sleep: the reference run below has none.)
SLOW_S, REQUEUE_STEPS = 1.0, 90


@pytest.fixture(scope="module")
def requeued(slurm_cluster, tmp_path_factory):
    """A job with a 2-minute limit, run once; the requeue tests below read what it left."""
    max_steps = REQUEUE_STEPS
    run_dir = tmp_path_factory.mktemp("requeue")
    start = time.monotonic()
    # decay_steps fixed: a reference run cut short has the same schedule (the test below).
    job = slurm_cluster.start(SCRIPT, [CONFIG, *FAST, f"train.max_steps={max_steps}", f"schedule.decay_steps={max_steps}",
                                       "logging.wandb=offline", f"train.run_dir={run_dir}"],
                              env={**CPU_ENV, "PRETRAIN_FAULT": f"slow@seconds={SLOW_S}"},
                              sbatch_opts=[*CPU_JOB, *TIME_LIMIT])
    job.wait_for(lambda: job.info().get("Restarts") == "1", 200,
                 f"requeue (did all {max_steps} steps finish before the signal? then raise REQUEUE_STEPS)")
    requeued_after = time.monotonic() - start
    # The rerun gets the same 2-minute limit, so it would be signalled and requeued again before
    # it could finish; give it room, so that the job has exactly one requeue.
    deadline = time.monotonic() + 10
    while slurm_cluster.run("scontrol", "update", f"JobId={job.job_id}", "TimeLimit=10",
                            check=False).returncode != 0:
        assert time.monotonic() < deadline, "scontrol update TimeLimit failed"
        time.sleep(0.5)
    result = job.wait(timeout=600)
    print(f"requeue job: {max_steps} steps, requeued after {requeued_after:.0f} s, "
          f"done after {time.monotonic() - start:.0f} s")
    return SimpleNamespace(result=result, run_dir=run_dir, max_steps=max_steps)


def test_time_limit_signal_checkpoints_requeues_and_resumes(requeued, tmp_path):
    r, run_dir, max_steps = requeued.result, requeued.run_dir, requeued.max_steps
    out = r.output
    assert r.returncode == 0, tail(out)

    # Both runs in one log (--open-mode=append): the first, then exactly one rerun, which Slurm
    # started with SLURM_RESTART_COUNT=1.
    assert len(re.findall(rf"^job {r.job_id} \(restart 0\)", out, re.M)) == 1, tail(out)
    assert len(re.findall(rf"^job {r.job_id} \(restart 1\)", out, re.M)) == 1, tail(out)
    # The first run got USR1 (the torchrun agents survived it: else no rank would have saved),
    # saved, and rank 0 requeued the job; Slurm then ended the run for the requeue, not the limit.
    saved = re.findall(r"^pretrain: received SIGUSR1: saved step (\d+); exiting with 75", out, re.M)
    assert len(saved) == 1, tail(out)
    step = int(saved[0])
    assert 0 < step < max_steps
    # (Not "...: ok": the requeue SIGTERMs the whole step, scontrol too, often before it exits.)
    assert re.search(rf"^pretrain: scontrol requeue {r.job_id}:", out, re.M), tail(out)
    assert "DUE TO JOB REQUEUE" in out and "DUE TO TIME LIMIT" not in out, tail(out)
    # The rerun continued from that checkpoint (checkpoint.resume=auto) and finished the run.
    assert re.search(rf"^resumed from {checkpoint(run_dir, step)} at step {step}$", out, re.M), tail(out)
    assert re.search(rf"^done: {max_steps} steps, ", out, re.M), tail(out)
    assert len(re.findall(r"^model: .* \| world size 2 \|", out, re.M)) == 2

    # One continuous loss curve: every step once (the rerun starts right after the saved step),
    # the LR schedule and token count carry on where they were, and no sequence was skipped or
    # seen twice.
    assert train_steps(run_dir) == list(range(1, max_steps + 1))
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    from pretrain.optim.schedule import lr_at

    s, peak = cfg["schedule"], cfg["optimizer"]["lr"]
    decay = s["decay_steps"] or max(1, max_steps - s["warmup_steps"])
    for rec in (r for r in read_metrics(run_dir) if "train/loss" in r):  # the rate step N used: lr_at(N - 1)
        assert rec["train/lr"] == pytest.approx(lr_at(rec["step"] - 1, peak, s["warmup_steps"], decay, s["min_lr"]))
        assert rec["tokens_seen"] == rec["step"] * BATCH * SEQ
    final = checkpoint(run_dir, max_steps)
    assert json.loads((final / "data_state.json").read_text())["consumed"] == max_steps * BATCH
    # The weights, optimizer state and data position came back: up to 2 steps past the resume,
    # the job's losses are bitwise those of an uninterrupted run (2 local ranks, the same schedule),
    # wherever the signal came.
    reference = tmp_path / "reference"
    run_train([*FAST, f"train.max_steps={step + 2}", f"schedule.decay_steps={max_steps}", "logging.wandb=disabled",
               f"train.run_dir={reference}"], nproc=2)
    loss = losses(run_dir)
    assert {n: loss[n] for n in range(1, step + 3)} == losses(reference), step

    # One W&B run: the rerun continued the run's id (its W&B id; in run.json and every checkpoint).
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    run_id = json.loads((final / "meta.json").read_text())["run_id"]
    assert run_id == json.loads((run_dir / "run.json").read_text())["run_id"]
    assert run_id and all(p.name.endswith(f"-{run_id}") for p in runs), (run_id, runs)


def test_wandb_history_is_complete_across_the_requeue(requeued, tmp_path):
    steps = []
    for run in sorted((requeued.run_dir / "wandb").glob("offline-run-*")):
        view = tmp_path / run.name  # wandb_history reads the one run under DIR/wandb/
        (view / "wandb").mkdir(parents=True)
        (view / "wandb" / run.name).symlink_to(run)
        steps += [row["_step"] for row in wandb_history(view) if "train/loss" in row]
    assert sorted(steps) == list(range(1, requeued.max_steps + 1))


# ------------------------------------------------------------------------------------- failures

def test_bad_config_fails_once_before_launch(slurm_cluster):
    # `pretrain config show` runs once on the head node before anything is launched.
    r = slurm_cluster.submit(SCRIPT, [CONFIG, "train.max_stpes=5"], sbatch_opts=CPU_JOB,
                             env=CPU_ENV, timeout=60)
    assert r.returncode != 0, r.output
    errors = [line for line in r.output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "max_stpes" in errors[0], r.output
    assert "launch:" not in r.output


def test_failure_inside_training_fails_the_job(slurm_cluster, tmp_path):
    # The config is valid, so the job launches; then every rank fails to find the checkpoint.
    missing = tmp_path / "elsewhere" / "checkpoints" / "step_00000100"
    r = slurm_cluster.submit(SCRIPT, [CONFIG, *FAST, "logging.wandb=disabled", f"train.run_dir={tmp_path / 'run'}",
                                      f"checkpoint.resume={missing}"],
                             env=CPU_ENV, sbatch_opts=CPU_JOB, timeout=120)
    assert r.returncode != 0, tail(r.output)
    assert "launch: srun" in r.output
    # One line (both ranks failed alike: rank 0 prints it), no traceback from our code (torchrun
    # adds its own report, which quotes the line).
    errors = [line for line in r.output.splitlines() if line.startswith("pretrain: error:")]
    assert errors == [f"pretrain: error: checkpoint {missing} does not exist"], tail(r.output)
    assert not re.search(r'File ".*/pretrain/', r.output), tail(r.output)
    assert "done:" not in r.output


# --------------------------------------------------------------- hangs and crashes -> restart

def test_a_hang_and_a_crash_restart_inside_the_allocation(slurm_cluster, plain_job, tmp_path):
    """PRETRAIN_FAULT on the 2-node cluster, one job: rank 1 hangs in step 5 (its watchdog names it
    and every rank exits 4); the job step runs again in the same allocation and resumes from the
    checkpoint of step 4; there rank 0 is killed in step 7 (nothing recorded), and the step runs a
    third time, resumes from step 4 again and finishes: every step logged once after the checkpoint
    it resumed from, and the same losses as the plain job's. (Each fault fires once per run dir.)"""
    steps = PLAIN_STEPS
    r = slurm_cluster.submit(SCRIPT, [CONFIG, *FAST, f"train.max_steps={steps}", "logging.wandb=disabled",
                                      "checkpoint.every=4", "resilience.hang_timeout_s=8",
                                      f"train.run_dir={tmp_path}"],
                             env={**CPU_ENV, "PRETRAIN_FAULT": "hang@rank=1,step=5;crash@rank=0,step=7"},
                             sbatch_opts=CPU_JOB, timeout=600)
    assert r.returncode == 0, tail(r.output)
    restarts = re.findall(r"^restart (\d) of 3 in this allocation after (a hang|a crash) ", r.output, re.M)
    assert restarts == [("1", "a hang"), ("2", "a crash")], tail(r.output)
    hangs = [x for x in r.output.splitlines() if x.startswith("pretrain: hang at step 5")]
    assert len(hangs) == 1 and "rank 1 (host node2, in forward/backward of step 5)" in hangs[0], tail(r.output)
    # The crash: the killed rank's node, not the node whose rank then failed on the lost peer (a
    # hang names its hosts itself: no such line for it).
    assert re.findall(r"^the first node to fail: (\S+) ", r.output, re.M) == ["node1"], tail(r.output)
    assert len(re.findall(r"^resumed from .*step_00000004 at step 4$", r.output, re.M)) == 2, tail(r.output)
    assert re.search(rf"^done: {steps} steps", r.output, re.M)
    # Every step once: each resume drops what the start it replaces logged after step 4 (the hung
    # start nothing; the killed one steps 5 and 6, or lost them with its buffers).
    assert train_steps(tmp_path) == list(range(1, steps + 1))
    assert losses(tmp_path) == losses(plain_job.run_dir)


def test_a_node_named_in_two_failures_is_left_out_for_a_spare(slurm_cluster, tmp_path):
    """A 2-node allocation that trains on 1 (PRETRAIN_NODES=1): rank 0, on node1, hangs in step 3
    and, after the restart, is killed in step 6: node1 is named by a hang's record and by a crash's
    first failed node. The second restart leaves node1 out and runs on the spare, node2, and the job
    finishes with the losses of a run without faults."""
    steps = 8
    args = [*FAST, f"train.max_steps={steps}", "logging.wandb=disabled", "checkpoint.every=2",
            "resilience.hang_timeout_s=8"]
    r = slurm_cluster.submit(SCRIPT, [CONFIG, *args, f"train.run_dir={tmp_path / 'run'}"],
                             env={**CPU_ENV, "PRETRAIN_NODES": "1", "PRETRAIN_FAULT": "hang@rank=0,step=3;crash@rank=0,step=6"},
                             sbatch_opts=CPU_JOB, timeout=600)
    assert r.returncode == 0, tail(r.output)
    restarts = re.findall(r"^restart (\d) of 3 in this allocation after (a hang|a crash) ", r.output, re.M)
    assert restarts == [("1", "a hang"), ("2", "a crash")], tail(r.output)
    assert re.findall(r"^leaving out node (\S+): named in 2 failures", r.output, re.M) == ["node1"], tail(r.output)
    launches = [x for x in r.output.splitlines() if x.startswith("launch: srun ")]
    assert len(launches) == 3 and "--nodelist=node1 " in launches[1] and "--nodelist=node2 " in launches[2]
    assert "--rdzv-endpoint=node2:" in launches[2]
    assert re.search(rf"^done: {steps} steps", r.output, re.M)
    run_train([*args, f"train.run_dir={tmp_path / 'plain'}"])
    assert losses(tmp_path / "run") == losses(tmp_path / "plain")


# ------------------------------------------------------------------------------------- scancel

def test_scancel_signal_term_saves_and_stops_without_requeue(slurm_cluster, tmp_path):
    """`scancel --signal=TERM` reaches the training processes (not srun): every rank finishes its
    step, the checkpoint is saved, exit 75, and nothing is requeued."""
    job = slurm_cluster.start(SCRIPT, [CONFIG, *FAST, "train.max_steps=100000", "logging.wandb=offline",
                                       f"train.run_dir={tmp_path}"],
                              env=CPU_ENV, sbatch_opts=CPU_JOB)
    metrics = tmp_path / "metrics.jsonl"
    job.wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 120, "training")
    slurm_cluster.run("scancel", "--signal=TERM", str(job.job_id))
    r = job.wait(timeout=60)
    assert r.returncode != 0
    saved = re.findall(r"^pretrain: received SIGTERM: saved step (\d+); exiting with 75", r.output, re.M)
    assert len(saved) == 1, tail(r.output)
    assert (checkpoint(tmp_path, int(saved[0])) / "manifest.json").is_file()
    assert "scontrol requeue" not in r.output and "(restart 1)" not in r.output
    assert "DUE TO JOB REQUEUE" not in r.output


def test_scancel_stops_for_good(slurm_cluster, tmp_path):
    """Plain scancel: srun answers its own SIGTERM by killing the step at once, so the trainers'
    save may or may not finish (docs/slurm.md); either way the job stays cancelled, and a checkpoint
    folder left behind is complete and resumable."""
    job = slurm_cluster.start(SCRIPT, [CONFIG, *FAST, "train.max_steps=100000", "logging.wandb=offline",
                                       f"train.run_dir={tmp_path}", "checkpoint.every=2"],
                              env=CPU_ENV, sbatch_opts=CPU_JOB)
    metrics = tmp_path / "metrics.jsonl"
    job.wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 4, 120, "training")
    slurm_cluster.run("scancel", str(job.job_id))  # SIGTERM to every process of the job
    r = job.wait(timeout=60)
    state = final_state(job)
    # Not `sbatch --wait`'s exit code: it is 0 when the batch shell died of the SIGTERM itself and
    # non-zero when it exited after srun failed first, a race of the cancel. The state is what counts.
    assert state == "CANCELLED", state
    assert "scontrol requeue" not in r.output and "(restart 1)" not in r.output
    assert "DUE TO JOB REQUEUE" not in r.output
    from pretrain.checkpoint.layout import open_checkpoint

    steps = sorted(tmp_path.glob("checkpoints/step_*"))
    assert steps, tail(r.output)  # checkpoint.every=2 saved before the cancel
    for step in steps:
        open_checkpoint(step)  # complete and intact, whatever the kill interrupted


# ------------------------------------------------------------------------------------- dry run

def test_dry_run_prints_config_and_command_without_running(slurm_cluster):
    r = slurm_cluster.submit(SCRIPT, [CONFIG, "train.max_steps=7"], sbatch_opts=CPU_JOB,
                             env={**CPU_ENV, "PRETRAIN_DRY_RUN": "1"}, timeout=60)
    assert r.returncode == 0, r.output
    # The resolved config, as the trainer will see it.
    assert re.search(r"^  max_steps: 7$", r.output, re.M), r.output
    assert re.search(r"^  resume: auto$", r.output, re.M), r.output
    line = launch_line(r.output)
    assert "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=node1:" in line
    assert line.endswith(f"-m pretrain train {CONFIG} checkpoint.resume=auto train.max_steps=7")
    assert "bash -c 'trap \"\" USR1; trap : TERM INT; \"$@\"; rc=$?;" in line and "' torchrun " in line
    assert not re.search(r"world size|Traceback", r.output)


# ------------------------------------------------------------------ srun without torchrun

def test_srun_one_task_per_rank_without_torchrun(slurm_cluster, tmp_path):
    """`srun python -m pretrain train ...` with one task per rank: the trainer builds its group from
    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and the job's first node (no torchrun variables)."""
    script = tmp_path / "direct.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1\n"
        f'srun "$PYTHON" -m pretrain train {CONFIG} {" ".join(FAST)} train.max_steps=3 '
        f"logging.wandb=disabled train.run_dir={tmp_path / 'run'}\n")
    r = slurm_cluster.submit(script, sbatch_opts=CPU_JOB, env=CPU_ENV, timeout=150)
    assert r.returncode == 0, tail(r.output)
    assert "world size 2" in r.output and "done: 3 steps" in r.output, tail(r.output)
    ckpt = checkpoint(tmp_path / "run", 3)
    assert json.loads((ckpt / "meta.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in ckpt.glob("zero_pp_rank_*_optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
