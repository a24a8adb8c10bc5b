"""Fault injection for tests and drills: `PRETRAIN_FAULT`, off unless set (docs/reliability.md).

    PRETRAIN_FAULT="hang@rank=1,step=5"            rank 1 stops making progress in step 5's forward
    PRETRAIN_FAULT="slow@rank=1,seconds=0.3"       rank 1 sleeps 0.3 s in every step (from step=, default 1)
    PRETRAIN_FAULT="slowcompute@rank=1,seconds=0.3"  the same, inside its model's forward (a slow GPU)
    PRETRAIN_FAULT="crash@rank=0,step=9"           rank 0 dies (SIGKILL) in step 9
    PRETRAIN_FAULT="savecrash@rank=0,step=6"       rank 0 dies (SIGKILL) writing step 6's checkpoint,
                                                   its files written, the checkpoint not yet complete
    PRETRAIN_FAULT="signal@step=3,signum=15"       SIGTERM (15) to the process group in step 3, as
                                                   scancel or Ctrl-C (SIGINT, 2) would send it
    PRETRAIN_FAULT="nan@step=7"                    step 7's loss is NaN (on rank=, default every rank)
    PRETRAIN_FAULT="spike@step=12,factor=1000"     step 12's loss, so its gradient, x factor (finite)

Several are separated by `;`. A bad value (also a rank the run does not have) is one line and
exit 2. `rank` and `step` (the 1-based step being trained, as logged) select where a fault fires;
without `rank`, every rank. A fault of one step fires once per run dir (a marker in RUN/faults/
named for the fault, its step and rank): the resume after it, or a restart of the job, trains
through that step, while a later drill at another step fires. `nan` and `spike` hit every
micro-batch of their step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import time
from pathlib import Path

from pretrain.errors import ConfigError

ENV = "PRETRAIN_FAULT"
# The signals a run handles (pretrain/train.py's StopSignal): a drill of another one (SIGSTOP, say)
# would stop or kill the process group instead of testing anything of ours.
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM)
# kind -> (required keys, optional keys with defaults)
KINDS = {"hang": ({"step"}, {"rank": -1}), "slow": ({"seconds"}, {"rank": -1, "step": 1}),
         "slowcompute": ({"seconds"}, {"rank": -1, "step": 1}),
         "crash": ({"step"}, {"rank": -1}), "savecrash": ({"step"}, {"rank": -1}),
         "signal": ({"step", "signum"}, {"rank": -1}), "nan": ({"step"}, {"rank": -1}),
         "spike": ({"step"}, {"rank": -1, "factor": 1000.0})}


@dataclasses.dataclass
class Fault:
    kind: str
    rank: int
    step: int
    seconds: float = 0.0
    factor: float = 1.0
    signum: int = 0

    def here(self, rank: int, step: int) -> bool:
        on_rank = self.rank in (-1, rank)
        return on_rank and (step >= self.step if self.kind.startswith("slow") else step == self.step)


def parse(text: str) -> list[Fault]:
    faults = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        kind, _, args = item.partition("@")
        if kind not in KINDS:
            raise ConfigError(f"{ENV}={text!r}: unknown fault {kind!r}; faults: {', '.join(KINDS)} "
                              "(e.g. hang@rank=1,step=5)")
        required, optional = KINDS[kind]
        values = dict(optional)
        for pair in filter(None, (x.strip() for x in args.split(","))):
            key, eq, value = pair.partition("=")
            if not eq or key not in required | set(optional):
                raise ConfigError(f"{ENV}={text!r}: {kind} takes {', '.join(sorted(required | set(optional)))} "
                                  f"as key=value, not {pair!r}")
            try:
                values[key] = float(value) if key in ("seconds", "factor") else int(value)
            except ValueError:
                raise ConfigError(f"{ENV}={text!r}: {key}={value!r} is not a number") from None
            if not math.isfinite(values[key]):
                raise ConfigError(f"{ENV}={text!r}: {key}={value!r} must be a finite number")
        missing = required - values.keys()
        if missing:
            raise ConfigError(f"{ENV}={text!r}: {kind} needs {', '.join(sorted(missing))}")
        if kind == "signal" and values["signum"] not in HANDLED_SIGNALS:
            raise ConfigError(f"{ENV}={text!r}: signum={values['signum']} is not a signal the run handles: give "
                              + ", ".join(f"{int(s)} ({s.name})" for s in HANDLED_SIGNALS))
        if values["step"] < 1 or values.get("seconds", 0) < 0 or values["rank"] < -1:
            raise ConfigError(f"{ENV}={text!r}: step must be >= 1, rank >= 0, seconds >= 0")
        faults.append(Fault(kind, **values))
    return faults


def from_env(world_size: int = 0) -> list[Fault]:
    """The faults of PRETRAIN_FAULT (none when unset); raises ConfigError for a bad value, and, given
    the world size, for a rank the run does not have (the fault would never fire)."""
    text = os.environ.get(ENV, "")
    faults = parse(text)
    for f in faults:
        if world_size and f.rank >= world_size:
            raise ConfigError(f"{ENV}={text!r}: rank={f.rank}, but this run has {world_size} rank(s) "
                              f"(0-{world_size - 1})")
    return faults


class Injector:
    """Fires the faults at the trainer's fixed points: `at_forward` before each forward of a step,
    `loss` on each micro-batch's loss, and (`attach`) inside the model's first module that holds
    parameters, where a slow device would be slow. With no faults they do nothing."""

    def __init__(self, faults: list[Fault], rank: int, run_dir: Path):
        self.faults = [f for f in faults if f.rank in (-1, rank)]
        self.rank, self.markers = rank, run_dir / "faults"
        self._compute_delay = 0.0  # seconds for the next training forward to sleep (slowcompute)
        self._fired: dict[tuple[int, int], bool] = {}  # (fault index, step) -> whether it fires there

    def attach(self, model) -> None:
        """Hooks the model for slowcompute (call after any other forward hooks, which it lands inside)."""
        if any(f.kind == "slowcompute" for f in self.faults):
            first = next(m for m in model.modules() if next(m.parameters(recurse=False), None) is not None)
            import torch

            first.register_forward_pre_hook(torch.compiler.disable(self._slow_compute))

    def _slow_compute(self, module, args) -> None:
        delay, self._compute_delay = self._compute_delay, 0.0
        time.sleep(delay)

    def _fires(self, i: int, f: Fault, step: int) -> bool:
        """Whether fault `i` fires in step `step`: decided once per step (every micro-batch of the
        step alike) and once per run dir (a marker of the fault, its step and rank)."""
        if not f.here(self.rank, step):
            return False
        if f.kind.startswith("slow"):
            return True
        if (i, step) not in self._fired:
            marker = self.markers / f"{f.kind}@step={step}-rank{self.rank}"
            fires = not marker.exists()  # (it exists: fired in an earlier start of this run)
            if fires:
                self.markers.mkdir(parents=True, exist_ok=True)
                marker.touch()
            self._fired[(i, step)] = fires
        return self._fired[(i, step)]

    def at_forward(self, step: int, first_micro_batch: bool) -> None:
        if first_micro_batch:  # a new step (or the same step again, after a branch or a rollback)
            self._fired.clear()
        for i, f in enumerate(self.faults):
            if f.kind not in ("hang", "crash", "signal", "slow", "slowcompute") or not first_micro_batch \
                    or not self._fires(i, f, step):
                continue
            if f.kind == "slowcompute":
                self._compute_delay = f.seconds
            if f.kind == "hang":
                while True:  # no progress, forever: the watchdog ends it
                    time.sleep(1)
            if f.kind == "crash":
                os.kill(os.getpid(), signal.SIGKILL)  # as a lost node or the OOM killer would
            if f.kind == "signal":  # to the process group (data workers included), as a terminal's Ctrl-C
                _signal_group_from_outside(f.signum)
            if f.kind == "slow":
                time.sleep(f.seconds)

    def at_save_written(self, step: int) -> None:
        """In the save thread, once this rank's files of step `step`'s checkpoint are written."""
        for i, f in enumerate(self.faults):
            if f.kind == "savecrash" and self._fires(i, f, step):
                os.kill(os.getpid(), signal.SIGKILL)

    def loss(self, loss, step: int):
        for i, f in enumerate(self.faults):
            if f.kind in ("nan", "spike") and self._fires(i, f, step):
                loss = loss * (float("nan") if f.kind == "nan" else f.factor)
        return loss


def _signal_group_from_outside(signum: int) -> None:
    """Send `signum` to this process's group from another process, as scancel or a terminal does,
    and return once it is sent. Not from this one: a data worker takes a SIGTERM from its own parent
    (this process) as its shutdown and exits (data_pipeline/loader.py), and the step then fails for
    want of data, now and then, where a real scancel leaves the workers running."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", f"import os; os.killpg({os.getpgrp()}, {signum})"], check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
