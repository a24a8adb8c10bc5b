"""Learning-rate schedules: linear warmup, then cosine or linear decay, warmup-stable-decay (WSD),
or constant.

The trainer owns the schedule (DeepSpeed gets no LR scheduler): before each optimizer step it sets
the rate of that step, `schedule(step)`, a pure function of the step count. So the logged `train/lr`
is the rate the step used, a step whose update was dropped (non-finite loss or gradients) still
moves the schedule on like every other step, and resume needs no scheduler state.

WSD (Hu et al. 2024, MiniCPM; Hagele et al. 2024) holds the peak rate and decays over the last
`decay_fraction` of the run, with a linear, cosine or 1-sqrt shape. Its decay can end anywhere:
`schedule(step, end)` is the rate of a decay that ends at `end`, which is how a WSD-S run's decay
branches (schedule.decay_points, pretrain/trainer.py) get their rates.
"""

from __future__ import annotations

import math

from pretrain.config import Config

SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "1-sqrt": lambda p: 1.0 - math.sqrt(p),
}


def lr_at(step: int, peak: float, warmup: int, decay: int, floor: float, shape: str = "cosine") -> float:
    """Learning rate for optimizer step `step` (0-based): warmup from peak/warmup up to `peak` over
    `warmup` steps, a decay of `shape` from `peak` to `floor` over the next `decay` steps, `floor` after."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, decay))
    return floor + (peak - floor) * SHAPES[shape](progress)


class Schedule:
    """`schedule(step)` -> the learning rate of 0-based optimizer step `step`; for WSD,
    `schedule(step, end)` -> the rate when the decay ends at step `end` (default train.max_steps)."""

    def __init__(self, cfg: Config):
        s = cfg.schedule
        self.kind, self.peak, self.warmup, self.floor = s.kind, cfg.optimizer.lr, s.warmup_steps, s.min_lr
        self.decay = s.decay_steps or max(1, cfg.train.max_steps - s.warmup_steps)
        self.end, self.fraction, self.shape = cfg.train.max_steps, s.decay_fraction, s.decay_shape

    def decay_start(self, end: int) -> int:
        """WSD: the first step of a decay that ends at `end`."""
        return end - max(1, round(self.fraction * end))

    def __call__(self, step: int, end: int | None = None) -> float:
        if self.kind in ("cosine", "linear"):
            return lr_at(step, self.peak, self.warmup, self.decay, self.floor, self.kind)
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if self.kind == "constant":
            return self.peak
        end = end or self.end
        start = self.decay_start(end)
        if step < start:
            return self.peak
        return lr_at(step - start, self.peak, 0, end - start, self.floor, self.shape)
