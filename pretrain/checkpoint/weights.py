"""Whole weights out of a checkpoint at any layout, and into a freshly built model (fine-tuning, evaluation,
export).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.checkpoint import reshard
from pretrain.checkpoint.reshard import persistent_buffers
from pretrain.config import is_hf_model
from pretrain.errors import CheckpointError, collective
from pretrain.parallel import distributed


def consolidated_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a checkpoint saved at any world size, ZeRO stage, precision and
    tensor-parallel size (pretrain/checkpoint/reshard.py reads DeepSpeed's shards; tests hold it against
    DeepSpeed's own zero_to_fp32 where that can read them)."""
    return reshard.fp32_weights(ckpt)


def load_weights(model: torch.nn.Module, ckpt: Path, env: distributed.Dist, zero3: bool) -> None:
    """Copy the weights of a checkpoint or a Hugging Face model directory into a freshly built
    (possibly ZeRO-3 partitioned) model, before the engine exists (AutoTP splits the matrices
    later, from these whole ones). Rank 0 reads (a checkpoint consolidated, an HF model one tensor
    at a time); the values reach the other ranks one parameter at a time, so no rank holds the
    whole model at once beyond what its reader needs. ZeRO-3 gathers and re-partitions within
    each data-parallel group, from its first rank: under tensor parallelism there is one such
    group per tensor-parallel rank, whose first ranks (0 .. tp-1, the first tensor-parallel group)
    each get the value from rank 0 first."""
    from pretrain.hf import hub

    state = {}
    if env.is_main:
        state = hub.LazyWeights(ckpt, model.args) if is_hf_model(ckpt) else consolidated_state_dict(ckpt)
    problem = _mismatch(model, state, ckpt) if env.is_main else None
    problem = distributed.broadcast_object(problem)
    if problem:
        raise collective(CheckpointError(problem))
    import deepspeed

    for name, param in model.named_parameters():
        if zero3:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if env.dp_rank == 0:  # the data-parallel group's first rank (modifier_rank=0 within it)
                    value = state[name].to(param.device, param.dtype) if env.is_main else torch.empty_like(param.data)
                    if env.tp > 1:  # (ranks 0 .. tp-1: the first tensor-parallel group)
                        distributed.broadcast(value, group=distributed.tensor_group())
                    param.data.copy_(value)
        else:
            if env.is_main:
                param.data.copy_(state[name])
            distributed.broadcast_host(param.data)  # still on the host: DeepSpeed moves it later
    for name, buffer in persistent_buffers(model):  # (an MoE router's bias; not in a Hugging Face model)
        found = distributed.broadcast_object(name in state if env.is_main else None)
        if found:
            value = state[name].to(buffer.dtype).cpu() if env.is_main else torch.empty_like(buffer, device="cpu")
            distributed.broadcast_host(value)
            buffer.copy_(value)


def _mismatch(model: torch.nn.Module, state, source: Path) -> str | None:
    """What keeps `state` (a dict or hub.LazyWeights) from loading into `model`, checked before any
    rank starts copying: missing parameters, other shapes (ZeRO-3 keeps the full one in ds_shape)."""
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in state]
    if missing:
        return f"checkpoint {source} lacks {missing[:3]}"
    for name, param in params.items():
        want = tuple(getattr(param, "ds_shape", param.shape))
        got = tuple(state.shape(name) if hasattr(state, "shape") else state[name].shape)
        if got != want:
            return f"{source}: {name} has shape {got}, the model {want}"
    return None
