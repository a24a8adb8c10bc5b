"""slurm/pretrain.sbatch on a real 2-node Slurm cluster (tests/slurm/conftest.py).

Training runs are the stand-in trainer tests/slurm/fake_train.py (PRETRAIN_MODULE=fake_train), which
keeps the real trainer's contract: gloo process group from torchrun, USR1 -> checkpoint -> requeue ->
exit 75, resume with checkpoint.resume=auto. Config checks and dry runs use the real `pretrain`.
"""

import os
import re
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
SCRIPT = "slurm/pretrain.sbatch"
CONFIG = "configs/tiny.yaml"
# The test nodes have 2 CPUs and no GPUs: override the script's GPU-node defaults.
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1"]


def fake_trainer(**env: str) -> dict[str, str]:
    """Environment that makes the script launch fake_train instead of pretrain, one process per node."""
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return {"PRETRAIN_MODULE": "fake_train", "PYTHONPATH": pythonpath, "GPUS_PER_NODE": "0", **env}


def rank_lines(output: str) -> list[dict[str, str]]:
    """The `rank=0 world_size=2 ... host=node1 ...` lines fake_train prints after joining the group."""
    return [dict(kv.split("=", 1) for kv in m.group(1).split())
            for m in re.finditer(r"^fake_train: (rank=\d+ world_size=.*)$", output, re.M)]


def launch_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("launch: srun ")]
    assert lines, output
    return lines[0]


def test_two_nodes_form_one_world(slurm_cluster, tmp_path):
    r = slurm_cluster.submit(SCRIPT, [CONFIG, f"fake.run_dir={tmp_path}", "fake.steps=3"],
                             env=fake_trainer(), sbatch_opts=CPU_JOB)
    assert r.returncode == 0, r.output
    ranks = rank_lines(r.output)
    assert sorted(int(x["rank"]) for x in ranks) == [0, 1], r.output
    assert {x["world_size"] for x in ranks} == {"2"}
    assert {x["allreduce"] for x in ranks} == {"3"}  # 1 + 2: both ranks in one group
    assert {x["host"] for x in ranks} == {"node1", "node2"}  # one process per node
    assert {x["restart"] for x in ranks} == {"0"}
    assert "fake_train: finished at step 3" in r.output

    line = launch_line(r.output)
    # Rendezvous on the first node, on a port of this job's own.
    port = 15000 + r.job_id % 15000
    assert f"--rdzv-endpoint=node1:{port} --rdzv-id={r.job_id}" in line
    assert "--nnodes=2 --nproc-per-node=1" in line
    # A rerun resumes; the user's overrides come after, so they can still say otherwise.
    assert line.endswith(f"train {CONFIG} checkpoint.resume=auto fake.run_dir={tmp_path} fake.steps=3")


def test_time_limit_signal_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):
    # Slurm checks time limits periodically, so USR1@N comes within about 30 s either side of N s
    # before the limit (measured: 23-41 s before a 1:30 limit with @40): 20-70 s into the first run,
    # after fake_train has installed its handler; the rerun finishes (10-15 s) before its own window.
    start = time.monotonic()
    r = slurm_cluster.submit(
        SCRIPT, [CONFIG, f"fake.run_dir={tmp_path}", "fake.steps=1000000", "fake.steps_after_resume=5"],
        env=fake_trainer(), sbatch_opts=[*CPU_JOB, "--time=00:01:30", "--signal=USR1@40"],
        timeout=180)
    elapsed = time.monotonic() - start
    out = r.output
    assert r.returncode == 0, out

    # Both runs in one log (--open-mode=append): the first, then exactly one requeued rerun.
    assert len(re.findall(rf"^job {r.job_id} \(restart 0\)", out, re.M)) == 1, out
    assert len(re.findall(rf"^job {r.job_id} \(restart 1\)", out, re.M)) == 1, out
    # Every rank got the signal's news, finished its step and saved the same step; the torchrun
    # agents survived USR1 (else srun would report exit code 138 and no rank would save).
    saved = re.findall(r"^fake_train: rank=(\d) signal=10 saved step (\d+)", out, re.M)  # 10: USR1
    assert sorted(rank for rank, _ in saved) == ["0", "1"], out
    step = int(saved[0][1])
    assert {int(s) for _, s in saved} == {step}
    assert f"fake_train: requeued job {r.job_id}" in out
    assert "DUE TO JOB REQUEUE" in out and "DUE TO TIME LIMIT" not in out, out
    # The rerun continued from the checkpoint (checkpoint.resume=auto) and finished.
    assert sorted(re.findall(rf"^fake_train: rank=(\d) resumed from step {step}$", out, re.M)) == ["0", "1"]
    assert f"fake_train: finished at step {step + 5}" in out
    assert {x["restart"] for x in rank_lines(out)} == {"0", "1"}
    assert (tmp_path / "ckpt-rank0.txt").read_text() == str(step)
    print(f"USR1 at step {step}; job done in {elapsed:.0f} s")


def test_failing_training_fails_the_job(slurm_cluster, tmp_path):
    # Rank 1 exits 3 right after joining; rank 0 would wait in its next all-reduce. srun's
    # --kill-on-bad-exit ends the step instead of letting the job hang until a collective timeout.
    start = time.monotonic()
    r = slurm_cluster.submit(SCRIPT, [CONFIG, f"fake.run_dir={tmp_path}", "fake.steps=1000000",
                                      "fake.fail_rank=1"],
                             env=fake_trainer(), sbatch_opts=CPU_JOB, timeout=90)
    assert r.returncode != 0, r.output
    assert "fake_train: rank=1 failing on purpose" in r.output
    assert "finished at step" not in r.output
    assert time.monotonic() - start < 60, r.output


def test_bad_config_fails_once_before_launch(slurm_cluster):
    # The real `pretrain config show` runs once on the head node before anything is launched.
    r = slurm_cluster.submit(SCRIPT, [CONFIG, "train.max_stpes=5"], sbatch_opts=CPU_JOB,
                             env={"GPUS_PER_NODE": "0"}, timeout=60)
    assert r.returncode != 0, r.output
    errors = [line for line in r.output.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "max_stpes" in errors[0], r.output
    assert "launch:" not in r.output


def test_dry_run_prints_config_and_command_without_running(slurm_cluster):
    r = slurm_cluster.submit(SCRIPT, [CONFIG, "train.max_steps=7"], sbatch_opts=CPU_JOB,
                             env={"GPUS_PER_NODE": "0", "PRETRAIN_DRY_RUN": "1"}, timeout=60)
    assert r.returncode == 0, r.output
    # The resolved config, as the trainer will see it.
    assert re.search(r"^  max_steps: 7$", r.output, re.M), r.output
    assert re.search(r"^  resume: auto$", r.output, re.M), r.output
    line = launch_line(r.output)
    assert "--nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=node1:" in line
    assert line.endswith(f"-m pretrain train {CONFIG} checkpoint.resume=auto train.max_steps=7")
    assert "bash -c 'trap \"\" USR1; exec \"$@\"' torchrun" in line
    assert not re.search(r"world_size|Traceback", r.output)
