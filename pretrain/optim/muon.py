"""Muon's step at ZeRO-3, spread over the ranks (in place of DeepSpeed 0.19.8's
`_apply_muon_to_accumulated_grads`, which parallelize.muon_at_zero3 replaces with `zero3_step`).

DeepSpeed all-gathers each bucket's gradients and momenta to every rank, shares the bucket's matrices
round robin over the ranks and all-gathers the updates and momenta as n padded slots of each round's
largest matrix: at its default bucket (D^2) a bucket holds one matrix, so rank 0 orthogonalises
nearly all of them and each rank moves 2 (n-1) times every matrix. Here every Muon matrix of the
model has one owner (estimate.owners: largest Newton-Schulz work first, onto the least loaded rank, the same
on every rank); one all-to-all sends each rank's partition slices of the gradient and the momentum to
the owner, which runs DeepSpeed's own `muon_update` on the full matrix, and a second sends the slices
of the update and the new momentum back. Per rank each direction moves 2 c / n of a matrix's
elements per matrix it does not own, 2 c (n-1)/n of each it owns: about 4 M c (n-1)/n^2 bytes sent
(and as many received) per step, M the Muon parameters, c the bytes of DeepSpeed's
communication_data_type (pretrain/estimate/muon.py muon_step)."""
from __future__ import annotations

import torch

from pretrain.parallel import distributed
from pretrain.estimate.muon import batches, newton_schulz_flops, owners  # (the cost model's assignment, run here)


def matrix_flops(shape, num_heads=None, method: str = "gram", experts: bool = False) -> int:
    """Newton-Schulz FLOPs of DeepSpeed's iteration on a matrix (per head with num_heads; per expert
    of a stacked (E, out, in) tensor with `experts`)."""
    if experts:
        return shape[0] * newton_schulz_flops(shape[1], shape[2], method)
    m = shape[0]
    k = torch.Size(shape).numel() // m  # (a conv filter is viewed as 2D, as muon_update does)
    return num_heads * newton_schulz_flops(m // num_heads, k, method) if num_heads else newton_schulz_flops(m, k, method)


def zero3_step(zero, plan: dict) -> None:
    """Muon's step for every Muon sub-group of DeepSpeed's stage-3 optimizer `zero`: each rank's
    gradient partitions end holding its slice of the Muon update (the inner MuonWithAuxAdam step then
    applies p -= lr (update + wd p)), its momentum partitions the new momentum, as after DeepSpeed's
    step. `plan` caches the owners and batches between steps."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    if not zero.use_muon:
        return
    dtype = zero.communication_data_type
    # (sub-group, index in it, parameter), by the process group the sub-group is partitioned over:
    # the world, and under expert parallelism each rank's expert-data-parallel group for its experts
    # (the same structure on every rank, so the collectives of each group line up)
    by_group: dict[int, tuple] = {}
    for i, group in enumerate(zero.fp16_groups):
        if not zero.sub_groups_using_muon[i] or not group:
            continue
        # An update does not carry the loss scale a gradient does: step() scales the norm back.
        zero.sub_groups_lacking_loss_scale.add(i)
        flat = zero.fp32_partitioned_groups_flat[i]
        if "momentum_buffer" not in zero.optimizer.state.get(flat, {}):  # (DeepSpeed's, on the first step)
            zero._create_momentum_buffer(zero.fp16_partitioned_groups_flat_numel[i], i, flat.ds_id)
        pg = zero._get_sub_group_process_group(i)
        by_group.setdefault(id(pg), (pg, []))[1].extend((i, j, p) for j, p in enumerate(group))
    for key, (pg, items) in enumerate(by_group.values()):
        _group_step(zero, items, pg, plan.setdefault(key, {}), dtype, muon_update, dist)


def _group_step(zero, items, pg, plan: dict, dtype, muon_update, dist) -> None:
    """zero3_step for the Muon parameters partitioned over process group `pg`."""
    n, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if not plan:
        numels = [p.ds_numel for _, _, p in items]
        method = getattr(zero, "muon_ns_method", None) or "gram"
        costs = [matrix_flops(p.ds_shape, getattr(p, "muon_num_heads", None), method, getattr(p, "is_expert_group", False))
                 for _, _, p in items]
        owner = owners(costs, n)
        order = sorted(range(len(items)), key=lambda k: (-costs[k], k))
        plan.update(owner=owner, batches=batches(order, numels, n * zero.reduce_bucket_size))
    owner = plan["owner"]
    with torch.no_grad():
        for batch in plan["batches"]:
            _batch(zero, [items[k] for k in batch], [owner[k] for k in batch], n, rank, pg, dtype, muon_update, dist)


def _batch(zero, items, owner, n, rank, pg, dtype, muon_update, dist) -> None:
    order = sorted(range(len(items)), key=lambda k: owner[k])  # by owner, then the batch's order
    parts = [p.partition_numel() for _, _, p in items]
    splits = [0] * n
    for k in range(len(items)):
        splits[owner[k]] += 2 * parts[k]
    mine = [k for k in order if owner[k] == rank]
    width = splits[rank]
    send = torch.empty(sum(splits), dtype=dtype, device=zero.averaged_gradients[items[0][0]][0].device)

    def momentum(k):
        i, _, p = items[k]
        offset = zero.grad_position[zero.get_param_id(p)][1]
        return zero.optimizer.state[zero.fp32_partitioned_groups_flat[i]]["momentum_buffer"].narrow(0, offset, parts[k])

    o = 0
    for k in order:  # this rank's slices of the gradients and the momenta, to their owners
        i, j, _ = items[k]
        send[o:o + parts[k]].copy_(zero.averaged_gradients[i][j])
        send[o + parts[k]:o + 2 * parts[k]].copy_(momentum(k))
        o += 2 * parts[k]
    recv = torch.empty(n * width, dtype=dtype, device=send.device)
    distributed.all_to_all(recv, send, [width] * n, splits, group=pg)  # (at n = 1 a copy)
    slots = recv.view(n, width)  # row r: rank r's slices of the matrices this rank owns
    o = 0
    for k in mine:
        _, _, p = items[k]
        pn, numel = parts[k], p.ds_numel
        grad = slots[:, o:o + pn].reshape(-1)[:numel].view(p.ds_shape)
        mom = slots[:, o + pn:o + 2 * pn].reshape(-1)[:numel].view(p.ds_shape)
        update = muon_update(grad, mom, beta=zero.muon_beta, ns_method=getattr(zero, "muon_ns_method", None) or "gram",
                             num_heads=getattr(p, "muon_num_heads", None),
                             is_expert_group=getattr(p, "is_expert_group", False))  # (each expert apart)
        for x, at in ((update, o), (mom, o + pn)):  # padded with zeros past the matrix, as DeepSpeed's momentum
            padded = torch.zeros(n * pn, dtype=dtype, device=recv.device)
            padded[:numel].copy_(x.reshape(-1))
            slots[:, at:at + pn].copy_(padded.view(n, pn))
        o += 2 * pn
    distributed.all_to_all(send, recv, splits, [width] * n, group=pg)
    o = 0
    for k in order:  # this rank's slices of the updates and the new momenta
        i, j, p = items[k]
        pn = parts[k]
        valid = max(0, min(pn, p.ds_numel - rank * pn))
        if valid:
            zero.averaged_gradients[i][j].narrow(0, 0, valid).copy_(send[o:o + valid])
        momentum(k).copy_(send[o + pn:o + 2 * pn])
        o += 2 * pn

