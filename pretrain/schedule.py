"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

The trainer owns the schedule (DeepSpeed gets no LR scheduler): before each optimizer step it sets
the rate of that step, `lr_at(step)`, a pure function of the step count. So the logged `train/lr`
is the rate the step used, a step whose update was dropped (non-finite loss or gradients) still
moves the schedule on like every other step, and resume needs no scheduler state.
"""

from __future__ import annotations

import math

from pretrain.config import Config


def lr_at(step: int, peak: float, warmup: int, decay: int, floor: float) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup from peak/warmup up to `peak` over
    `warmup` steps, cosine from `peak` to `floor` over the next `decay` steps, `floor` after that."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, decay))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


class Schedule:
    """`schedule(step)` -> the learning rate of 0-based optimizer step `step`."""

    def __init__(self, cfg: Config):
        s = cfg.schedule
        self.peak, self.warmup, self.floor = cfg.optimizer.lr, s.warmup_steps, s.min_lr
        self.decay = s.decay_steps or max(1, cfg.train.max_steps - s.warmup_steps)

    def __call__(self, step: int) -> float:
        return lr_at(step, self.peak, self.warmup, self.decay, self.floor)
