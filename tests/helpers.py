"""Shared test helpers: run real training processes and read what they wrote."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TINY = REPO / "configs" / "tiny.yaml"

# The path users run on GPUs, emulated on CPU (tests/test_user_path.py, tests/test_fp8.py): the
# tiny shape at 1,024 tokens, 4 sequences per step, activation checkpointing on every block,
# checkpoints at steps 3 and 6 of 6; precision and ZeRO stage are each test's.
USER_PATH = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=1024",
             "data.seq_len=1024", "train.micro_batch_size=1", "train.global_batch_size=4", "train.activation_checkpointing=1",
             "distributed.param_persistence_threshold=0", "logging.log_every=1", "logging.wandb=disabled",
             "schedule.warmup_steps=2", "schedule.decay_steps=10", "train.eval_batches=1", "train.eval_every=0",
             "checkpoint.every=3", "checkpoint.keep_last=5", "train.max_steps=6", "data.num_streams=2",
             # (a 512-token vocabulary: bf16 matmuls on a CPU without bf16 instructions are ~50x fp32's, and
             # the output head's are most of them at 4,096)
             "data.tokenizer=builtin:python-bpe-512"]


def shared_file(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} not available")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", WANDB_SILENT="true", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    # Compiled kernels under this worker's TMPDIR (tests/conftest.py), one directory per rank
    # (distributed.own_compile_cache), never one a parent process computed elsewhere.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / "torchinductor_tests")
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
    env.pop("WANDB_API_KEY", None)
    # Set in this process by what a test imported, not by the test (sklearn: KMP_DUPLICATE_LIB_OK;
    # lm-eval: HF_XET_HIGH_PERFORMANCE): a user's shell has neither, and either would make every later
    # run start fresh, not forked from the zygote (tests/conftest.py fails a test that changes another).
    for var in ("KMP_DUPLICATE_LIB_OK", "HF_XET_HIGH_PERFORMANCE"):
        env.pop(var, None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env.update(extra or {})
    return env


def run_train(overrides: list[str], nproc: int = 1, config: Path = TINY, launcher: str = "torchrun",
              timeout: int = 300, env: dict | None = None, check: bool = True,
              cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`pretrain train` in new processes (1 = plain python; n = torchrun/accelerate/deepspeed with n
    CPU ranks; forked from the zygote where `launch` may)."""
    return pretrain(["train", str(config), "logging.progress=false", *overrides], nproc=nproc, launcher=launcher,
                    timeout=timeout, env=env, check=check, cwd=cwd)


