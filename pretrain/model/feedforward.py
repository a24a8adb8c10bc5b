"""The dense feed-forward: a gated linear unit, w2(act(w1 x) * w3 x), with SiLU (SwiGLU, Llama) or
tanh-approximated GeLU (GeGLU, Gemma) as the gate's activation, or GPT-OSS's clamped SwiGLU."""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def _product(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


def _clamped_swiglu(limit: float, alpha: float, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's: the gate clamped above at `limit`, the up projection to [-limit, limit],
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def gated(activation: str, limit: float = 7.0, alpha: float = 1.702) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(gate, up) -> the unit's output: act(gate) * up, or GPT-OSS's clamped SwiGLU
    (model.ffn_activation; model.swiglu_limit and swiglu_alpha)."""
    if activation == "clamped_swiglu":
        return functools.partial(_clamped_swiglu, limit, alpha)
    return functools.partial(_product, ACTIVATIONS[activation])


class FeedForward(nn.Module):
    """w2(glu(w1 x, w3 x)), glu = gated(model.ffn_activation, ...): act(w1 x) * w3 x, or clamped.

    With `chunk` > 0 (train.mlp_chunk_tokens) it runs `chunk` tokens at a time, each tile under
    torch.utils.checkpoint when gradients are on: only the tiles' inputs are kept for backward, and
    the (tokens, hidden_dim) intermediates exist for one tile at a time, forward and backward (ALST's
    TiledMLP). For long sequences, where those intermediates are the largest activations."""

    def __init__(self, dim: int, hidden_dim: int, glu: Callable = gated("silu")):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.glu = glu
        self.chunk = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, -2)  # (N, D)
        if not self.chunk or tokens.size(0) <= self.chunk:
            return self._glu(x)
        tile = functools.partial(checkpoint, self._glu, use_reentrant=False) if torch.is_grad_enabled() \
            else self._glu
        return torch.cat([tile(part) for part in tokens.split(self.chunk)]).view_as(x)

    def _glu(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.glu(self.w1(x), self.w3(x)))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, mean=0.0, std=std)
        nn.init.normal_(self.w3.weight, mean=0.0, std=std)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)
