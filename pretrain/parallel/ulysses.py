"""Ulysses sequence parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses): the exchange around each
layer's attention.

Each rank of a sequence-parallel group of N holds T/N consecutive tokens of the same sequences. Up to
attention everything is per token, so each rank computes its slice alone (projections, RoPE at the
slice's own positions). Attention needs every key: an all-to-all turns (T/N tokens, all heads) into
(all T tokens, heads/N) on each rank, the rank attends over the whole sequence for its heads, and a
second all-to-all turns the result back. DeepSpeed's `DistributedAttention` does the exchange (and
its backward); this module installs it around `Attention.attend`, so the model stays a plain decoder
when N = 1 and its parameters, checkpoints and exports do not depend on N.

Grouped-query attention with fewer KV heads than N (or a count N does not divide) replicates each KV
head r times, r the smallest making KV * r a multiple of N: rank s then holds the KV heads its query
heads read (every count involved divides n_heads, so KV * r does too).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from pretrain.estimate.memory import kv_replication
from pretrain.model.attention import Attention
from pretrain.model.model import Transformer


def apply(model: Transformer, group, size: int) -> None:
    """Exchange heads for sequence around every attention of `model` over `group` (`size` ranks).
    Attention in place, as activation checkpointing is: parameter names stay the same."""
    from deepspeed.sequence.layer import DistributedAttention

    if size <= 1:
        return
    rank = torch.distributed.get_rank(group)
    for attention in [m for m in model.modules() if isinstance(m, Attention)]:
        # scatter_idx=2: heads are split; gather_idx=1: the sequence is joined; batch first.
        exchange = DistributedAttention(attention.attend, group, scatter_idx=2, gather_idx=1)
        attention.attend = functools.partial(_exchanged, attention, exchange, attention.attend,
                                             kv_replication(attention.n_kv_heads, size), rank, size)


def _exchanged(attention: Attention, exchange, local, repeat: int, rank: int, size: int, q, k, v, mask=None,
               sinks=None):
    if not getattr(attention, "sequence_parallel", True):  # inside `local_attention`
        return local(q, k, v, mask, sinks)
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
    if sinks is not None:  # the sinks of the heads this rank attends with: the rank-th of `size` equal parts
        sinks = sinks.chunk(size)[rank]
    return exchange(q, k, v, 0, None, mask, sinks)  # (batch_dim_idx=0, no rotary: RoPE is applied already)


@contextlib.contextmanager
def local_attention(model: torch.nn.Module):
    """Within: every rank attends over the tokens it was given, without the exchange (scoring short
    task requests, each rank its own, under a sequence-parallel run)."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for a in layers:
        a.sequence_parallel = False
    try:
        yield
    finally:
        for a in layers:
            a.sequence_parallel = True