def pretrain(args: list[str], nproc: int = 1, launcher: str = "torchrun", timeout: int = 300,
             env: dict | None = None, check: bool = True, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`python -m pretrain ARGS` in new processes: forked from the zygote (tests/zygote.py) when it
    can stand for the launcher (`python` or torchrun on the success path: a run expected to fail
    under torchrun gets torchrun's own exit code and teardown), else started fresh."""
    env = train_env(env)
    if launcher == "torchrun" and (nproc == 1 or check) and _zygote_can_fork(env):
        run = lambda: _forked(args, nproc, env, cwd, timeout)  # noqa: E731
    else:
        run = lambda: subprocess.run(_command(args, nproc, launcher), cwd=cwd, env=env,  # noqa: E731
                                     capture_output=True, text=True, timeout=timeout)
    proc = run()
    if check and proc.returncode != 0 and crashed(proc):
        # A rank killed by SIGSEGV/SIGBUS inside torch (CI saw it once, in a run with inductor-compiled
        # kernels; never reproduced here): said as a warning, the run's directory kept aside, and run
        # once more. A second crash, or any other failure, fails the test.
        warnings.warn(f"a rank crashed, running again once: {' '.join(args)}\n{fatal_error(proc.stderr)}")
        for arg in args:
            if arg.startswith("train.run_dir=") and Path(arg.split("=", 1)[1]).exists():
                run_dir = Path(arg.split("=", 1)[1])
                run_dir.rename(run_dir.with_name(run_dir.name + ".crashed"))
        proc = run()
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{fatal_error(proc.stderr)}"
                             f"{proc.stderr[-6000:]}")
    return proc


def left_running(args: list[str], out) -> "Forked | subprocess.Popen":
    """`python -m pretrain ARGS` left running (one process), its stdout and stderr in the open file
    `out`: forked from the zygote where it can be, as `pretrain` decides, else started fresh."""
    env = train_env()
    if _zygote_can_fork(env):
        return Forked(args, env, REPO, out.fileno(), out.fileno())
    return subprocess.Popen([sys.executable, "-m", "pretrain", *args], cwd=REPO, env=env, stdout=out, stderr=out)


def crashed(proc: subprocess.CompletedProcess) -> bool:
    """A process (or, under torchrun, one of its ranks) ended by a segmentation fault or bus error,
    or aborted by CPython finding a C extension's refcount error (seen once in a full run, in
    inductor's pattern matcher while compiling: "bool_dealloc: deallocating True or False")."""
    return proc.returncode in (-signal.SIGSEGV, -signal.SIGBUS) or any(
        mark in proc.stderr for mark in ("(SIGSEGV)", "(SIGBUS)", "Fatal Python error: Segmentation fault",
                                         "Fatal Python error: Bus error", "refcount error in a C extension"))


def fatal_error(stderr: str) -> str:
    """faulthandler's report of a crashed process (PYTHONFAULTHANDLER=1: the stacks, then a list of
    extension modules long enough to push the stacks out of a stderr tail), without that list."""
    at = stderr.find("Fatal Python error")
    if at < 0:
        return ""
    report = stderr[at:at + 8000]
    return report[:report.find("Extension modules:")] if "Extension modules:" in report else report


def _command(args: list[str], nproc: int, launcher: str) -> list[str]:
    if nproc == 1 and launcher == "torchrun":
        return [sys.executable, "-m", "pretrain", *args]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port()), "-m", "pretrain", *args]
    if launcher == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(REPO / "launch" / "accelerate_cpu_2proc.yaml"), "--num_processes", str(nproc),
                "--main_process_port", str(free_port()), "-m", "pretrain", *args]
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port",
                str(free_port()), "--module", "pretrain", *args]
    raise ValueError(launcher)


class Forked:
    """A process the zygote forked, with the part of subprocess.Popen the tests use."""

    def __init__(self, argv: list[str], env: dict, cwd: Path, stdout: int, stderr: int):
        from zygote import socket_path

        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.connect(socket_path())
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode() + b"\n"
        socket.send_fds(self.conn, [request], [stdout, stderr])
        self.buffer = b""
        self.returncode = None
        self.pid = self._message(None)["pid"]

    def _message(self, timeout):
        self.conn.settimeout(timeout)
        while b"\n" not in self.buffer:
            chunk = self.conn.recv(4096)
            if not chunk:
                raise RuntimeError("the zygote closed the connection")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._message(timeout)["code"]
            except socket.timeout:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout) from None
            self.conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0.001)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _zygote_can_fork(env: dict) -> bool:
    from zygote import signature, started_with

    if os.environ.get("PRETRAIN_TEST_FRESH"):
        return False
    return signature(env) == signature(started_with(train_env()))


