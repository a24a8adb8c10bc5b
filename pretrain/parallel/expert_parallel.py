"""Expert parallelism (distributed.expert_parallel: n): each group of n consecutive ranks shares out
a Mixture-of-Experts block's E experts, E/n each (rank j of the group holds experts
[j E/n, (j + 1) E/n)); every rank routes its own tokens, and the rows chosen for another rank's
experts travel there and back by all-to-all (`Exchange`, set as each MoE layer's `exchange`).

The ranks that hold the same experts, every n-th one, are their expert-data-parallel group; the
expert's gradient is the sum over that group divided by the whole world, which is the gradient of
the global batch's mean loss, since the expert's rows came from every rank of the expert-parallel
group. DeepSpeed reduces it so from what we set on each expert parameter:
- ZeRO-3 reads the group it partitions and reduce-scatters over from the parameter (its AutoEP's
  attributes: the partition group, placement family and group name);
- ZeRO-1/2 (and DeepSpeed's bf16 optimizer) reduce over a parameter's expert-data-parallel group
  the parameters marked as its MoE layers' are (`allreduce` False, `group_name`), kept in optimizer
  groups of their own (pretrain/optim/optimizer.py `expert_groups`) partitioned over that group,
  but only in an engine that found one of its own MoE layer classes: `engine_with_experts` tells it.
  Such an engine would also checkpoint the experts as those classes' files; ours are in the
  optimizer's shards like every other weight, so it saves and loads as a dense engine
  (`dense_checkpoints`), and pretrain/checkpoint/reshard.py reads the experts' groups back in order.
Written here rather than through AutoEP, which replaces the layer with its own (no
auxiliary-loss-free bias, no sequence parallelism at ZeRO-3).
"""

from __future__ import annotations

import contextlib

import torch

from pretrain.model.moe import Experts
from pretrain.parallel import distributed


class _AllToAll(torch.autograd.Function):
    """Rows (dim 0) over the group, `in_splits[r]` of them to rank r, `out_splits[r]` from it; the
    backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        return distributed.all_to_all(out, x.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(out_splits), *grad.shape[1:]))
        return distributed.all_to_all(back, grad.contiguous(), out_splits, in_splits, ctx.group), None, None, None


class Exchange:
    """An MoE layer's `exchange` under expert parallelism: this rank's rows, sorted by expert with
    counts (E,), go to the ranks holding their experts; each rank runs its experts over the rows it
    received, all sources' rows of one expert together; the outputs come back in the rows' order.
    Two all-to-alls of the rows and one of the counts per forward (their sizes read on the host)."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor, experts: torch.nn.Module) -> torch.Tensor:
        n = self.size
        local = counts.numel() // n
        received = torch.empty_like(counts)  # from rank r: its rows for each of this rank's experts
        distributed.all_to_all(received, counts, [local] * n, [local] * n, self.group)
        send = counts.view(n, local).sum(dim=1).tolist()
        received = received.view(n, local)
        sizes = received.flatten().tolist()  # (source, expert) order
        arrived = _AllToAll.apply(rows, received.sum(dim=1).tolist(), send, self.group)
        # (source, expert) -> (expert, source): each expert's rows together, as `experts` takes them
        by_expert = [r * local + e for e in range(local) for r in range(n)]
        pieces = arrived.split(sizes)
        out = experts(torch.cat([pieces[i] for i in by_expert]), received.sum(dim=0))
        pieces = dict(zip(by_expert, out.split([sizes[i] for i in by_expert])))
        out = torch.cat([pieces[i] for i in range(n * local)])
        return _AllToAll.apply(out, send, received.sum(dim=1).tolist(), self.group)


def shard_experts(model, env: distributed.Dist, zero3: bool) -> None:
    """Keep this rank's share of every MoE layer's experts (the model was built and initialised
    whole, so its weights are those of expert_parallel=1) and route through `Exchange`. Under ZeRO-3
    the share is partitioned over the expert-data-parallel group (DeepSpeed's attributes, as its
    AutoEP sets them); at ZeRO-1/2 it is marked as DeepSpeed marks its MoE layers' experts."""
    import deepspeed

    size, group = env.ep, distributed.expert_group()
    rank = env.rank % size  # (the group's consecutive ranks: distributed.init_layout checks it)
    convert = next((p.convert_to_zero_parameters for p in model.parameters()
                    if hasattr(p, "convert_to_zero_parameters")), None) if zero3 else None
    if zero3 and convert is None:
        raise RuntimeError("expert parallelism at ZeRO-3 needs the model built under deepspeed.zero.Init")
    for layer in model.moe_layers():
        whole = layer.experts
        local = layer.num_experts // size
        first = rank * local
        params = dict(whole.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values()), enabled=zero3):
            w = params["w1"]
            with torch.device(w.device):
                mine = Experts(local, w.shape[-1], w.shape[-2], whole.glu, bias=whole.b1 is not None).to(w.dtype)
            for name, p in mine.named_parameters():
                p.data.copy_(params[name].data[first:first + local])
        for p in mine.parameters():
            if zero3:
                p.ds_zero_partition_process_group = distributed.expert_data_group()
                p.ds_zero_placement_family = "autoep_expert"
                p.ds_zero_partition_group_name = distributed.expert_group_name(size)
            else:  # (deepspeed.moe.utils.is_moe_param; its experts' group name)
                p.allreduce, p.group_name = False, distributed.expert_group_name(size)
        if zero3:
            convert(param_list=list(mine.parameters()))
        layer.experts = mine
        layer.exchange = Exchange(group, size)
        del whole, params, w


def marked(model) -> bool:
    """Whether `model` has experts marked for ZeRO-1/2's expert-data-parallel reduction."""
    return any(getattr(p, "allreduce", True) is False for p in model.parameters())


@contextlib.contextmanager
def engine_with_experts(enabled: bool):
    """deepspeed.initialize inside: the engine it builds counts as one with MoE layers (DeepSpeed
    decides that by the classes of its own layers, engine.py _configure_distributed_model), so its
    ZeRO-1/2 or bf16 optimizer partitions and reduces the marked experts over their groups, and its
    model broadcast sends each rank's experts from its own group's first rank."""
    if not enabled:
        yield
        return
    from deepspeed.runtime.engine import DeepSpeedEngine

    configure = DeepSpeedEngine._configure_distributed_model

    def configure_with_experts(engine, model):
        configure(engine, model)
        engine.has_moe_layers = True

    DeepSpeedEngine._configure_distributed_model = configure_with_experts
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = configure


@contextlib.contextmanager
def dense_checkpoints(engine):
    """engine.save_checkpoint / load_checkpoint inside: an engine of `engine_with_experts` saves and
    loads as a dense one (its MoE format writes per-expert files of its own layer classes only). The
    experts are then in each rank's optimizer shard; the model states file is rank 0's, so after a
    load each rank's weights are set from its own master partition (`from_master_weights`)."""
    moe = getattr(engine, "has_moe_layers", False)
    engine.has_moe_layers = False
    try:
        yield
    finally:
        engine.has_moe_layers = moe


def from_master_weights(engine) -> None:
    """Every rank's (16-bit, or fp32) weights copied from the optimizer's fp32 master partitions and
    gathered over each group's ranks, as after an optimizer step (ZeRO-1/2, DeepSpeed's bf16
    optimizer)."""
    engine.optimizer.update_lp_params()
