"""A real two-node Slurm cluster on this machine, for the tests of `slurm/`.

`slurm_cluster` (session-scoped) starts Debian's Slurm 22.05 and munge as root, every path under a
temporary directory and all traffic on 127.0.0.1 (overview in
docs/slurm.md, "The test cluster"):

- munged with its own key, socket, pid and log file;
- slurmctld ("slurmctl") and two slurmd ("node1", "node2", `slurmd -N`): each in its own UTS + mount
  namespace (`unshare --uts --mount --propagation private`), where it sets its hostname and
  bind-mounts a private hosts file mapping the cluster's names to 127.0.0.1, so torchrun's
  rendezvous and gloo resolve node names without touching the machine's /etc/hosts. Jobs inherit
  the namespace of the slurmd that runs them, so a job on node2 sees `hostname` == node2.
- settings that make requeue tests fast (cred_expire=10, sched/bf interval 2 s) and `sbatch --wait`
  truthful (MinJobAge=4), and plugins that need neither systemd nor cgroups.

It is always torn down, also when a test fails: jobs cancelled, daemons stopped through their pid
files, then any process still living in the daemons' namespaces (job steps) killed. Nothing is ever
killed by name. If Slurm is missing, `.ci/install_slurm.sh` installs it (root with apt-get only);
when it cannot be installed or started the Slurm tests skip, unless PRETRAIN_SLURM_REQUIRED=1 (CI),
where they fail.

    def test_x(slurm_cluster):
        r = slurm_cluster.submit("slurm/pretrain.sbatch", ["configs/tiny.yaml"], env={"GPUS_PER_NODE": "0"})
        assert r.returncode == 0, r.output

`submit` waits for the job (`sbatch --wait`); `start` returns a `Job` at once, to act on the job while
it runs (`job.info()` is `scontrol show job`, `job.wait_for(cond, timeout, what)` polls, `job.wait()`
returns the same `JobResult` as `submit`).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The tests here share tests/helpers.py (metrics and W&B readers) with the tests one level up.
if str(REPO / "tests") not in sys.path:
    sys.path.insert(0, str(REPO / "tests"))
INSTALL_SCRIPT = REPO / ".ci" / "install_slurm.sh"
NODES = ("node1", "node2")
CONTROLLER = "slurmctl"
BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo",
            "squeue", "scancel", "unshare")


@dataclass
class JobResult:
    """What `sbatch --wait` reported for one job."""

    job_id: int | None
    returncode: int  # sbatch --wait's exit status: the job's exit code (a requeued job's last run)
    output: str  # the job's output file (stdout and stderr of every run, with --open-mode=append)
    sbatch_output: str  # sbatch's own stdout + stderr (submission errors land here)


class SlurmCluster:
    """Handle on a running test cluster. Run client commands with `run`, jobs with `submit`."""

    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.jobs_dir = root / "jobs"
        self._submitted = 0
        # Client commands (and, through sbatch's --export=ALL, the jobs) find the cluster via
        # SLURM_CONF. Slurm variables of an enclosing job (CI running inside Slurm) must not leak in.
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        self.env["SLURM_CONF"] = str(self.conf)

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run a Slurm client command (sinfo, scontrol, ...) against this cluster."""
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    def node_states(self) -> dict[str, str]:
        """Node name -> state ("idle", "allocated", "down*", ...)."""
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def submit(self, script: str | os.PathLike, args=(), env: dict | None = None,
               sbatch_opts=(), timeout: float = 180, cwd: str | os.PathLike = REPO) -> JobResult:
        """`sbatch --wait [sbatch_opts] script [args]` from `cwd` (the repository root by default).

        `env` is added to the submitting environment, which the job inherits. The job's output goes
        to a fresh file under the cluster's directory (an --output in sbatch_opts is overridden).
        `timeout` (s) bounds the whole wait; on expiry the job is cancelled and the test fails.
        """
        return self.start(script, args, env, sbatch_opts, cwd).wait(timeout)

    def start(self, script: str | os.PathLike, args=(), env: dict | None = None,
              sbatch_opts=(), cwd: str | os.PathLike = REPO) -> "Job":
        """Like `submit`, but returns at once with a `Job` to watch, signal and `wait()` for."""
        self._submitted += 1
        out_file = self.jobs_dir / f"job-{self._submitted:03d}.out"
        # PYTHON: jobs run the interpreter (and so the packages) that runs the tests.
        job_env = {**self.env, "PYTHON": sys.executable, **(env or {})}
        cmd = ["sbatch", "--wait", "--parsable", *sbatch_opts, f"--output={out_file}",
               str(script), *map(str, args)]
        proc = subprocess.Popen(cmd, env=job_env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        return Job(self, proc, out_file)


class Job:
    """A job submitted with `sbatch --wait`, still being waited for."""

    def __init__(self, cluster: SlurmCluster, proc: subprocess.Popen, out_file: Path):
        self.cluster, self.proc, self.out_file = cluster, proc, out_file
        # --parsable prints the job id as soon as the job is queued, then sbatch waits.
        self.first_line = proc.stdout.readline()
        self.job_id = _job_id(self.first_line)

    def output(self) -> str:
        """The job's output file so far."""
        return self.out_file.read_text(errors="replace") if self.out_file.exists() else ""

    def info(self) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, ...); {} once purged."""
        r = self.cluster.run("scontrol", "show", "job", "--oneliner", str(self.job_id), check=False)
        return dict(f.split("=", 1) for f in r.stdout.split() if "=" in f) if r.returncode == 0 else {}

    def wait_for(self, cond, timeout: float, what: str) -> None:
        """Poll `cond()` until true; fail the test (cancelling the job) when the job ends first or
        `timeout` (s) passes."""
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                pytest.fail(f"job {self.job_id} ended before {what}; output:\n{self.output()}")
            if time.monotonic() > deadline:
                self.cancel()
                pytest.fail(f"no {what} after {timeout:.0f} s; output:\n{self.output()}")
            time.sleep(0.2)

    def cancel(self) -> None:
        if self.job_id is not None:
            self.cluster.run("scancel", str(self.job_id), check=False)

    def wait(self, timeout: float = 180) -> JobResult:
        """Wait for `sbatch --wait` to return; on timeout cancel the job and fail the test."""
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            self.cancel()
            pytest.fail(f"job {self.job_id} still running after {timeout:.0f} s; output:\n{self.output()}")
        return JobResult(job_id=self.job_id, returncode=self.proc.returncode, output=self.output(),
                         sbatch_output=self.first_line + rest)


def _job_id(sbatch_output: str) -> int | None:
    m = re.search(r"^(\d+)(;\S*)?$", sbatch_output, re.M)  # --parsable: "ID" or "ID;cluster"
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------- set-up


def _unavailable(reason: str):
    if os.environ.get("PRETRAIN_SLURM_REQUIRED") == "1":
        pytest.fail(f"Slurm test cluster required (PRETRAIN_SLURM_REQUIRED=1) but {reason}")
    pytest.skip(reason)


def _ensure_slurm_installed() -> None:
    if all(shutil.which(b) for b in BINARIES):
        return
    if shutil.which("apt-get") is None:
        _unavailable("slurm-wlm/munge are not installed and there is no apt-get to install them")
    r = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True, timeout=600)
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        _unavailable(f"could not install Slurm (missing {', '.join(missing)}): "
                     f"{(r.stdout + r.stderr)[-1500:]}")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _hardware() -> str:
    """The CPU/memory part of `slurmd -C`'s node line, e.g. "CPUs=2 Boards=1 ... RealMemory=24105".

    Both nodes claim the machine's real hardware (they share its cores: CR_CPU plus 1-CPU tasks
    leaves room for two jobs per node). Claiming more than slurmd detects would drain the node.
    """
    line = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    first = line.splitlines()[0].split()
    return " ".join(f for f in first if not f.startswith(("NodeName=", "UpTime=")))


def _write_config(root: Path, munge_socket: Path) -> None:
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    hw = _hardware()
    nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={p} {hw} State=UNKNOWN"
                      for n, p in zip(NODES, node_ports))
    # A random first job id: the launch script derives the rendezvous port from the job id, so two
    # test clusters on one machine (parallel CI jobs) must not hand out the same ids.
    first_job_id = random.SystemRandom().randint(10_000, 5_000_000)
    (root / "slurm.conf").write_text(f"""\
