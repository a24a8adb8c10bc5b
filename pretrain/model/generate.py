"""Sampling from a Transformer with its KV cache: one prefill, then one token per step."""

from __future__ import annotations

import torch

from pretrain.model.attention import KVCache
from pretrain.model.model import Transformer


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of logits (B, V) -> (B,) int64.

    temperature 0 is greedy (argmax) whatever top_k/top_p say. top_k > 0 keeps the k likeliest
    tokens; top_p < 1 keeps the smallest set whose probability reaches top_p (always at least one).
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the tokens before it already reach top_p; the first one always stays.
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample(model: Transformer, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None, eos_id: int | None = None) -> list[int]:
    """Continue `prompt_ids` by up to max_new_tokens tokens; returns the new tokens only.

    Stops after eos_id (which is included). `seed` seeds a private generator, so the same seed
    gives the same sample and the global RNG is left alone; None uses the global RNG.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one token (e.g. BOS)")
    total = len(prompt_ids) + max_new_tokens
    if total > model.args.max_seq_len:
        raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"model.max_seq_len={model.args.max_seq_len}")
    param = next(model.parameters())
    generator = None
    if seed is not None:
        generator = torch.Generator(device=param.device).manual_seed(seed)
    cache = KVCache(model.args, batch_size=1, max_len=total, device=param.device, dtype=param.dtype)

    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=param.device)  # (1, T)
    pos, out = 0, []
    for _ in range(max_new_tokens):
        logits = model(tokens, cache=cache, start_pos=pos)[:, -1]  # (1, V)
        pos += tokens.size(1)
        tokens = next_token(logits, temperature, top_k, top_p, generator)[:, None]  # (1, 1)
        out.append(tokens.item())
        if out[-1] == eos_id:
            break
    return out
