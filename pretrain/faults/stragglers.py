"""Stragglers found (docs/reliability.md).

The watchdog's thread (pretrain/faults/watchdog.py) samples, 50 times a second, whether the main
thread waits for other ranks (on the host: the phase or the stack); at each log step the trainer
gathers every rank's busy time (the window's time less its sampled waiting) and data wait over the
CPU group and logs the slowest rank, its host and its busy time over the median's. A slow rank is
busy longer, its peers wait for it: the all-reduce evens out their step times, not this. On a GPU,
host sampling sees a slow host (data, CPU, Python), not a slow GPU, whose wait shows up on every rank
alike: ComputeClock times each rank's own compute on the device for that (docs/reliability.md).
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

log = logging.getLogger(__name__)


STRAGGLER_STREAK = 3  # log steps in a row with the same rank over resilience.straggler_warn before the warning


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
        self.streak_rank = -1  # the rank the streak is of

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
        slow = bool(self.warn) and ratio > self.warn
        self.streak = self.streak + 1 if slow and slowest == self.streak_rank else int(slow)
        self.streak_rank = slowest if slow else -1
        if self.streak == STRAGGLER_STREAK:
            log.warning("warning: rank %d (host %s) is a straggler: its %s time is %.2fx the median rank's for %d "
                        "log steps in a row (resilience.straggler_warn=%g); every rank waits for it", slowest,
                        self.hosts[slowest], view, ratio, self.streak, self.warn)
        return {"perf/slowest_rank": slowest, "perf/slowest_host": self.hosts[slowest],
                "perf/straggler_ratio": ratio, "perf/straggler_ratio_host": views["host"][0],
                "perf/straggler_ratio_compute": views["compute"][0]}
