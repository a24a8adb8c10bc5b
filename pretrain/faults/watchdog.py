"""Hangs named: a watchdog thread per rank (docs/reliability.md). The same thread samples the waits
that the straggler report (pretrain/faults/stragglers.py) subtracts.

The trainer marks each phase of a step as it enters it (`mark`: a few attribute writes, no sync),
and long phases (evaluation, data skipped after a rollback, a checkpoint conversion) mark progress
as they go (`progress`). When a rank's phase has not changed for the hang timeout, its watchdog
starts a hang report, which every other rank's watchdog joins:

1. the first watchdog to fire asks every rank for its state, through the rendezvous store (the
   TCP store every rank already talks to; a connection of its own, whose operations time out);
2. every watchdog waits for that request and answers it at once, whatever its own timer says: its
   rank, host, phase, step, time without progress, and whether it waits for other ranks (the phase
   `collective`, a main thread inside torch.distributed or deepspeed.comm, or, on a GPU, a stream
   that has not reached the host's latest mark: stalled behind a collective). It waits blocked in
   the store (a TCPStore wait, in a thread and on a second connection of its own), never polling:
   between reports the watchdogs send the store nothing, whatever the number of ranks, and a
   request reaches every rank as soon as the store can send it (Channel; bench/bench_hang_store.py);
3. the asking rank waits until every rank has answered (at most REPORT_WAIT_S), then decides. The
   ranks that hang: those that did not answer (frozen, or gone), else those not waiting for others
   that made no progress for about as long as it did, else, when every rank waits, all of them (a
   communication hang). No rank hangs when one that is not waiting made progress recently (a slow
   rank the others wait for, in an evaluation say): the report ends, the run goes on, and the
   asking rank waits a timeout more. A hang is one line on stderr, exit 4 recorded for
   slurm/pretrain.sbatch, and every thread's stack (faulthandler) of every rank in
   RUN/hangs/<start>/rank-N.txt, best effort with a time limit;
4. every rank exits with code 4 once the line is out, so the job ends (and slurm/pretrain.sbatch,
   or a person, resumes it from the last checkpoint) instead of waiting for the collective timeout.
   A rank whose main thread fails meanwhile (its peer is gone) waits for the report instead of
   recording a crash.

A rank is "frozen" only when it did not answer the request: not because its own timer had not
fired yet (the healthy ranks of a run with gradient accumulation keep making progress through
their micro-batches and start waiting long after the hung rank stopped). Nothing of the report
depends on the file system: a full disk, a quota or a frozen mount costs the stacks, not the verdict.

The timeout: `resilience.hang_timeout_s`, or learned: STEP_MULTIPLE x the longest step so far (the
first step under train.compile, which compiles, left out), at least MIN_TIMEOUT_S; FIRST_TIMEOUT_S
before the first step ends (start-up, compile) and in phases that take longer than a step (eval,
save, a decay branch's restore), between their progress marks. Always HANG_EXIT_S below the
collective timeout (`distributed.timeout_s`), so that the watchdog, which names the rank, finishes
its report before a collective times out.

A watchdog in our own code, not a library's: torch's NCCL watchdog covers NCCL collectives only
(not gloo, data loading or a frozen process) and names no rank; nvidia-resiliency-ext's in-job
restarts need its own launcher.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from pretrain.config import HANG_EXIT_S, IO_TIMEOUT_S, REPORT_WAIT_S, STORE_TIMEOUT_S  # (the report's waits)

log = logging.getLogger(__name__)

EXIT_HANG = 4
STEP_MULTIPLE = 5  # nvidia-resiliency-ext learns its timeouts the same way
MIN_TIMEOUT_S = 300.0
FIRST_TIMEOUT_S = 1200.0
LONG_PHASES = ("start", "eval", "save", "branch")
WAITING = "collective"  # a rank in this phase waits for the others
POLL_S = 0.02  # the sampling interval (the timeout is checked at the same time)
LISTEN_S = 24 * 3600.0  # a listener's blocking wait for the next report's call is renewed after this
EXIT_FILE = "PRETRAIN_EXIT_FILE"  # set by slurm/pretrain.sbatch: where a start records how it ended


class Channel:
    """The hang reports' messages, in a key-value store every rank reaches (the rendezvous store,
    pretrain.parallel.distributed.side_store: a TCPStore). Reports are numbered: `latest` is the newest one
    asked for; report g has its asking rank (the first to add to g/asked), a call to each rank
    (g/call/R, set for every rank at once when the report is asked), each rank's answer and a
    verdict ("" when no rank hangs: the run goes on).

    Every wait here is the store's own (TCPStore.wait: the store answers when the keys are set), never
    a loop of requests: a rank waiting for the next report's call, the asking rank waiting for every
    answer, the others waiting for the verdict. Between reports the store serves the watchdogs
    nothing, whatever the number of ranks; a report costs it a few requests per rank. A TCPStore
    client serves one request at a time, so the wait for a call, which lasts until a report, has a
    connection of its own (`clone`)."""

    def __init__(self, store):
        self.store = store

    def clone(self) -> Channel:
        """The same channel on a new connection to the store."""
        return Channel(self.store.clone())

    def latest(self) -> int:
        return self.store.add("latest", 0)

    def ask(self, g: int, world: int) -> bool:
        """Request report g from every rank (one request calls them all); True for the first rank to
        ask (it gives the verdict)."""
        first = self.store.add(f"{g}/asked", 1) == 1
        if first:
            self.store.set("latest", str(g))
            self.store.multi_set([f"{g}/call/{r}" for r in range(world)], ["1"] * world)
        return first

    def call(self, g: int, rank: int) -> None:
        """End rank `rank`'s wait for report g's call (its watchdog closes: the call is not a report)."""
        self.store.set(f"{g}/call/{rank}", "0")

    def wait_call(self, g: int, rank: int, timeout_s: float) -> None:
        """Block until report g calls rank `rank` (DistStoreError after `timeout_s`)."""
        self.store.wait([f"{g}/call/{rank}"], _seconds(timeout_s))

    def answer(self, g: int, rank: int, head: dict) -> None:
        self.store.set(f"{g}/rank/{rank}", json.dumps(head))

    def answers(self, g: int, world: int, timeout_s: float) -> dict[int, dict]:
        """The answers to report g once every rank has answered, or those in after `timeout_s`."""
        from torch.distributed import DistStoreError

        keys = [f"{g}/rank/{r}" for r in range(world)]
        try:
            self.store.wait(keys, _seconds(timeout_s))
        except DistStoreError:  # (the time is up: some ranks did not answer)
            keys = [k for k in keys if self.store.check([k])]
        values = self.store.multi_get(keys) if keys else []
        return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in zip(keys, values)}

    def publish(self, g: int, line: str) -> None:
        self.store.set(f"{g}/verdict", line)

    def verdict(self, g: int, timeout_s: float = 0.0) -> str | None:
        """Report g's verdict; None when there is none, after waiting up to `timeout_s` for it."""
        from torch.distributed import DistStoreError

        key = f"{g}/verdict"
        if timeout_s > 0:
            try:
                self.store.wait([key], _seconds(timeout_s))
            except DistStoreError:
                return None
            return self.store.get(key).decode()
        return self.store.get(key).decode() if self.store.check([key]) else None