def _forked(args: list[str], nproc: int, env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """ARGS on nproc forked ranks (torchrun's variables; a rank that fails takes the others down
    after 10 s, as torchrun does at once), their stdout and stderr each in one file."""
    import time

    port = free_port()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        procs = []
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_RANK=str(rank),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                                TORCHELASTIC_MAX_RESTARTS="0")
            procs.append(Forked(args, rank_env, cwd, out.fileno(), err.fileno()))
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(["pretrain", *args], timeout)
                if failed_at is None and any(p.returncode for p in procs):
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() > failed_at + 10:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        code = next((p.returncode for p in procs if p.returncode), 0)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["pretrain", *args], code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def run_train_on_nodes(overrides: list[str], nodes: int = 2, per_node: int = 2, timeout: int = 300) -> None:
    """`pretrain train` on `nodes` "nodes" of `per_node` CPU ranks: one torchrun agent per node, as
    slurm/pretrain.sbatch starts them, meeting on loopback (each rank's LOCAL_WORLD_SIZE is
    `per_node`, its node's ranks consecutive)."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc_per_node", str(per_node),
           "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "pretrain", "train", str(TINY),
           "logging.progress=false", *overrides]
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(nodes)]  # (no pipe to fill)
    procs = [subprocess.Popen([*cmd[:3], "--node_rank", str(n), *cmd[3:]], cwd=REPO, env=train_env(),
                              stdout=out, stderr=err, text=True) for n, (out, err) in enumerate(logs)]
    try:
        for n, (p, (out, err)) in enumerate(zip(procs, logs)):
            if p.wait(timeout=timeout) != 0:
                out.seek(0)
                err.seek(0)
                raise AssertionError(f"node {n}: exit {p.returncode}\n{out.read()[-3000:]}\n{err.read()[-6000:]}")
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None


# `pretrain train` with every tensor autograd saves for backward counted (a thread-local hook around
# the whole run: the steps run in the main thread).
_SAVED_DRIVER = """
import json, sys, torch
from pretrain.cli import main
stats = {"count": 0, "bytes": 0, "biggest": 0}
def pack(t):
    stats["count"] += 1
    stats["bytes"] += t.numel() * t.element_size()
    stats["biggest"] = max(stats["biggest"], t.numel())
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    rc = main(sys.argv[1:])
print("SAVED " + json.dumps(stats))
sys.exit(rc)
"""


def saved_for_backward(overrides: list[str], config: Path = TINY) -> dict:
    """Train one process with `overrides` and return what autograd saved for backward over the whole
    run: {"count", "bytes", "biggest" (numel of the largest tensor)}."""
    cmd = [sys.executable, "-c", _SAVED_DRIVER, "train", str(config), "logging.progress=false", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("SAVED ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[0][len("SAVED "):])


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> train/loss of every training record (log_every=1 gives every step; of a step logged
    twice, by a run killed after logging it and its resume, the later record). Never empty:
    two runs that logged nothing would otherwise compare equal."""
    out = {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}
    assert out, f"{run_dir}/metrics.jsonl has no train/loss record"
    return out


def losses_and_norms(run_dir: Path) -> dict[int, tuple[float, float]]:
    """step -> (train/loss, train/grad_norm) of every training record."""
    return {r["step"]: (r["train/loss"], r["train/grad_norm"]) for r in read_metrics(run_dir) if "train/loss" in r}


def tokens_drawn_are_tokens_seen(run_dir: Path) -> None:
    """data/tokens/* of every training record add up to tokens_seen: each sequence counted once, not
    once per rank of a sequence- or tensor-parallel group that reads it."""
    records = [r for r in read_metrics(run_dir) if "tokens_seen" in r and "train/loss" in r]
    assert records, f"{run_dir}/metrics.jsonl has no training record"
    for r in records:
        assert sum(v for k, v in r.items() if k.startswith("data/tokens/")) == r["tokens_seen"], r


def read_wandb_records(run_dir: Path) -> list:
    """Every record of the offline W&B run in run_dir (of each process that logged to it, a resumed
    run's after the first's), as wandb's own protobuf `Record`s.

    wandb >= 0.2x no longer ships a Python reader for its `.wandb` transaction log, which is a
    LevelDB-style log: a 7-byte file header (':W&B', magic 0xBEE1, version), then 32 KiB blocks of
    records, each with a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    paths = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))  # one per process that logged
    assert paths, f"no offline W&B run in {run_dir}"
    return [r for path in paths for r in _read_wandb_file(path)]


def _read_wandb_file(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a W&B transaction log"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += room
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    """The logged rows of an offline W&B run: [{key: value}] in order."""
    rows = []
    for r in read_wandb_records(run_dir):
        if r.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return rows


def run_dir_files(path: Path) -> dict:
    """name -> bytes of every file under `path` but the lock (which names each start's pid): what a
    refused start must leave as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def rewrite_meta(ckpt: Path, edit) -> None:
    """Edit meta.json and keep the manifest true to it (size and sha256), so that only the edit differs."""
    meta = json.loads((ckpt / "meta.json").read_text())
    edit(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    rewrite_file(ckpt, "meta.json")


def rewrite_file(ckpt: Path, name: str) -> None:
    """The manifest made true again to the checkpoint's file `name`, edited by a test (size and sha256)."""
    import hashlib

    data = (ckpt / name).read_bytes()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert name in manifest["files"], name
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def hf_weights(path: Path) -> dict:
    """Every tensor of a Hugging Face model directory's safetensors files (sharded or not)."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
