"""Spikes survived (docs/reliability.md): a step whose loss or gradient norm spikes has its update
dropped (Spikes), and spikes that keep coming bring the run back to an earlier checkpoint, past the
data that caused them (Rollbacks).
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import deque
from pathlib import Path

from pretrain.errors import NonFiniteStep

log = logging.getLogger(__name__)


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


class Rollbacks:
    """The second rung after dropping spikes (PaLM): `rollback_after` spikes within
    `rollback_window` steps bring the run back to its newest checkpoint before the first of them,
    and the data from that step on is skipped (`rollback_skip_batches` global batches). Past
    `max_rollbacks`, the run stops (exit 3).

    Owns the ledger: step -> global batches to skip just before it (resilience.skip_batches, and
    each rollback's), the steps of recent spikes, and the rollbacks so far. It is saved in every
    checkpoint (through the trainer's state) and, when a rollback happens, at once in
    RUN/rollbacks.json (durably), so that a run killed before its next checkpoint still skips that
    data and still counts the rollback against max_rollbacks when it resumes."""

    FILE = "rollbacks.json"

    def __init__(self, cfg, run_dir: Path, run_id: str, is_main: bool, accum: int):
        self.cfg, self.path, self.run_id, self.is_main, self.accum = cfg, run_dir / self.FILE, run_id, is_main, accum
        self.data_skips = {int(step): int(n) for step, n in cfg.skip_batches}
        self.recent_spikes: list[int] = []
        self.rollbacks = 0
        self._merge_durable()

    def state_dict(self) -> dict:
        return {"data_skips": {str(k): v for k, v in self.data_skips.items()}, "recent_spikes": self.recent_spikes,
                "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        """Merged with what this object knows (the ledger of a run only grows: a rollback restores
        a checkpoint older than its own decision) and with RUN/rollbacks.json."""
        self.data_skips.update({int(k): v for k, v in state.get("data_skips", {}).items()})
        self.recent_spikes = list(state.get("recent_spikes", []))
        self.rollbacks = max(self.rollbacks, state.get("rollbacks", 0))
        self._merge_durable()

    def _merge_durable(self) -> None:
        """What RUN/rollbacks.json adds: rollbacks this run made after the checkpoint was saved."""
        try:
            ledger = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if ledger.get("run_id") == self.run_id:
            self.data_skips.update({int(k): int(v) for k, v in ledger["data_skips"].items()})
            self.rollbacks = max(self.rollbacks, int(ledger["rollbacks"]))

    def pinned(self, step: int) -> int | None:
        """While spikes are recent, the first of them: checkpoint rotation keeps the newest
        checkpoint before it (the one a rollback would need)."""
        if not self.cfg.rollback_after:
            return None
        recent = [s for s in self.recent_spikes if s > step - self.cfg.rollback_window]
        return recent[0] if recent else None

    def spiked(self, step: int, ckpt, newest: int | None = None) -> Path | None:
        """Step `step` was a spike: None, or, when a rollback is due, the checkpoint to go back to
        (none after step `newest`: in a decay branch, its start; later ones are the stable phase's),
        with the later checkpoints set aside and the ledger written (collective). Raises
        NonFiniteStep past max_rollbacks, or when no checkpoint before the spikes exists."""
        from pretrain.checkpoint.layout import complete_checkpoints, read_meta

        r = self.cfg
        self.recent_spikes = [s for s in self.recent_spikes if s > step - r.rollback_window] + [step]
        if not r.rollback_after or len(self.recent_spikes) < r.rollback_after:
            return None
        first, spikes = self.recent_spikes[0], f"{len(self.recent_spikes)} spikes in steps {self.recent_spikes[0]}-{step}"
        if self.rollbacks >= r.max_rollbacks:
            raise NonFiniteStep(f"{spikes} after {self.rollbacks} rollbacks (resilience.max_rollbacks): the run is "
                                "diverging; lower optimizer.lr, then resume with checkpoint.resume=auto")
        ckpt.wait()
        newest = first - 1 if newest is None else min(newest, first - 1)
        before = [p for p in complete_checkpoints(ckpt.root) if read_meta(p)["step"] <= newest]
        if not before:
            c = ckpt.cfg
            why = (f"checkpoint rotation (checkpoint.keep_last={c.keep_last}) removed the ones before them: raise "
                   "checkpoint.keep_last" if c.every and c.every < first else
                   f"set checkpoint.every below {first}")
            raise NonFiniteStep(f"{spikes} and no checkpoint before them to roll back to: {why}, or lower "
                                "optimizer.lr")
        path = before[-1]
        self.rollbacks += 1
        self.data_skips[first] = r.rollback_skip_batches
        ckpt.set_aside_after(path, self.rollbacks)
        if self.is_main:
            from pretrain.checkpoint.rundir import write_atomic

            write_atomic(self.path, json.dumps({"run_id": self.run_id, "rollbacks": self.rollbacks,
                                                "data_skips": {str(k): v for k, v in self.data_skips.items()}}))
        log.warning("warning: %s: rolling back to %s and skipping %d batches of data before step %d (rollback %d of "
                    "at most %d)", spikes, path.name, r.rollback_skip_batches, first, self.rollbacks, r.max_rollbacks)
        return path

    def skip(self, data_iter, step: int, progress) -> None:
        """Before step `step`: draw and drop the global batches the ledger says (each rank its
        share), calling `progress()` as it goes (a long skip is not a hang)."""
        batches = self.data_skips.get(step, 0)
        for i in range(batches * self.accum):
            next(data_iter)
            if i % 64 == 0:
                progress()
        if batches:
            log.warning("warning: step %d: skipped %d batches of data (resilience: a rollback's or skip_batches)",
                        step, batches)
