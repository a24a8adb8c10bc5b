"""slurm/pretrain.sbatch (in dry-run mode) and slurm/env.sh run by bash outside Slurm: no cluster needed."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

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


# slurm/env.sh's GLOO_SOCKET_IFNAME, sourced as the batch script does (on the first node), with
# `hostname`, `getent`, `ip` and `scontrol` stubbed where a case needs a network this machine lacks.
HEAD_IS_LOOPBACK = {"hostname": "echo 127.0.0.1"}
ROUTE_VIA_IB9 = {"ip": 'echo "$3 via 10.0.0.1 dev ib9 src 10.0.0.5 uid 0"'}


def gloo_ifname(tmp_path: Path, stubs: dict[str, str], only: tuple[str, ...] = (), **env: str) -> str:
    """GLOO_SOCKET_IFNAME after `source slurm/env.sh` under `set -euo pipefail` ("unset" if unset).
    With `only`, PATH holds the stubs and just these tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    for tool in only:
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "NCCL_", "GLOO_"))}
    path = str(bin_dir) if only else f"{bin_dir}:{os.environ['PATH']}"
    r = subprocess.run([shutil.which("bash"), "-c", 'set -euo pipefail; source slurm/env.sh; '
                        'echo "${GLOO_SOCKET_IFNAME-unset}"'], cwd=REPO, capture_output=True, text=True,
                       timeout=30, env={**base, "GPUS_PER_NODE": "0", **env, "PATH": path})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(not (shutil.which("ip") and shutil.which("getent")), reason="needs ip and getent")
def test_gloo_uses_lo_when_the_head_node_is_loopback(tmp_path):
    assert gloo_ifname(tmp_path, HEAD_IS_LOOPBACK) == "lo"


@pytest.mark.parametrize("env, expected", [
    ({"NCCL_SOCKET_IFNAME": "lo"}, "lo"),  # an interface of this node: NCCL's
    ({"NCCL_SOCKET_IFNAME": "=lo"}, "lo"),  # NCCL's exact-name form
    ({"NCCL_SOCKET_IFNAME": "eth7x"}, "ib9"),  # no such interface here (an NCCL prefix): the route's
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, "ib9"),
    ({"GLOO_SOCKET_IFNAME": "eth7"}, "eth7"),  # set by the user: kept
])
def test_gloo_takes_nccls_interface_when_it_names_one(tmp_path, env, expected):
    assert gloo_ifname(tmp_path, {**HEAD_IS_LOOPBACK, **ROUTE_VIA_IB9}, **env) == expected


def test_gloo_on_the_head_node_routes_to_the_second_node_not_to_its_own_name(tmp_path):
    """The head node's own name resolves to 127.0.1.1 (Debian's /etc/hosts); the second node's to
    its cluster address, which only ib0 reaches."""
    stubs = {"scontrol": 'printf "n1\\nn2\\n"',
             "getent": 'case $2 in n1) echo "127.0.1.1 n1";; n2) echo "10.0.0.2 n2";; esac',
             "ip": '[ "$3" = 10.0.0.2 ] && echo "10.0.0.2 via 10.0.0.1 dev ib0 src 10.0.0.1 uid 0"'}
    assert gloo_ifname(tmp_path, stubs, SLURM_NNODES="2", SLURM_JOB_NODELIST="n[1-2]") == "ib0"


def test_gloo_never_binds_lo_for_an_address_that_is_not_loopback(tmp_path):
    """One node whose name resolves to its own Ethernet address: the route to it is lo, which
    other hosts could not reach; gloo keeps its own choice."""
    stubs = {"hostname": "echo n1", "getent": 'echo "10.0.0.1 n1"',
             "ip": 'echo "local 10.0.0.1 dev lo table local src 10.0.0.1 uid 0"'}
    assert gloo_ifname(tmp_path, stubs) == "unset"


@pytest.mark.parametrize("missing", ["ip", "getent"])
def test_gloo_stays_unset_without_ip_or_getent(tmp_path, missing):
    tools = tuple(t for t in ("awk", "sed", "getent", "ip") if t != missing)
    assert gloo_ifname(tmp_path, HEAD_IS_LOOPBACK, only=tools) == "unset"


@pytest.mark.parametrize("nodes", ["0", "2", "two"])
def test_pretrain_nodes_outside_the_allocation_is_one_line(nodes):
    r = dry_run(CONFIG, GPUS_PER_NODE="0", PRETRAIN_NODES=nodes)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"pretrain.sbatch: PRETRAIN_NODES={nodes}: give 1 to 1 (the allocation's nodes)"]
    assert "launch:" not in r.stdout


def test_rdzv_port_sets_the_rendezvous_port():
    """RDZV_PORT from the environment is the launch line's rendezvous port, in place of the job's own
    (15000 + 16 x (job id % 937), checked on the cluster in test_pretrain_sbatch.py)."""
    host = subprocess.run(["hostname"], capture_output=True, text=True, check=True).stdout.strip()
    r = dry_run(CONFIG, GPUS_PER_NODE="0", RDZV_PORT="23456", SLURM_JOB_ID="31234")
    assert r.returncode == 0, r.stderr
    assert f"--rdzv-endpoint={host}:23456 --rdzv-id=31234-0 " in launch_line(r.stdout)
    assert f"rendezvous {host}:23456" in r.stdout


