"""A preloaded interpreter that forks `python -m pretrain ...` processes for the tests.

Start-up is most of a test run's CPU time: each process imports torch, torch._dynamo (the optimizer
needs it), datasets and DeepSpeed, ~10 s of a ~12 s tiny run on the 2-core CI machine. The zygote
imports them once per pytest worker; each run is a fork of it that becomes the process
`python -m pretrain ARGS` would be: its own pid, environment, working directory, stdout and stderr,
exit code and interpreter shutdown (atexit handlers, flushes). Ranks of a multi-process run get
the variables torchrun gives them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT; no agent store: rank 0 hosts it, as under srun).

What a fork cannot be is run fresh (`helpers.pretrain` decides): an environment that differs in a
variable read at import time (PYTHON*, OMP/MKL threads, DS_*, TORCH*, HF_*...), tests of launchers
and of signals, and every run when PRETRAIN_TEST_FRESH=1.

Protocol: one Unix-socket connection per process. The client sends one JSON line
{"argv", "env", "cwd"} with its stdout and stderr file descriptors (SCM_RIGHTS); the zygote answers
{"pid": N}, then {"code": C} when the process exits (C as subprocess reports it: -signal if killed).
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import sys

# Read at import time by the modules preloaded here: a request whose environment differs in one of
# these runs fresh, not forked.
IMPORT_TIME = ("PYTHON", "OMP_", "MKL_", "OPENBLAS_", "DS_", "TORCH", "CUDA", "HF_", "TRANSFORMERS",
               "TOKENIZERS", "LD_", "KMP_", "GOMP_")


def signature(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


_server: dict = {}  # in the pytest worker: the zygote it started


def started_with(env: dict) -> dict:
    """Start this worker's zygote with `env` unless it runs; returns the environment it runs with."""
    import atexit
    import subprocess
    import tempfile

    if _server and _server["proc"].poll() is None:
        return _server["env"]
    path = os.path.join(tempfile.mkdtemp(prefix="zygote-"), "sock")
    log = open(path + ".log", "w")
    proc = subprocess.Popen([sys.executable, __file__, path], env=env, cwd=os.path.dirname(os.path.dirname(__file__)), stdout=subprocess.PIPE, stderr=log, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError(f"the zygote did not start: {open(path + '.log').read()[-3000:]}")
    atexit.register(proc.kill)
    _server.update(proc=proc, env=dict(env), path=path)
    return _server["env"]


def socket_path() -> str:
    return _server["path"]


def _preload() -> None:
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401

    import deepspeed.ops.op_builder  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401  (ZeRO's optimizer check imports it)
    import transformers.models.llama.modeling_llama  # noqa: F401

    import data_pipeline.builtin  # noqa: F401
    import data_pipeline.loader  # noqa: F401
    import pretrain.build  # noqa: F401
    import pretrain.cli  # noqa: F401
    import pretrain.eval.evaluate  # noqa: F401
    import pretrain.hf.export  # noqa: F401
    import pretrain.train  # noqa: F401
    import pretrain.trainer  # noqa: F401

    assert not torch.distributed.is_initialized()


def _child(request: dict, out: int, err: int) -> None:
    """In the fork: become `python -m pretrain ARGV` and run it; never returns (SystemExit ends the
    interpreter as it ends a fresh one)."""
    import io
    import random
    import runpy
    import tempfile

    import torch

    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((0, null), (1, out), (2, err)):
        os.dup2(target, fd)
    for fd in (null, out, err):
        os.close(fd)
    # torchrun starts its ranks with `python -u`: writes go straight to the file, as here.
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]
    tempfile.tempdir = None  # (TMPDIR is read again)
    random.seed()
    torch.seed()  # a fresh process's generator is seeded from the OS, not the zygote's
    sys.argv = [os.path.join(os.path.dirname(__import__("pretrain").__file__), "__main__.py"), *request["argv"]]
    runpy.run_module("pretrain", run_name="__main__", alter_sys=True)
    sys.exit(0)


def serve(path: str) -> None:
    import gc

    _preload()
    # The preloaded objects move to a generation the collector never scans: a fork's collections
    # (its exit's above all) then do not touch, and copy, every page of them (3.4 s -> 0.8 s).
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}  # pid -> its client's connection
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=0.05):
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
            while not data.endswith(b"\n"):
                data += conn.recv(1 << 20)
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                sel.close()
                listener.close()
                for c in [conn, *running.values()]:
                    c.close()
                _child(request, *fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            running[pid] = conn
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                except OSError:  # (the client is gone)
                    pass
                conn.close()
        if os.getppid() == 1:  # the pytest worker is gone
            return


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as `python -m` has it (not tests/, which holds a data_pipeline/ of tests)
    serve(sys.argv[1])
