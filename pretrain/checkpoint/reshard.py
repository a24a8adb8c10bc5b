"""A checkpoint at another layout: DeepSpeed's shards read back as whole tensors (the consolidated
weights of `pretrain eval`, export and `checkpoint.init_from`), and written in DeepSpeed's universal
format for a resume at another world size or tensor-parallel size (`python -m pretrain.checkpoint.reshard
CKPT OUT`, run by pretrain/checkpoint/manager.py).

Written by hand, because DeepSpeed 0.19.8's own tools cannot do it on the paths this system trains:
its converter (deepspeed.checkpoint.ds_to_universal) reads only Adam's exp_avg and exp_avg_sq
(KeyError 'exp_avg' on Muon's momentum_buffer), asserts on a universal_checkpoint_info that only
AutoTP records (every ZeRO-1/2 and bf16 stage-0/1 run without tensor parallelism), and maps
AutoTP's unsplit parameters under ZeRO-3 by their placeholder shape (0,) ("Rank 0 supplied a shard
of 128 elements, but the map describes 0"); its zero_to_fp32 refuses DeepSpeed's own bf16
optimizer's shards ("is not a zero checkpoint"). What is read here is DeepSpeed's layout:

- ZeRO-3 (`fp32_flat_groups`): per sub-group, each parameter padded to ceil(numel / n) elements on
  each of the n ranks, in the order of the model states' `param_shapes`; every optimizer state
  (exp_avg, exp_avg_sq, Muon's momentum_buffer) in the same layout.
- ZeRO-1/2 and the bf16 optimizer (`single_partition_of_fp32_groups`): per group one flat
  partition per rank, `param_slice_mappings` giving each parameter's fragment in it; Adam's states
  in the same layout. ZeRO-1/2's Muon momentum is different: every parameter that touches a
  rank's partition is kept whole, back to back (stage_1_and_2.py `_muon_momentum_buffer`).
- Under tensor parallelism one such set per tensor-parallel rank (`mp_rank_TT`), each holding its
  slices (parallelize.TP_SPLITS): joined along the split dimension, every state as its weight.

The universal folder holds every parameter's whole tensors (zero/NAME/{fp32,exp_avg,...}.pt), which
DeepSpeed's universal loader cuts into the new ranks' partitions (and, under AutoTP, slices), and
`load_universal` puts Muon's momentum where each of DeepSpeed's optimizers keeps it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import sys
from pathlib import Path

import torch

_SHARD = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MP_RANK = re.compile(r"(^|_)mp_rank_(\d+)_")
_EXPERTS = re.compile(r"\.experts\.[wb][123]$")  # an MoE layer's stacked experts and their biases (pretrain/model/moe.py)
VERSION = "pretrain-universal 2"  # the `done` marker of a conversion (an older one is made again)


def _load(path: Path):
    # (our own files; DeepSpeed's hold fragment addresses and other objects, not only tensors)
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)


def tensor_parallel_ranks(ckpt: Path) -> list[int]:
    """The tensor-parallel ranks a checkpoint has files of (`mp_rank_TT` in DeepSpeed's names: stage
    0-2's `mp_rank_TT_model_states.pt`, the `*zero_pp_rank_R_mp_rank_TT_*` shards)."""
    found = {int(m.group(2)) for f in ckpt.glob("*.pt") if (m := _MP_RANK.search(f.name))}
    return sorted(found) or [0]


def partitioned(ckpt: Path) -> bool:
    """Whether the checkpoint's weights and optimizer state are split over its ranks (ZeRO 1-3, or
    DeepSpeed's bf16 optimizer); ZeRO stage 0 in fp32 saves the whole model in one file per
    tensor-parallel rank."""
    return any(_SHARD.search(f.name) for f in ckpt.glob("*optim_states.pt"))


def _shard_files(ckpt: Path, tp_rank: int) -> list[Path]:
    files = {}
    for f in ckpt.glob("*optim_states.pt"):
        m = _SHARD.search(f.name)
        if m and int(m.group(2)) == tp_rank:
            files[int(m.group(1))] = f
    if not files or sorted(files) != list(range(len(files))):
        raise ValueError(f"{ckpt}: the optimizer shards of tensor-parallel rank {tp_rank} are incomplete "
                         f"(data-parallel ranks {sorted(files)})")
    return [files[r] for r in range(len(files))]


def _model_states(ckpt: Path, tp_rank: int) -> dict:
    for name in (f"mp_rank_{tp_rank:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_model_states.pt"):
        if (ckpt / name).is_file():
            return _load(ckpt / name)
    raise ValueError(f"{ckpt}: no model states file of tensor-parallel rank {tp_rank}")


def read_shards(ckpt: Path, tp_rank: int = 0, keys: tuple[str, ...] | None = None) -> tuple[dict, dict]:
    """(name -> {state: whole tensor}, info) of one tensor-parallel rank's shards at any ZeRO stage:
    "fp32" (the master weights), the optimizer's per-parameter states ("exp_avg", "exp_avg_sq",
    "momentum_buffer") and "step"; only `keys` (and "step") when given. info: "layout" (zero3, zero12,
    bf16), the optimizer's "param_groups", "shard" (data-parallel rank 0's shard, for its common
    state) and "ranks" (the data-parallel size it was saved at)."""
    shards = [_load(f)["optimizer_state_dict"] for f in _shard_files(ckpt, tp_rank)]
    shapes = _model_states(ckpt, tp_rank)["param_shapes"]  # per (sub-)group: name -> shape, in order
    first, n = shards[0], len(shards)
    wanted = (lambda key: key == "step" or keys is None or key in keys)
    out: dict[str, dict] = {}
    if "fp32_flat_groups" in first:
        layout = "zero3"
        for g, group in enumerate(shapes):
            # The ranks each share of the group is partitioned over: all of them, or under expert
            # parallelism each expert-parallel rank's experts over its expert-data-parallel ranks
            # (DeepSpeed's metadata), in the order of the experts they hold (by their first rank).
            owners = sorted({tuple(s["ds_zero_partition_groups"][g]["partition_ranks"]) if "ds_zero_partition_groups" in s
                             else tuple(range(n)) for s in shards})
            parts: dict[str, dict[str, list]] = {}
            for ranks in owners:
                flats = [{"fp32": shards[r]["fp32_flat_groups"][g], **shards[r]["optimizer_state_dict"]["state"].get(g, {})}
                         for r in ranks]
                offset = 0
                for name, shape in group.items():
                    numel = math.prod(shape)
                    part = math.ceil(numel / len(ranks))
                    entry = parts.setdefault(name, {})
                    for key, value in flats[0].items():
                        if not wanted(key):
                            continue
                        if key == "step":
                            out.setdefault(name, {})["step"] = value
                        elif torch.is_tensor(value) and value.dim() == 1:
                            whole = torch.cat([f[key].narrow(0, offset, part) for f in flats])[:numel].view(shape)
                            entry.setdefault(key, []).append(whole)
                    offset += part
                if any(f["fp32"].numel() != offset for f in flats):
                    raise ValueError(f"{ckpt}: ZeRO-3 group {g} holds {flats[0]['fp32'].numel()} elements per rank, its "
                                     f"parameters {offset}: not a layout this reader knows")
            for name, entry in parts.items():  # (the expert-parallel ranks' experts, stacked in order)
                for key, pieces in entry.items():
                    out.setdefault(name, {})[key] = torch.cat(pieces).clone()
    else:
        layout = "zero12" if "zero_stage" in first else "bf16"
        for g, group in enumerate(shapes):
            pieces: dict[str, dict[str, list]] = {name: {} for name in group}
            # Under expert parallelism a group of experts ("moe": pretrain/optim/optimizer.py
            # expert_groups) is partitioned over the ranks that hold the same experts, every ep-th
            # one: its partitions in the order of the experts they hold, each rank's (E/ep, ...) stacked.
            ep = _expert_parallel_size(first["base_optimizer_state"]["param_groups"][g])
            if ep > 1:
                group = {name: (shape[0] * ep, *shape[1:]) for name, shape in group.items()}
            for s in (shards[r] for r in sorted(range(n), key=lambda r: (r % ep, r // ep))):
                fp32 = s["single_partition_of_fp32_groups"][g]
                state = s["base_optimizer_state"]["state"].get(g, {})
                mapping = s["param_slice_mappings"][g]  # name -> fragment (start in the partition, numel)
                momentum = state.get("momentum_buffer")
                whole = layout == "zero12" and momentum is not None  # ZeRO-1/2's Muon: whole parameters
                if whole and momentum.numel() != sum(math.prod(group[name]) for name in mapping):
                    raise ValueError(f"{ckpt}: group {g}'s momentum_buffer has {momentum.numel()} elements, not the "
                                     "whole parameters of its partition")
                at = 0
                for name, fragment in mapping.items():
                    piece = pieces[name]
                    if wanted("fp32"):
                        piece.setdefault("fp32", []).append(fp32.narrow(0, fragment.start, fragment.numel))
                    for key, value in state.items():
                        if not wanted(key):
                            continue
                        if key == "step":
                            piece["step"] = value
                        elif key == "momentum_buffer" and whole:
                            numel = math.prod(group[name])
                            piece.setdefault("whole", []).append(momentum.narrow(0, at, numel))
                            at += numel
                        elif torch.is_tensor(value) and value.dim() == 1:
                            piece.setdefault(key, []).append(value.narrow(0, fragment.start, fragment.numel))
            for name, shape in group.items():
                entry = out.setdefault(name, {})
                for key, parts in pieces[name].items():
                    if key == "step":
                        entry["step"] = parts
                    elif key == "whole":  # (held by every rank whose partition it touches: the same)
                        entry["momentum_buffer"] = parts[0].view(shape).clone()
                    else:
                        entry[key] = torch.cat(parts).view(shape).clone()
    inner = first["optimizer_state_dict" if layout == "zero3" else "base_optimizer_state"]
    return out, {"layout": layout, "param_groups": inner["param_groups"], "shard": first, "ranks": n}


def _expert_parallel_size(group: dict) -> int:
    """The expert-parallel size of an optimizer group of experts at ZeRO-1/2 (DeepSpeed's "moe"
    groups, named by their expert-parallel group: ep_size_N), else 1."""
    return int(group["name"].rsplit("_", 1)[1]) if group.get("moe") else 1


def _join(name: str, slices: list[torch.Tensor]) -> torch.Tensor:
    """A parameter's (or one of its states') tensor-parallel slices, joined as AutoTP split them."""
    from pretrain.parallel.parallelize import tensor_parallel_dim

    dim = tensor_parallel_dim(name)
    return slices[0] if dim is None or len(slices) == 1 else torch.cat(slices, dim=dim)


def fp32_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights from a checkpoint of any ZeRO stage, precision, world size and
    tensor-parallel size: ZeRO's master weights, or stage 0's fp32 model states."""
    ranks = tensor_parallel_ranks(ckpt)
    if not partitioned(ckpt):
        slices = [{k: v.float() for k, v in _model_states(ckpt, t)["module"].items()} for t in ranks]
        return {name: _join(name, [s[name] for s in slices]) for name in slices[0]}
    slices = [read_shards(ckpt, t, keys=("fp32",))[0] for t in ranks]
    slices = [{name: states["fp32"] for name, states in s.items()} for s in slices]
    out = {name: _join(name, [s[name] for s in slices]) for name in slices[0]}
    # What the shards leave out, as DeepSpeed's zero_to_fp32 restores it: the buffers (in the model
    # states' module), and each tied weight's second name (model.tie_embeddings: output.weight is
    # tok_embeddings.weight, partitioned once).
    states = _model_states(ckpt, ranks[0])
    buffers = set(states.get("buffer_names") or ())
    out.update({k: v.float() for k, v in states["module"].items() if k in buffers})
    for alias, name in (states.get("shared_params") or {}).items():
        if name in out:
            out[alias] = out[name]
    return out


def write_universal(ckpt: Path, out: Path, split_experts: bool = False) -> None:
    """DeepSpeed's universal layout of `ckpt` in `out`: zero/NAME/KEY.pt (whole tensors, tensor-
    parallel slices joined), zero/NAME/step.pt, zero/optimizer_state.pt (the optimizer's common
    state and param groups) and the model states files (DeepSpeed reads its metadata from them).
    `split_experts`: for a run with expert parallelism, the stacked experts' files are marked as
    DeepSpeed's loader wants them to cut each expert-parallel rank's experts from them (its
    is_expert_param; a run without would refuse them)."""
    from deepspeed.checkpoint.constants import EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS

    per_rank = [read_shards(ckpt, t) for t in tensor_parallel_ranks(ckpt)]
    states, info = per_rank[0]
    zero = out / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    for name, entry in states.items():
        folder = zero / name
        folder.mkdir(exist_ok=True)
        for key, value in entry.items():
            if key == "step":
                torch.save(value, folder / "step.pt")
            else:
                value = _join(name, [s[name][key] for s, _ in per_rank])
                marks = {EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: value.shape[0]} if split_experts and _EXPERTS.search(name) else {}
                torch.save({"param": value, "cat_dim": 0, **marks}, folder / f"{key}.pt")
    shard = info["shard"]
    if info["layout"] == "zero3":  # (its loader reads the first group's step and the param groups)
        common = {k: v for k, v in shard.items() if k != "fp32_flat_groups"}
        step = {k: v for k, v in shard["optimizer_state_dict"]["state"].get(0, {}).items() if k == "step"}
        common["optimizer_state_dict"] = {"state": {0: step}, "param_groups": info["param_groups"]}
    else:
        common = {k: v for k, v in shard.items()
                  if k not in ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")}
    # DeepSpeed's ZeRO-1/2 and bf16 universal loader (base_optimizer.py) loads the engine's groups
    # zipped with these: an engine with more (its experts in groups of their own, expert parallelism
    # at ZeRO-1/2, from a checkpoint without) would keep the rest as initialised. So the list is
    # padded with copies, at most twice as many groups as there are; the checkpoint manager gives
    # every group its own settings back after the load.
    common["param_groups"] = info["param_groups"] * 2
    torch.save(common, zero / "optimizer_state.pt")
    for f in ckpt.glob("*model_states.pt"):
        try:
            os.link(f, out / f.name)
        except OSError:  # (another file system)
            shutil.copy2(f, out / f.name)


def persistent_buffers(model: torch.nn.Module):
    """(name, buffer) of the buffers a state dict holds (non-persistent ones, the RoPE table, are rebuilt)."""
    for prefix, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


def load_universal(engine, folder: Path) -> None:
    """engine.load_checkpoint of a universal folder (write_universal's): weights and optimizer state
    cut into this engine's partitions, and Muon's momentum where each of DeepSpeed's optimizers
    keeps it: ZeRO-3's loader reads only fp32, exp_avg and exp_avg_sq of each parameter (stage3.py
    _load_universal_checkpoint), so a Muon matrix's momentum goes in as its exp_avg; ZeRO-1/2 keeps
    the whole parameters of the partition (rebuilt here); the bf16 optimizer keeps it in its
    partition's layout, where DeepSpeed's loader puts every KEY.pt it finds."""
    opt = engine.optimizer
    stage3 = hasattr(opt, "fp32_partitioned_groups_flat")
    muon_groups = list(getattr(opt, "sub_groups_using_muon", None) or []) if stage3 else []
    if any(muon_groups):
        muon = {id(p) for i, g in enumerate(opt.fp16_groups) if muon_groups[i] for p in g}
        read = opt.load_hp_checkpoint_state

        def load_hp_checkpoint_state(path, key, param=None):
            if param is not None and id(param) in muon and key in ("exp_avg", "exp_avg_sq"):
                key = "momentum_buffer"
            return read(path, key, param=param)

        opt.load_hp_checkpoint_state = load_hp_checkpoint_state
    engine._config.load_universal_checkpoint = True
    try:
        path, _ = engine.load_checkpoint(str(folder.parent), tag=folder.name, load_optimizer_states=True,
                                         load_lr_scheduler_states=False)
    finally:
        if any(muon_groups):
            del opt.load_hp_checkpoint_state  # (back to the class's)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load {folder}")
    module = _model_states(folder, 0)["module"]
    for name, buffer in persistent_buffers(engine.module):
        if name in module:
            buffer.copy_(module[name])
    for i, is_muon in enumerate(muon_groups):
        if is_muon:
            state = opt.optimizer.state[opt.fp32_partitioned_groups_flat[i]]
            state["momentum_buffer"] = state.pop("exp_avg")
            state.pop("exp_avg_sq", None)
            state.pop("step", None)
    if not stage3 and hasattr(opt, "params_in_partition"):  # ZeRO-1/2
        for i, params in enumerate(opt.params_in_partition):
            flat = opt.optimizer.param_groups[i]["params"][0]
            state = opt.optimizer.state[flat]
            if "momentum_buffer" in state:
                parts = [_load(folder / "zero" / opt.param_names[p] / "momentum_buffer.pt")["param"].reshape(-1)
                         for p in params]
                state["momentum_buffer"] = torch.cat(parts).to(flat.device, flat.dtype)


def main(argv: list[str] | None = None) -> int:
    """python -m pretrain.checkpoint.reshard CKPT OUT [--split-experts]: write CKPT's universal form
    into OUT (made anew)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = "--split-experts" in argv
    ckpt, out = (Path(a) for a in argv if a != "--split-experts")
    shutil.rmtree(out, ignore_errors=True)
    write_universal(ckpt, out, split_experts=split)
    (out / "done").write_text(VERSION + (" experts split" if split else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
