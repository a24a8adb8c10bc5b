"""RMSNorm, the model's one normalisation (the blocks' pre/post norms, the final norm, q/k norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) times the weight, or with `unit_offset` times (1 + weight), the weight starting at
    0 (Gemma's form, model.norm_unit_offset: its checkpoints store the gain minus one)."""

    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
        if self.unit_offset:  # scaled in fp32, then cast, as Gemma computes it
            return (normed * (1.0 + self.weight.float())).type_as(x)
        # Normalise in fp32 for bf16 accuracy; scale after casting back, as HF Llama does.
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        (nn.init.zeros_ if self.unit_offset else nn.init.ones_)(self.weight)


def optional_norm(present: bool, dim: int, eps: float, unit_offset: bool = False) -> nn.Module:
    """An RMSNorm where the model description puts one, else the identity (no parameter, so the
    state dict names only the norms there are)."""
    return RMSNorm(dim, eps, unit_offset) if present else nn.Identity()


def init_norms(*modules: nn.Module) -> None:
    for m in modules:
        if isinstance(m, RMSNorm):
            m.init_weights()
