"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

import torch

from pretrain.config import Config


def lr_at(step: int, peak: float, warmup: int, decay: int, floor: float) -> float:
    """Learning rate for optimizer step `step` (0-based): warmup from peak/warmup up to `peak` over
    `warmup` steps, cosine from `peak` to `floor` over the next `decay` steps, `floor` after that."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, decay))
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `lr_at`; its state_dict (the step count) makes resume exact."""
    s, peak = cfg.schedule, cfg.optimizer.lr
    decay = s.decay_steps or max(1, cfg.train.max_steps - s.warmup_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, peak, s.warmup_steps, decay, s.min_lr) / peak)