def _seconds(s: float):
    import datetime

    return datetime.timedelta(seconds=max(s, 0.001))


class Watchdog:
    def __init__(self, hangs_dir: Path, rank: int, hosts: list[str], fixed_s: float, cap_s: float,
                 channel: Channel | None, device: torch.device | None = None, first_step_compiles: bool = False):
        self.dir, self.rank, self.hosts, self.channel = hangs_dir, rank, hosts, channel
        self.fixed, self.cap = fixed_s, cap_s
        self.device = device if device is not None and device.type == "cuda" else None
        self.phase, self.step, self.since = "start", 0, time.monotonic()
        self.device_mark = None  # on a GPU: a CUDA event recorded at the latest mark
        self.longest = 0.0  # the longest step so far (s)
        self._uncounted = int(first_step_compiles)  # steps left out of `longest` (train.compile's first)
        self.samples = [0, 0]  # since the last busy_share(): [waiting, busy]
        self.reporting = threading.Event()  # set while this rank takes part in a hang report
        self.handled = 0  # the newest hang report this rank took part in
        self._done = threading.Event()
        self._wake = threading.Event()  # the watchdog thread's: a call heard (or close)
        self._heard = 0  # the newest report whose call the listener heard
        self._call = 1  # the report whose call the listener waits for
        self._thread = threading.Thread(target=self._watch, name="pretrain-watchdog", daemon=True)
        self._thread.start()
        self._listener = None  # waits for other ranks' requests (alone, no rank would ask)
        if channel is not None and len(hosts) > 1:
            self._listener = threading.Thread(target=self._listen, name="pretrain-watchdog-listener", daemon=True)
            self._listener.start()

    def mark(self, phase: str, step: int) -> None:
        """This rank entered `phase` of step `step` (the 1-based step being trained)."""
        if self.device is not None:
            event = torch.cuda.Event()
            event.record()
            self.device_mark = event
        self.phase, self.step, self.since = phase, step, time.monotonic()

    def progress(self) -> None:
        """This rank made progress in its current phase (a batch of a long evaluation, say)."""
        self.mark(self.phase, self.step)

    def step_took(self, seconds: float) -> None:
        if self._uncounted:
            self._uncounted -= 1
            return
        self.longest = max(self.longest, seconds)

    def busy_share(self) -> float:
        """The share of samples since the last call in which this rank was not waiting for others."""
        waiting, busy = self.samples
        self.samples = [0, 0]
        return busy / (waiting + busy) if waiting + busy else 1.0

    def timeout(self) -> float:
        if self.fixed:
            return self.fixed
        if not self.longest or self.phase in LONG_PHASES:
            t = FIRST_TIMEOUT_S
        else:
            t = max(MIN_TIMEOUT_S, STEP_MULTIPLE * self.longest)
        return max(1.0, min(t, 0.9 * self.cap, self.cap - HANG_EXIT_S))

    def waiting(self) -> bool:
        """Whether this rank waits for the others: on the host (its phase, or its main thread in a
        collective), or on its GPU (the device has not reached the host's latest mark: its stream
        is stalled behind a collective, while the host may block anywhere once the launch queue is
        full). A rank hung on its host has a device that caught up."""
        event = self.device_mark
        return self.phase == WAITING or _in_collective() or (event is not None and not event.query())

    def close(self) -> None:
        """Stop watching; a hang report in progress is finished first (it ends the process). The
        listener's wait in the store is ended too (no request stays in flight: a store that goes
        away with rank 0's process after this must not make this rank's listener fail)."""
        if self.reporting.is_set():
            self._thread.join(timeout=HANG_EXIT_S + 5)
        self._done.set()
        self._wake.set()
        self._thread.join(timeout=5)
        listener = self._listener
        if listener is not None and listener.is_alive():
            try:
                self.channel.call(self._call, self.rank)
            except Exception:  # noqa: BLE001 - the store is gone: so is the wait
                pass
            listener.join(timeout=STORE_TIMEOUT_S)

    def _watch(self) -> None:
        if self.device is not None:  # (events are queried in this thread)
            torch.cuda.set_device(self.device)
        while not self._done.is_set():
            self._wake.wait(POLL_S)
            if self._done.is_set():
                break
            self.samples[self.phase != WAITING and not _in_collective()] += 1
            now = time.monotonic()
            idle = now - self.since
            if idle > self.timeout():
                self._report(idle, fired=True)
            elif self._wake.is_set():  # the listener heard a call: another rank asks for a report
                self._wake.clear()
                latest = self._heard
                if latest > self.handled:
                    self._report(idle, fired=False, g=latest)

    def _listen(self) -> None:
        """The listener thread: waits for the next report's call to this rank, blocked in the store
        on a connection of its own (no polling), hands the report to the watchdog thread, waits
        for this rank's part in it to end (a hang ends the process), then for the next call."""
        from torch.distributed import DistStoreError

        try:
            ear = _connected(self.channel)
        except Exception as e:  # noqa: BLE001
            log.warning("warning: rank %d cannot wait for hang reports (the rendezvous store did not answer: %s); it "
                        "takes part in one only when its own watchdog fires", self.rank, _short(e))
            return
        g = 1
        while True:
            self._call = g  # (before the check: close() ends the wait for this call)
            if self._done.is_set():
                return
            try:
                ear.wait_call(g, self.rank, LISTEN_S)
                latest = ear.latest()
            except DistStoreError:  # no call for LISTEN_S: wait again
                self._done.wait(1.0)
                continue
            except Exception as e:  # noqa: BLE001 - the store is gone: a rank that fires says so
                if not self._done.is_set():
                    log.warning("warning: rank %d stops waiting for hang reports: the rendezvous store did not answer "
                                "(%s)", self.rank, _short(e))
                return
            if self._done.is_set():
                return
            if latest < g:  # (not a report: ask() sets `latest` before the calls)
                self._done.wait(1.0)
                continue
            self._heard = latest
            self._wake.set()
            while self.handled < latest or self.reporting.is_set():
                if self._done.wait(POLL_S):
                    return
            g = max(self.handled, latest) + 1

    def _report(self, idle: float, fired: bool, g: int = 0) -> None:
        """This rank's part of hang report `g` (module docstring): ends the process with EXIT_HANG
        when the verdict is a hang, else returns (the rank that asked waits a timeout more)."""
        self.reporting.set()
        hang = True
        try:
            head = {"rank": self.rank, "host": self.hosts[self.rank], "phase": self.phase, "step": self.step,
                    "idle_s": round(idle, 1), "waiting": self.waiting(), "fired": fired}
            leader, unreachable = False, None
            try:
                if self.channel is None:
                    unreachable = "no rendezvous store"
                else:
                    if fired:  # join the report in progress, if one is, else ask for the next
                        g = self.channel.latest()
                        g = g if g > self.handled and self.channel.verdict(g) is None else max(g, self.handled) + 1
                        leader = self.channel.ask(g, len(self.hosts))
                    self.channel.answer(g, self.rank, head)
            except Exception as e:  # noqa: BLE001
                unreachable = f"the rendezvous store did not answer ({_short(e)})"
            self.handled = max(self.handled, g)
            if leader or unreachable:
                hang = self._give_verdict(g, head, idle, unreachable)
            else:
                hang = self._await_verdict(g, head, idle)
        except BaseException as e:  # noqa: BLE001 - the verdict and the exit must happen whatever failed
            _say(f"pretrain: the hang report of rank {self.rank} failed ({_short(e)}); exiting with {EXIT_HANG}")
        finally:
            if hang:
                _bounded(logging.shutdown)  # (flushes the loggers; a handler's lock may be held by the main thread)
                os._exit(EXIT_HANG)
        if fired:
            self.since = time.monotonic()  # it waits for a rank that makes progress: a timeout more
        self.reporting.clear()

    def _give_verdict(self, g: int, head: dict, idle: float, unreachable: str | None) -> bool:
        """The asking rank: every rank's answer (or REPORT_WAIT_S), then the verdict; True for a hang."""
        answers = {self.rank: head}
        if unreachable is None:
            try:
                answers = self.channel.answers(g, len(self.hosts), REPORT_WAIT_S) or answers
            except Exception as e:  # noqa: BLE001
                unreachable = f"the rendezvous store did not answer ({_short(e)})"
        line, named = verdict(answers, self.hosts, idle, unreachable)
        if line is None:  # a rank makes progress: the others wait for it
            try:
                self.channel.publish(g, "")
            except Exception:  # noqa: BLE001 - the others give their own verdict at their deadline
                pass
            return False
        stacks = _bounded(self._write_stacks, head)
        line += f"; stacks in {self.dir}" if stacks is None else f"; stacks not written ({stacks})"
        _say(f"pretrain: {line}; exiting with {EXIT_HANG} (resume with checkpoint.resume=auto)")
        _bounded(record_exit, EXIT_HANG, line, sorted({self.hosts[r] for r in named}))
        if unreachable is None:
            try:
                self.channel.publish(g, line)
            except Exception:  # noqa: BLE001 - the others end at their own deadline
                pass
        return True

    def _await_verdict(self, g: int, head: dict, idle: float) -> bool:
        """Wait for the asking rank's verdict (True for a hang: the stacks are written); if it never
        comes (that rank is gone), give one."""
        try:
            line = self.channel.verdict(g, REPORT_WAIT_S + IO_TIMEOUT_S + STORE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the store is gone: this rank's verdict says so
            line = None
        if line is not None:
            if line:
                _bounded(self._write_stacks, head)
            return bool(line)
        return self._give_verdict(g, head, idle, None)

    def _write_stacks(self, head: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / f"rank-{self.rank}.txt", "w") as f:
            f.write(json.dumps(head) + "\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)


def _connected(channel: Channel, tries: int = 3) -> Channel:
    """`channel` on a connection of its own (a connect that fails is tried again)."""
    for _ in range(tries - 1):
        try:
            return channel.clone()
        except Exception:  # noqa: BLE001
            pass
    return channel.clone()


def _bounded(fn, *args) -> str | None:
    """Run `fn(*args)` for at most IO_TIMEOUT_S (a frozen file system blocks in open() forever):
    None when it finished, else why not. Best effort: the caller goes on either way."""
    failure = []

    def call():
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            failure.append(_short(e))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(IO_TIMEOUT_S)
    if thread.is_alive():
        return f"no answer from the file system in {IO_TIMEOUT_S:g} s"
    return failure[0] if failure else None


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def _say(line: str) -> None:
    """One line to stderr, whatever stderr is (a closed or full pipe must not stop the exit)."""
    _bounded(lambda: (sys.stderr.write(line + "\n"), sys.stderr.flush()))


def record_exit(code: int, why: str = "", hosts: list[str] = ()) -> None:
    """Where slurm/pretrain.sbatch asks for it ($PRETRAIN_EXIT_FILE), how this start ended: its
    restart loop restarts a hang (4) or a start that recorded nothing or 1 (a crash), not a user
    error, and leaves out a node that `hosts` (the hosts a hang named) named twice. A hang recorded
    by the watchdog is never replaced: the other ranks' errors that follow it are its consequence.
    (The loop removes the file before each start.)"""
    path = os.environ.get(EXIT_FILE)
    if not path:
        return
    try:
        if code != EXIT_HANG and json.loads(Path(path).read_text()).get("code") == EXIT_HANG:
            return
    except (OSError, ValueError, AttributeError):
        pass
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps({"code": code, "why": why, "hosts": list(hosts)}) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.error("pretrain: could not record the exit in %s: %s", path, e.strerror)


def _in_collective() -> bool:
    """Whether the main thread is inside a collective call (a host-side wait: gloo; NCCL returns at
    once and is waited for at a host read, the phase `collective`)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        code = frame.f_code
        if "distributed_c10d" in code.co_filename or f"deepspeed{os.sep}comm{os.sep}" in code.co_filename or (
                "deepspeed" in code.co_filename and code.co_name == "wait"):  # (ZeRO-3's all-gather handles)
            return True
        frame = frame.f_back
    return False


def verdict(seen: dict[int, dict], hosts: list[str], idle: float,
            unreachable: str | None = None) -> tuple[str | None, list[int]]:
    """One line: which ranks hang, where; and those ranks. None when no rank hangs: one that is not
    waiting made progress recently (the others wait for it). `seen`: rank -> the answer it gave;
    `idle`: how long the asking rank went without progress."""
    step = max((h["step"] for h in seen.values()), default=0)
    name = lambda r: f"rank {r} (host {hosts[r]}" + (f", in {seen[r]['phase']} of step {seen[r]['step']})"  # noqa: E731
                                                     if r in seen else ")")
    silent = [r for r in range(len(hosts)) if r not in seen]
    busy = [r for r, h in sorted(seen.items()) if not h["waiting"]]
    # Stuck: no progress for about as long as the asking rank (a rank that answers from the middle of
    # its micro-batches, making progress, is not hung: the others wait for it to arrive).
    stuck = [r for r in busy if seen[r]["idle_s"] >= idle / 2]
    if unreachable:
        named, what = [], "; ".join(
            f"{name(r)} made no progress ({'waiting for others' if h['waiting'] else 'not waiting'})"
            for r, h in sorted(seen.items())) + f"; the other ranks could not be asked: {unreachable}"
    elif silent:
        named, what = silent, f"{', '.join(map(name, silent))} did not answer (frozen, or gone)"
    elif stuck:
        named, what = stuck, f"{', '.join(map(name, stuck))} made no progress while the others waited in a collective"
    elif busy:
        return None, []
    else:
        named, what = [], "every rank waits in a collective: a communication hang (network, NCCL)"
    return f"hang at step {step}: no progress for {idle:.0f} s; {what}", named


