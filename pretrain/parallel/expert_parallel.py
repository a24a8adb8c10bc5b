"""Expert parallelism (distributed.expert_parallel: n): each group of n consecutive ranks shares out
a Mixture-of-Experts block's E experts, E/n each (rank j of the group holds experts
[j E/n, (j + 1) E/n)); every rank routes its own tokens, and the rows chosen for another rank's
experts travel there and back by all-to-all (`Exchange`, set as each MoE layer's `exchange`).

Under ZeRO-3 (the only stage it runs at: config.moe_problems) each expert's weights are
partitioned over the ranks that hold it, its expert-data-parallel group (every n-th rank), and
gathered there only: a rank never gathers another group's experts. DeepSpeed's ZeRO-3 reads that
from each parameter (the group it was converted with, its placement family and group name, as its
AutoEP sets them): it reduce-scatters an expert's gradient over that group and divides by the whole
world, which is the gradient of the global batch's mean loss, since the expert's rows came from
every rank of the expert-parallel group. Written here rather than through AutoEP, which replaces
the layer with its own (no auxiliary-loss-free bias, no sequence parallelism at ZeRO-3).
"""

from __future__ import annotations

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
    AutoEP sets them)."""
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
                mine = Experts(local, w.shape[-1], w.shape[-2]).to(w.dtype)
            for name, p in mine.named_parameters():
                p.data.copy_(params[name].data[first:first + local])
        if zero3:
            for p in mine.parameters():
                p.ds_zero_partition_process_group = distributed.expert_data_group()
                p.ds_zero_placement_family = "autoep_expert"
                p.ds_zero_partition_group_name = distributed.expert_group_name(size)
            convert(param_list=list(mine.parameters()))
        layer.experts = mine
        layer.exchange = Exchange(group, size)
        del whole, params, w
