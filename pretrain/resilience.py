"""Hangs named, stragglers found: a watchdog thread per rank (docs/reliability.md).

The trainer marks each phase of a step as it enters it (`mark`: two attribute writes, no sync). When
a rank's phase has not changed for the hang timeout, its watchdog writes every thread's stack
(faulthandler) and a header (rank, host, phase, step) to RUN/hangs/<start>/rank-N.txt, waits a few
seconds for the other ranks' watchdogs to do the same, and the lowest rank that wrote one logs one
line naming the ranks that hang: those that wrote nothing (frozen, or gone), else those not waiting
in a collective (the phase `collective`, or a main thread inside torch.distributed or
deepspeed.comm: ZeRO-3's gathers run inside the forward). Every rank then exits with EXIT_HANG, so the job ends (and slurm/pretrain.sbatch,
or a person, resumes it from the last checkpoint) instead of waiting for the collective timeout.

The timeout: `resilience.hang_timeout_s`, or learned: STEP_MULTIPLE x the longest step so far, at
least MIN_TIMEOUT_S; FIRST_TIMEOUT_S before the first step ends (start-up, compile) and in phases
that take longer than a step (eval, save, a decay branch's restore). Always below the collective
timeout (`distributed.timeout_s`), so the watchdog, which names the rank, fires first.

Stragglers: the same thread samples, 50 times a second, whether the main thread waits for other
ranks (as above); at each log step the trainer gathers every rank's busy time (the window's time
less its sampled waiting) and data wait over the CPU group and logs the slowest rank, its host and
its busy time over the median's. A slow rank is busy longer, its peers wait for it: the
all-reduce evens out their step times, not this. On a GPU, host sampling sees a slow host (data,
CPU, Python), not a slow GPU, whose wait shows up on every rank alike: ComputeClock times each
rank's own compute on the device for that (docs/reliability.md).

A watchdog in our own code, not a library's: torch's NCCL watchdog covers NCCL collectives only
(not gloo, data loading or a frozen process) and names no rank; nvidia-resiliency-ext's in-job
restarts need its own launcher.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EXIT_HANG = 4
STEP_MULTIPLE = 5  # nvidia-resiliency-ext learns its timeouts the same way
MIN_TIMEOUT_S = 300.0
FIRST_TIMEOUT_S = 1200.0
LONG_PHASES = ("start", "eval", "save", "branch")
WAITING = "collective"  # a rank in this phase waits for the others
POLL_S = 0.02  # the sampling interval (the timeout is checked at the same time)
EXIT_FILE = "PRETRAIN_EXIT_FILE"  # set by slurm/pretrain.sbatch: where a start records how it ended
STRAGGLER_STREAK = 3  # log steps in a row over resilience.straggler_warn before the warning


class Watchdog:
    def __init__(self, hangs_dir: Path, rank: int, hosts: list[str], fixed_s: float, cap_s: float):
        self.dir, self.rank, self.hosts = hangs_dir, rank, hosts
        self.fixed, self.cap = fixed_s, cap_s
        self.phase, self.step, self.since = "start", 0, time.monotonic()
        self.longest = 0.0  # the longest step so far (s)
        self.samples = [0, 0]  # since the last busy_share(): [waiting, busy]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pretrain-watchdog", daemon=True)
        self._thread.start()

    def mark(self, phase: str, step: int) -> None:
        """This rank entered `phase` of step `step` (the 1-based step being trained)."""
        self.phase, self.step, self.since = phase, step, time.monotonic()

    def step_took(self, seconds: float) -> None:
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
        return min(t, 0.9 * self.cap)

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._done.wait(POLL_S):
            self.samples[self.phase != WAITING and not _in_collective()] += 1
            idle = time.monotonic() - self.since
            if idle > self.timeout():
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        phase, step = self.phase, self.step
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank-{self.rank}.txt"
        with open(path, "w") as f:
            f.write(json.dumps({"rank": self.rank, "host": self.hosts[self.rank], "phase": phase, "step": step,
                                "idle_s": round(idle, 1), "waiting": phase == WAITING or _in_collective()}) + "\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        time.sleep(min(10.0, max(2.0, self.timeout() / 4)))  # the other ranks' watchdogs write theirs
        seen = {}
        for p in self.dir.glob("rank-*.txt"):
            try:
                head = json.loads(p.read_text().splitlines()[0])
                seen[head["rank"]] = head
            except (OSError, ValueError, IndexError, KeyError):
                continue
        if self.rank == min(seen, default=self.rank):
            line, named = verdict(seen, self.hosts, idle, self.dir)
            log.error("pretrain: %s; exiting with %d (resume with checkpoint.resume=auto)", line, EXIT_HANG)
            record_exit(EXIT_HANG, line, sorted({self.hosts[r] for r in named}))
        logging.shutdown()
        os._exit(EXIT_HANG)


def record_exit(code: int, why: str = "", hosts: list[str] = ()) -> None:
    """Where slurm/pretrain.sbatch asks for it ($PRETRAIN_EXIT_FILE), how this start ended: its
    restart loop restarts a hang (4) or a start that recorded nothing (a crash), not a user error,
    and leaves out a node that `hosts` (the hosts a hang named) named twice."""
    path = os.environ.get(EXIT_FILE)
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path + ".tmp").write_text(json.dumps({"code": code, "why": why, "hosts": list(hosts)}) + "\n")
        os.replace(path + ".tmp", path)
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


def verdict(seen: dict[int, dict], hosts: list[str], idle: float, where: Path) -> tuple[str, list[int]]:
    """One line: which ranks hang, where; and those ranks. `seen`: rank -> the header it wrote."""
    silent = [r for r in range(len(hosts)) if r not in seen]
    busy = [r for r, h in sorted(seen.items()) if not h["waiting"]]
    step = max((h["step"] for h in seen.values()), default=0)
    name = lambda r: f"rank {r} (host {hosts[r]}" + (f", in {seen[r]['phase']} of step {seen[r]['step']})"  # noqa: E731
                                                     if r in seen else ")")
    if silent:
        named, what = silent, f"{', '.join(map(name, silent))} did not answer (frozen, or gone)"
    elif busy:
        named, what = busy, f"{', '.join(map(name, busy))} made no progress while the others waited in a collective"
    else:
        named, what = [], "every rank waits in a collective: a communication hang (network, NCCL)"
    return f"hang at step {step}: no progress for {idle:.0f} s; {what}; stacks in {where}", named



class ComputeClock:
    """Each rank's own compute time, without its waits for other ranks: forwards with no collective
    inside. At ZeRO 0-2 that is the model's whole forward; at ZeRO-3, which gathers parameters in
    hooks on every module, the forward of each module that holds parameters (the matmuls and norms,
    recomputed ones included), timed from after its gather to its end: these hooks are registered
    after DeepSpeed's, so they run after them. A slow GPU is slow here and only here: host sampling
    (Watchdog) cannot see it, since every rank then waits alike at the step's one host read.

    On a GPU the marks are CUDA events on the current stream, read at log steps (`take`), when the
    step's host read has already passed them: no sync is added, and a mark not yet reached is left
    for the next window. On a CPU they are the host clock. Kept out of compiled graphs, as
    DeepSpeed's own hooks are (train.compile)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, zero_stage: int):
        self.cuda = device.type == "cuda"
        self.open: list = []  # start marks of modules in their forward
        self.marks: list = []  # (start, end) marks not yet read
        timed = [model] if zero_stage < 3 else [
            m for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
        self.handles = [h for m in timed for h in (m.register_forward_pre_hook(self._start),
                                                   m.register_forward_hook(self._end))]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @torch.compiler.disable
    def _start(self, module, args) -> None:
        self.open.append(self._now())

    @torch.compiler.disable
    def _end(self, module, args, output) -> None:
        if self.open:
            self.marks.append((self.open.pop(), self._now()))

    def take(self) -> float:
        """Compute seconds since the last call."""
        if not self.cuda:
            seconds = sum(end - start for start, end in self.marks)
            self.marks = []
            return seconds
        ms, left = 0.0, []
        for start, end in self.marks:
            if end.query():
                ms += start.elapsed_time(end)
            else:
                left.append((start, end))
        self.marks = left
        return ms / 1000

    def close(self) -> None:
        for h in self.handles:
            h.remove()


class Stragglers:
    """The straggler metrics of each log window, and a warning when one rank stays slow. Two views:
    host time (a rank's window less its sampled waits: a slow host, data loading, Python) and
    compute time (ComputeClock: a slow GPU); the report takes the one with the larger ratio."""

    def __init__(self, hosts: list[str], warn: float):
        self.hosts, self.warn, self.streak = hosts, warn, 0

    def __call__(self, times: list[tuple[float, float]]) -> dict:
        """`times`: every rank's (busy host seconds, compute seconds) in the window."""
        views = {}
        for i, view in enumerate(("host", "compute")):
            t = [x[i] for x in times]
            slowest = max(range(len(t)), key=t.__getitem__)
            median = statistics.median(t)
            views[view] = (t[slowest] / median if median > 0 else 1.0, slowest)
        view = max(views, key=lambda v: views[v][0])
        ratio, slowest = views[view]
        self.streak = self.streak + 1 if self.warn and ratio > self.warn else 0
        if self.streak == STRAGGLER_STREAK:
            log.warning("warning: rank %d (host %s) is a straggler: its %s time is %.2fx the median rank's for %d "
                        "log steps in a row (resilience.straggler_warn=%g); every rank waits for it", slowest,
                        self.hosts[slowest], view, ratio, self.streak, self.warn)
        return {"perf/slowest_rank": slowest, "perf/slowest_host": self.hosts[slowest],
                "perf/straggler_ratio": ratio, "perf/straggler_ratio_host": views["host"][0],
                "perf/straggler_ratio_compute": views["compute"][0]}


class Spikes:
    """Loss spikes, as OLMo-core's skip-step optimizer finds them: a step whose loss or gradient
    norm is above the mean + `sigma` standard deviations of the last `window` applied steps (once
    `warmup` of them are known) has its update dropped. Decided from the values the step reads on
    the host anyway (the global loss and norm: the same on every rank); the history is saved in
    checkpoints, so a resume decides the same."""

    def __init__(self, sigma: float, window: int, warmup: int):
        self.sigma, self.warmup = sigma, warmup
        self.losses: deque = deque(maxlen=window)
        self.norms: deque = deque(maxlen=window)

    def check(self, loss: float, norm: float) -> str:
        """Why this step is a spike ("" if it is not)."""
        if not self.sigma or len(self.losses) < self.warmup:
            return ""
        for name, value, history in (("loss", loss, self.losses), ("gradient norm", norm, self.norms)):
            mean, std = statistics.fmean(history), statistics.pstdev(history)
            if value > mean + self.sigma * std:
                return (f"{name} {value:.4g} is above the mean {mean:.4g} + {self.sigma:g} x {std:.3g} of the last "
                        f"{len(history)} steps")
        return ""

    def accept(self, loss: float, norm: float) -> None:
        self.losses.append(loss)
        self.norms.append(norm)

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms)}

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear()
        self.norms.clear()
        self.losses.extend(state.get("losses", []))
        self.norms.extend(state.get("norms", []))
