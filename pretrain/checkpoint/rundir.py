"""The run directory: one process group writes into it at a time, and one run owns it.

    run_dir/
        .lock              POSIX lock held by rank 0 while a run uses the dir; names the holder
        run.json           the run that owns the dir: its id (also its W&B run id), version, commit
        config.yaml        the resolved config      deepspeed_config.json   generated from it
        metrics.jsonl      every logged record      checkpoints/            see layout.py
        replaced/<id>/     an earlier run's files, moved aside by train.overwrite=true

The lock is a POSIX record lock (`fcntl.lockf`): the kernel releases it when the process dies,
kill -9 included, and NFS v4 and Lustre (mounted with `flock`) honour it across nodes, so a
requeued Slurm job on another node takes over at once. A second run on the dir refuses in one line
naming the host and pid that hold it.

Ownership: a fresh run claims the dir by writing run.json; every checkpoint records the run id. A
fresh run into a dir that holds another run refuses (see CheckpointManager.plan_start), and
rotation only ever deletes checkpoints of the run that owns the dir. A new run that failed before it
trained a step removes what it wrote (the dir itself if it created it): failed starts leave nothing.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

from pretrain.errors import RunDirError, collective
from pretrain.parallel import distributed

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
REPLACED = "replaced"
# Files a run writes at the top of its dir (besides checkpoints/): moved together by `replace`.
RUN_FILES = (RUN_FILE, "config.yaml", "deepspeed_config.json", "metrics.jsonl", "checkpoints", "wandb")


def new_run_id() -> str:
    """12 lowercase hex characters: a valid W&B run id, unique enough to tell runs apart."""
    return secrets.token_hex(6)


def write_atomic(path: Path, text: str) -> None:
    """Write a small file so that readers see the old or the new content, never a mix, also after
    a power loss (data fsynced before the rename, the directory after it)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def sha256(path: Path, sync: bool = False) -> str:
    """The file's checksum; with `sync`, also flush its dirty pages to disk, whoever wrote them."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
        if sync:
            os.fsync(f.fileno())
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunDir:
    """The run dir of this process group. `open()` and `close()` are collective; rank 0 does the
    file work."""

    def __init__(self, path: str | os.PathLike, env: distributed.Dist):
        self.path, self.env = Path(path), env
        self.checkpoints = self.path / "checkpoints"
        self.run_id: str | None = None  # set by claim()
        self._created = False  # this process created the dir
        self._claimed = False  # this process made a new run the owner (not a restart of the owner)
        self._replaced: Path | None = None  # where train.overwrite moved the earlier run's files
        self._lock_fd: int | None = None

    # ------------------------------------------------------------------ lock
    def open(self) -> None:
        """Create the dir if needed and take the lock; raises RunDirError on every rank if another
        process holds it."""
        problem = None
        if self.env.is_main:
            try:
                self._created = not self.path.exists()
                self.path.mkdir(parents=True, exist_ok=True)
                self._lock()
            except RunDirError as e:
                problem = str(e)
            except OSError as e:
                problem = f"cannot use run dir {self.path}: {e.strerror or e}"
            if problem and self._created:
                shutil.rmtree(self.path, ignore_errors=True)
        problem = distributed.broadcast_object(problem)
        if problem:
            raise collective(RunDirError(problem))

    def _lock(self) -> None:
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        import fcntl

        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):  # ENOLCK/EOPNOTSUPP: no locks on this FS
                log.warning("warning: %s does not support file locks (%s): nothing stops a second run from "
                            "using this run dir at the same time", self.path, e.strerror)
            else:
                holder = os.read(fd, 4096).decode(errors="replace").strip()
                os.close(fd)
                try:
                    h = json.loads(holder)
                    who = f"pid {h['pid']} on host {h['host']}" + (f" (Slurm job {h['job']})" if h.get("job") else "") \
                        + f", since {h['started']}"
                except (ValueError, KeyError, TypeError):
                    who = "another process"
                raise RunDirError(f"run dir {self.path} is in use by {who}: wait for that run to end or stop "
                                  "it, or set train.run_dir to another directory") from None
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID", ""),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self._lock_fd = fd

    def close(self, trained: bool) -> None:
        """Release the lock. A new run that failed before it `trained` a step leaves nothing behind:
        the dir if this process created it, else the files it wrote (no other run's files can be
        there: the start refused them or moved them to replaced/, and those come back)."""
        if not self.env.is_main:
            return
        try:
            if not (trained or self.has_checkpoints()):
                self._undo_start()
        finally:
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the POSIX lock
                self._lock_fd = None

    def _undo_start(self) -> None:
        if self._created:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        if self._claimed:
            for name in RUN_FILES:
                target = self.path / name
                if target.is_dir():
                    shutil.rmtree(target, ignore_errors=True)
                else:
                    target.unlink(missing_ok=True)
        if self._replaced is not None:  # train.overwrite, then a failed start: the earlier run comes back
            for item in self._replaced.iterdir():
                item.rename(self.path / item.name)
            self._replaced.rmdir()
            if not any((self.path / REPLACED).iterdir()):
                (self.path / REPLACED).rmdir()
            log.warning("warning: the new run failed to start: the earlier run's files are back in %s", self.path)

    # ------------------------------------------------------------------ ownership
    def owner(self) -> dict | None:
        """run.json of the run that owns the dir, or None."""
        try:
            return json.loads((self.path / RUN_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise RunDirError(f"{self.path / RUN_FILE} is unreadable ({e}): move the run dir aside or "
                              "set train.run_dir to another directory") from None

    def has_checkpoints(self) -> bool:
        """Any checkpoint folder, complete or not."""
        return self.checkpoints.is_dir() and any(
            p.name.startswith(("step_", ".partial_step_")) for p in self.checkpoints.iterdir())

    def traces(self) -> list[str]:
        """What an earlier run left here, for messages (empty: nothing worth keeping)."""
        found = []
        if self.checkpoints.is_dir():
            steps = sorted(p.name for p in self.checkpoints.iterdir() if p.name.startswith("step_"))
            if steps:
                found.append(f"{len(steps)} checkpoint(s), the newest {steps[-1]}")
        metrics = self.path / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size:
            found.append("metrics.jsonl")
        return found

    def claim(self, run_id: str, info: dict) -> None:
        """Make `run_id` the owner of the dir (rank 0 writes run.json; every rank learns the id)."""
        self.run_id = run_id
        if self.env.is_main:
            previous = self.owner()
            self._claimed = previous is None or previous.get("run_id") != run_id
            info = {"run_id": run_id, **info}
            if not self._claimed:  # a restart of the same run: it was created then, by the code named here
                info.update({k: previous[k] for k in ("created",) if k in previous},
                            restarted=info.get("created"))
            write_atomic(self.path / RUN_FILE, json.dumps(info, indent=1))

    def replace(self, old_id: str) -> Path:
        """Move an earlier run's files into replaced/<old_id>/ (train.overwrite=true): nothing is deleted."""
        dest = self.path / REPLACED / (old_id or time.strftime("%Y%m%d-%H%M%S"))
        if dest.exists():
            dest = dest.with_name(f"{dest.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        dest.mkdir(parents=True)
        for name in RUN_FILES:
            if (self.path / name).exists():
                (self.path / name).rename(dest / name)
        fsync_dir(self.path)
        self._replaced = dest
        return dest
