"""Rotary position embedding (RoPE) in Hugging Face Llama's rotate-half layout, with Llama 3.1's and
YaRN's frequency scaling and partial rotation (the first `rotary_dim` dimensions of each head)."""

from __future__ import annotations

import math

import torch


def precompute_freqs_cis(head_dim: int, end: int, theta: float = 10000.0, scaling: dict | None = None) -> torch.Tensor:
    """RoPE table for positions 0..end-1: (end, head_dim // 2, 2) fp32, last axis (cos, sin).
    `head_dim` is the rotated width (the rotary dimension under partial rotation).

    `scaling` (ModelArgs.rope_scaling), as transformers computes it:
    - "llama3" (factor, low, high, original context): Llama 3.1's. Wavelengths longer than
      original/low are stretched by `factor`, shorter than original/high kept, those between interpolated.
    - "yarn" (factor, original, beta_fast, beta_slow, truncate, attention_factor): YaRN (Peng et al.
      2023). Dimensions that turn more than beta_fast times within the original context keep their
      frequency, fewer than beta_slow times are divided by `factor`, a linear ramp between; cos and
      sin are multiplied by attention_factor (so q.k by its square).
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    gain = 1.0
    if scaling and scaling["kind"] == "llama3":
        factor, low, high, original = (scaling[k] for k in ("factor", "low", "high", "original"))
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > original / low, freqs / factor, freqs)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) & ~(wavelen > original / low)
        freqs = torch.where(medium, smoothed, scaled)
    elif scaling and scaling["kind"] == "yarn":
        factor, original = scaling["factor"], scaling["original"]

        def dimension(turns: float) -> float:  # the dimension that turns `turns` times in the original context
            return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dimension(scaling["beta_fast"]), dimension(scaling["beta_slow"])
        if scaling["truncate"]:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001))
        keep = 1 - ramp.clamp(0, 1)  # 1: the frequency as trained, 0: divided by the factor
        freqs = freqs / factor * (1 - keep) + freqs * keep
        gain = scaling["attention_factor"]
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)  # (end, hd/2)
    return torch.stack((angles.cos() * gain, angles.sin() * gain), dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, heads, hd) by the table rows for its T positions (T, rd/2, 2), or for each
    row's own positions (B, T, rd/2, 2), in fp32; rd = hd, or fewer under partial rotation, where
    the last hd - rd dimensions pass unrotated.

    Dimension i is paired with i + rd/2 (rotate-half, HF Llama's layout). Returns x's dtype.
    """
    cos = freqs_cis[..., None, :, 0].float()  # (T, 1, rd/2) or (B, T, 1, rd/2): broadcasts over heads
    sin = freqs_cis[..., None, :, 1].float()
    rd = 2 * freqs_cis.size(-2)
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot.float().chunk(2, dim=-1)  # (B, T, heads, rd/2) each
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)
    return out if rest.size(-1) == 0 else torch.cat((out, rest), dim=-1)