def _rdzv_ports(job: int) -> list[int]:
    """slurm/env.sh's rendezvous port of each start of job `job` (the first, then each restart)."""
    r = subprocess.run([shutil.which("bash"), "-c", 'set -euo pipefail; source slurm/env.sh; '
                        'for i in $(seq 0 $(( RDZV_PORTS_PER_JOB - 1 ))); do rdzv_port "$i"; done'],
                       cwd=REPO, capture_output=True, text=True, timeout=30,
                       env={**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
                            "GPUS_PER_NODE": "0", "SLURM_JOB_ID": str(job)})
    assert r.returncode == 0, r.stderr
    return [int(x) for x in r.stdout.split()]


@pytest.mark.parametrize("job", [1, 31234, 936, 937])
def test_restarts_never_take_another_jobs_rendezvous_port(job):
    """Each start of a job (up to 15 restarts in the allocation) has its own port, and none is a
    port of the next or the previous job (a store that cannot bind its port becomes a client of the
    other job's store, and dies with it). All in 15000-29999."""
    mine, after, before = _rdzv_ports(job), _rdzv_ports(job + 1), _rdzv_ports(job - 1)
    assert len(set(mine)) == 16 and not set(mine) & (set(after) | set(before))
    assert all(15000 <= p <= 29999 for p in mine + after + before)
    assert mine[0] == 15000 + job % 937 * 16  # (pretrain/parallel/distributed.py's rule for a bare srun)


def test_more_restarts_than_the_ports_of_a_job_is_one_line():
    r = dry_run(CONFIG, GPUS_PER_NODE="0", PRETRAIN_MAX_RESTARTS="16")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "pretrain.sbatch: PRETRAIN_MAX_RESTARTS=16: give 0 to 15 (each restart has a rendezvous port of its own in "
        "the job's block)"]


@pytest.mark.slow
def test_pretrain_requeue_0_saves_on_usr1_and_stops_without_requeue(slurm_cluster, tmp_path):
    """PRETRAIN_REQUEUE=0: the time-limit signal (USR1, sent here with `scancel --signal=USR1` once
    the run trains; max_steps far beyond what it can reach) saves a checkpoint and the job stops
    (the trainers exit 75), not requeued."""
    import re
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import read_metrics

    fast = ["data.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=4", "distributed.zero_stage=3",
            "logging.log_every=1", "logging.progress=false", "logging.wandb=disabled"]
    job = slurm_cluster.start("slurm/pretrain.sbatch", [CONFIG, *fast, "train.max_steps=100000",
                                                        f"train.run_dir={tmp_path}"],
                              env={"GPUS_PER_NODE": "0", "PRETRAIN_REQUEUE": "0"},
                              sbatch_opts=["--gpus-per-node=0", "--cpus-per-task=1"])
    metrics = tmp_path / "metrics.jsonl"
    job.wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 120, "training")
    slurm_cluster.run("scancel", "--signal=USR1", str(job.job_id))
    r = job.wait(timeout=90)
    out = r.output
    saved = re.findall(r"^pretrain: received SIGUSR1: saved step (\d+); exiting with 75", out, re.M)
    assert len(saved) == 1, out[-6000:]
    step = int(saved[0])
    assert (tmp_path / "checkpoints" / f"step_{step:08d}" / "manifest.json").is_file()
    assert "scontrol requeue" not in out and "(restart 1)" not in out and "DUE TO JOB REQUEUE" not in out
    # (torchrun reports any failed worker as exit 1; the trainer recorded its own 75)
    assert re.search(r"^job step failed \(exit \d+, recorded: 75\); not restarted", out, re.M), out[-3000:]
    assert r.returncode == 75  # the trainer's code (resumable), not torchrun's 1
    assert job.info().get("Restarts", "0") == "0"
    assert max(rec["step"] for rec in read_metrics(tmp_path) if "train/loss" in rec) == step < 100000


@pytest.mark.parametrize("array,want", [({}, "12"), ({"SLURM_ARRAY_JOB_ID": "10", "SLURM_ARRAY_TASK_ID": "2"}, "10_2")])
def test_the_time_limit_signal_requeues_this_job_or_array_task_alone(monkeypatch, array, want):
    """An array's last task has the array's SLURM_JOB_ID, and `scontrol requeue` of that id requeues
    every task of the array (a sweep's running tasks were killed): a task is requeued by its own name."""
    import signal

    from pretrain import train

    calls = []
    monkeypatch.setattr(train.subprocess, "run", lambda argv, **kw: calls.append(argv) or subprocess.CompletedProcess(argv, 0))
    for k in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"SLURM_JOB_ID": "12", "PRETRAIN_REQUEUE": "1", **array}.items():
        monkeypatch.setenv(k, v)
    train._requeue_if_slurm(True, signal.SIGUSR1)
    train._requeue_if_slurm(True, signal.SIGTERM)  # (a cancel never requeues)
    train._requeue_if_slurm(False, signal.SIGUSR1)  # (nor any rank but rank 0)
    assert calls == [["scontrol", "requeue", want]]
