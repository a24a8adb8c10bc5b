"""RMSNorm, the model's one normalisation (the blocks' pre/post norms, the final norm, q/k norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for bf16 accuracy; scale after casting back, as HF Llama does.
        return F.rms_norm(x.float(), (x.size(-1),), eps=self.eps).type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def optional_norm(present: bool, dim: int, eps: float) -> nn.Module:
    """An RMSNorm where the model description puts one, else the identity (no parameter, so the
    state dict names only the norms there are)."""
    return RMSNorm(dim, eps) if present else nn.Identity()


def init_norms(*modules: nn.Module) -> None:
    for m in modules:
        if isinstance(m, RMSNorm):
            m.init_weights()