ClusterName=pretraintest
SlurmctldHost={CONTROLLER}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again only after cred_expire + 1 s (default 120 s).
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
# No systemd, no cgroups.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
FirstJobId={first_job_id}
# MinJobAge=2 lets a finished job vanish before `sbatch --wait` polls it, which then exits 0.
MinJobAge=4
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
KillWait=10
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")


def _hosts_file(root: Path, own_name: str) -> Path:
    # Own name first: reverse lookups of 127.0.0.1 (socket.getfqdn) then give this node's name.
    names = [own_name] + [n for n in (*NODES, CONTROLLER) if n != own_name]
    path = root / "etc" / f"hosts.{own_name}"
    path.write_text("".join(f"127.0.0.1\t{n}\n" for n in names) + "127.0.0.1\tlocalhost\n")
    return path


class _Daemons:
    """Started daemons, so that tear-down can stop exactly those (and what they spawned)."""

    def __init__(self, root: Path):
        self.root = root
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []  # (name, process, pid file)
        self.namespaces: set[str] = set()  # e.g. "mnt:[4026532781]"
        self.cleanup_dirs: list[Path] = []
        self._own_ns = os.readlink("/proc/self/ns/mnt")

    def start(self, name: str, cmd: list[str], pid_file: Path, hostname: str | None = None):
        if hostname is not None:
            hosts = _hosts_file(self.root, hostname)
            cmd = ["unshare", "--uts", "--mount", "--propagation", "private", "--",
                   "sh", "-c", 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"',
                   "sh", hostname, str(hosts), *cmd]
        log = open(self.root / "log" / f"{name}.console", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        log.close()
        self.procs.append((name, proc, pid_file))
        _wait_for(lambda: pid_file.exists() or proc.poll() is not None, 15)
        if proc.poll() is not None or not pid_file.exists():
            raise RuntimeError(f"{name} did not start:\n{self.logs()}")
        if hostname is not None:
            ns = os.readlink(f"/proc/{proc.pid}/ns/mnt")
            if ns != self._own_ns:  # never record (and later sweep) our own namespace
                self.namespaces.add(ns)

    def logs(self, tail: int = 1500) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace")
            if text.strip():
                parts.append(f"--- {f.name}\n{text[-tail:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        for name, proc, pid_file in reversed(self.procs):  # slurmd before slurmctld before munged
            # The daemons run in the foreground, so the pid in their pid file is our child's
            # (unshare and sh exec into them). Signal it through Popen, which never signals a
            # pid that was already reaped and may have been reused.
            pid = pid_file.read_text().strip() if pid_file.exists() else ""
            if pid and pid != str(proc.pid):
                print(f"warning: {pid_file} names {pid}, not the {name} we started ({proc.pid})")
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        # Job steps (slurmstepd, srun, torchrun, trainers) detach from slurmd but stay in its namespace.
        for _ in range(3):
            left = [p for p in _pids() if _mnt_ns(p) in self.namespaces]
            if not left:
                break
            for p in left:
                _kill(p, signal.SIGKILL)
            time.sleep(0.5)
        for d in self.cleanup_dirs:
            shutil.rmtree(d, ignore_errors=True)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _mnt_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_for(cond, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def _start_cluster(root: Path, daemons: _Daemons) -> SlurmCluster:
    for d in ("munge", "state", "run", "log", "etc", "jobs", *(f"spool/{n}" for n in NODES)):
        (root / d).mkdir(parents=True, exist_ok=True)
    # munged refuses a socket whose every parent directory is not world-executable (pytest's
    # temporary directories are 0700), and the path must fit a sockaddr_un: a short one of its own.
    socket_dir = Path(tempfile.mkdtemp(prefix="pretrain-munge-"))
    daemons.cleanup_dirs.append(socket_dir)
    socket_dir.chmod(0o755)
    munge_socket = socket_dir / "munge.socket"
    _write_config(root, munge_socket)
    cluster = SlurmCluster(root)
    conf = str(cluster.conf)

    key = root / "munge" / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
    daemons.start("munged", ["munged", "--foreground", f"--key-file={key}",
                             f"--socket={munge_socket}",
                             f"--pid-file={root}/run/munged.pid",
                             f"--log-file={root}/log/munged.log",
                             f"--seed-file={root}/munge/munged.seed"],
                  root / "run" / "munged.pid")
    # -c: start from empty state (the directory is new anyway); -D: stay a child we can wait on.
    daemons.start("slurmctld", ["slurmctld", "-D", "-c", "-f", conf], root / "run" / "slurmctld.pid",
                  hostname=CONTROLLER)
    _wait_for(lambda: cluster.run("scontrol", "ping", check=False).returncode == 0, 20)
    for node in NODES:
        daemons.start(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", conf],
                      root / "run" / f"slurmd-{node}.pid", hostname=node)
    if not _wait_for(lambda: all(cluster.node_states().get(n) == "idle" for n in NODES), 30, 0.5):
        raise RuntimeError(f"nodes not idle: {cluster.node_states()}\n{daemons.logs()}")
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> SlurmCluster:
    """A running 2-node Slurm cluster (node1, node2), shared by the whole test session."""
    if os.geteuid() != 0:
        _unavailable("the Slurm test cluster needs root (unshare, SlurmUser=root)")
    _ensure_slurm_installed()
    root = tmp_path_factory.mktemp("slurm")
    daemons = _Daemons(root)
    try:
        try:
            cluster = _start_cluster(root, daemons)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _unavailable(f"could not start the Slurm test cluster: {e}")
        yield cluster
        jobs = cluster.run("squeue", "--noheader", "--format=%i", check=False).stdout.split()
        if jobs:
            cluster.run("scancel", *jobs, check=False)
            _wait_for(lambda: not cluster.run("squeue", "--noheader", check=False).stdout.strip(), 15)
    finally:
        daemons.stop()
