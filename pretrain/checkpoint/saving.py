"""Saving a checkpoint without stopping training.

The loop is blocked only while the state is copied to host memory: DeepSpeed hands every shard to
`ShardWriter.save` (installed as its checkpoint engine), which copies the tensors and returns, and
the tracked states (small) are gathered. Everything else runs in a background thread on every
rank: writing this rank's shards (and, on rank 0, the run's own files), fsync and sha256 of what
this rank wrote, and, once every rank is done, the manifest, the rename to step_... and rotation on
rank 0. The ranks agree on the outcome over a process group of their own, so the training
collectives never wait for a save and a save never waits for them.

DeepSpeed's own asynchronous engines were the first candidates: its decoupled engine writes
through FastPersist (`async_io`, an op compiled for NVMe with libaio) and its Nebula engine is
Azure's service; neither runs on a plain CPU or file system, so this is ours.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.checkpoint.rundir import sha256

log = logging.getLogger(__name__)


def to_host(obj):
    """A copy of `obj` whose tensors are host-memory copies (pinned and asynchronous from a GPU;
    call `torch.cuda.synchronize()` before reading them). Containers are copied, other leaves
    shared: DeepSpeed's state dicts hold live tensors in fresh containers."""
    if torch.is_tensor(obj):
        t = obj.detach()
        if t.is_cuda:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return host.copy_(t, non_blocking=True)
        return t.clone()
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict/defaultdict
        for k, v in obj.items():
            out[k] = to_host(v)
        return out
    if isinstance(obj, list):
        return [to_host(v) for v in obj]
    if type(obj) is tuple:
        return tuple(to_host(v) for v in obj)
    return obj


class ShardWriter:
    """DeepSpeed's checkpoint engine for our saves: `save` keeps a host copy of each shard for the
    background write, and a failure (in `makedirs` or DeepSpeed's copy of its recovery script) is
    recorded, not raised: a rank that raised inside `engine.save_checkpoint` would leave the others
    waiting in its closing barrier."""

    def __init__(self, engine):
        self.inner = engine.checkpoint_engine  # DeepSpeed's torch engine, configured from its config
        self.pending: list[tuple[str, object]] = []
        self.errors: list[tuple[str, BaseException]] = []
        engine.checkpoint_engine = self
        # DeepSpeed also copies its zero_to_fp32.py into the checkpoints folder on rank 0.
        engine._copy_recovery_script = self._recorded(engine._copy_recovery_script, "zero_to_fp32.py")

    def _recorded(self, fn, what):
        def call(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                self.errors.append((what, e))
        return call

    def save(self, state_dict, path: str):
        self.pending.append((path, to_host(state_dict)))

    def makedirs(self, path, exist_ok=False):
        self._recorded(os.makedirs, path)(path, exist_ok=exist_ok)

    def take(self) -> tuple[list, list]:
        """(shards, errors) recorded since the last call."""
        out = (self.pending, self.errors)
        self.pending, self.errors = [], []
        return out

    def __getattr__(self, name):  # load, create, commit, is_decoupled, ...
        return getattr(self.inner, name)


def describe_failure(errors: list[tuple[str, BaseException]]) -> tuple[str, bool]:
    """(first error in a line, whether the device is full)."""
    what, e = errors[0]
    full = any(isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) or
               "No space left" in str(x) or "unexpected pos" in str(x) or "file write failed" in str(x)
               for _, x in errors)
    lines = str(e).strip().splitlines()
    return f"{what}: {type(e).__name__}: {lines[-1] if lines else ''}", full


@dataclass
class SaveJob:
    """One save after its blocking part: what this rank still has to write, and, when done, how
    it went. `error` is the same message on every rank."""

    step: int
    partial: Path
    shards: list  # (path, host copy) written with DeepSpeed's engine
    own_files: dict  # name -> text, rank 0's files of the run (states, meta, config, tokenizer)
    errors: list  # failures already recorded in the blocking part
    started: float  # perf_counter() when the save began
    blocking_s: float = 0.0  # how long the training loop was held up
    write_s: float = 0.0  # the whole save, from its start to the rename (or the failure)
    size: int = 0  # bytes of the checkpoint
    error: str | None = None
    thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()


def write_rank_files(job: SaveJob, writer_engine) -> dict:
    """Write this rank's shards and own files, fsync and checksum them: {name: {size, sha256}}.
    Failures go to job.errors."""
    sums = {}
    written: list[Path] = []
    for path, state in job.shards:
        try:
            writer_engine.save(state, path)
            written.append(Path(path))
        except Exception as e:  # noqa: BLE001
            job.errors.append((path, e))
    for name, text in job.own_files.items():
        try:
            (job.partial / name).write_text(text)
            written.append(job.partial / name)
        except OSError as e:
            job.errors.append((name, e))
    job.shards = []  # drop the host copies now
    if not job.errors:
        try:
            for p in written:
                sums[str(p.relative_to(job.partial))] = {"size": p.stat().st_size, "sha256": sha256(p, sync=True)}
        except OSError as e:
            job.errors.append((str(job.partial), e))
    return sums


def timed(fn):
    """For the background thread: time a save and never let an exception escape unrecorded."""
    def run(job: SaveJob, *args):
        try:
            fn(job, *args)
        except Exception as e:  # noqa: BLE001 - a bug here must still end the save with a message
            log.exception("checkpoint save of step %d failed", job.step)
            job.error = job.error or f"the save of step {job.step} failed: {type(e).__name__}: {e}"
        job.write_s = time.perf_counter() - job.started
    return run
