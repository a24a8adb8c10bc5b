"""Muon's optimizer step: which rank orthogonalises which matrix, its FLOPs and traffic.

Muon (optimizer.name=muon) at ZeRO-3, checked on 1 and 2 CPU ranks (allocations,
the step's transient and the bytes of every collective, tests/test_estimate.py): its matrices hold
the fp32 master and one momentum in the gradients' reduction dtype instead of two Adam moments;
reduce_scatter=false (DeepSpeed's, under Muon) all-reduces (2x) the gradients of the parameters
that fit a reduce bucket, larger ones are still reduce-scattered; once per step, after backward
and not overlapped, our ZeRO-3 step (pretrain/optim/muon.py) sends each matrix's gradient and momentum
slices to its owner rank by an all-to-all, the owner orthogonalises it (Newton-Schulz, 5 steps;
FLOPs counted from DeepSpeed's iteration, at the assumed MFU; owners balance them) and a second
all-to-all returns the update and momentum slices: about 4 M c (n-1)/n^2 bytes per GPU (muon_step),
at the in-node bandwidth where the ranks fit in one node, else at the network's.
At ZeRO 0-2 each rank is counted as orthogonalising every matrix (DeepSpeed's stage-1/2 path does
those of its own partition, so an upper bound) with no step traffic; not checked there.
"""

from __future__ import annotations

import math

from pretrain.estimate.memory import block_matrices
from pretrain.model.args import ModelArgs


def muon_matrices(args: ModelArgs) -> list[list[tuple[int, ...]]]:
    """The matrices Muon steps, (fan_out, fan_in), in the order ZeRO-3 steps them: one optimizer group
    per fan-in (optim.muon_param_groups), in the order the model first has it, each group's
    matrices in the model's order (wq wk wv wo w1 w2 w3 per block). An MoE block's feed-forward is
    its router (E, D), its stacked experts (E, fan_out, fan_in) for w1, w2, w3 (each expert
    orthogonalised apart: `matrix_cost`) and its shared experts' three matrices."""
    D, H, E = args.dim, args.moe_expert_hidden_dim, args.moe_experts
    shared = args.moe_shared_experts * H
    attention = block_matrices(args)[:4]
    moe = [*attention, (E, D), (E, H, D), (E, D, H), (E, H, D), *([(shared, D), (D, shared), (shared, D)] if shared else [])]
    groups: dict[int, list] = {}
    for i in range(args.n_layers):
        for shape in (moe if args.is_moe_layer(i) else block_matrices(args)):
            groups.setdefault(shape[-1], []).append(shape)
    return list(groups.values())


def matrix_cost(shape: tuple[int, ...], method: str = "gram") -> int:
    """Newton-Schulz FLOPs of one of muon_matrices' entries: a matrix, or E stacked experts' E matrices."""
    return shape[0] * newton_schulz_flops(*shape[1:], method) if len(shape) == 3 else newton_schulz_flops(*shape, method)


def owners(costs: list[int], n: int) -> list[int]:
    """The owner rank of each matrix: largest cost first onto the least loaded rank (ties: the lower
    index, the lower rank), so that every rank computes the same assignment."""
    load, out = [0] * n, [0] * len(costs)
    for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        out[j] = min(range(n), key=lambda r: (load[r], r))
        load[out[j]] += costs[j]
    return out


def batches(order: list[int], numels: list[int], cap: int) -> list[list[int]]:
    """`order` cut into consecutive batches of at most `cap` elements (a larger matrix alone)."""
    out: list[list[int]] = []
    total = 0
    for k in order:
        if out and total + numels[k] <= cap:
            out[-1].append(k)
            total += numels[k]
        else:
            out.append([k])
            total = numels[k]
    return out


def newton_schulz_flops(m: int, k: int, method: str = "gram", steps: int = 5) -> int:
    """Matmul FLOPs of DeepSpeed's Newton-Schulz (original_muon.py) on an m x k matrix, transposed so
    that m <= k. standard: per step X X^T (2 m^2 k), A A (2 m^3), B X (2 m^2 k). gram (the default):
    on the m x m Gram matrix R = X X^T, restarted at step 2 (X = Q X, R = X X^T); per step Z = b R +
    c R R and Q = a Q + Z Q (none at the first step and the restart), R updated by two products
    except after the last step and before the restart; Q X at the end: 8 m^2 k + 28 m^3 at 5 steps.
    A square matrix takes the standard iteration under gram too."""
    m, k = min(m, k), max(m, k)
    if method == "standard" or m == k:
        return steps * (4 * m * m * k + 2 * m**3)
    restart = 2 if steps > 2 else None
    flops = 2 * m * m * k  # R = X X^T
    for i in range(steps):
        if i == restart:
            flops += 4 * m * m * k  # X = Q X, R = X X^T
        flops += 2 * m**3 + (0 if i in (0, restart) else 2 * m**3)  # Z; Q = a Q + Z Q
        if i < steps - 1 and i + 1 != restart:
            flops += 4 * m**3  # R = a (a R + Z R) + Z (a R + Z R)
    return flops + 2 * m * m * k  # Q X


def muon_step(args: ModelArgs, stage: int, world: int, bucket: int, c: int, method: str = "gram",
              ep: int = 1) -> dict:
    """Muon's optimizer step per GPU, `c` the bytes of its communication dtype (the gradients'
    reduction dtype). At ZeRO-3 ours (pretrain/optim/muon.py, replacing DeepSpeed's round robin per
    bucket), checked on 1 and 2 CPU ranks (tests/test_estimate.py): every matrix has one owner
    (`owners`: largest Newton-Schulz work first onto the least loaded rank), which receives the
    other ranks' partition slices of its gradient and momentum (ceil(numel / n) elements each) by an
    all-to-all, orthogonalises it and sends the slices of the update and the momentum back; matrices
    taken in batches of up to n x bucket elements (`batches`):
    - "flops": Newton-Schulz FLOPs of the busiest rank, "flops_total" over all ranks;
    - "comm": bytes the busiest rank sends (as many as it receives): 2 c per slice, one slice per
      matrix it does not own, n - 1 slices back per matrix it owns, about 4 M c (n-1)/n^2 in all;
    - "transient": the largest batch's send and receive buffers, the full gradient, momentum and
      padded copy of the largest matrix a rank owns there and about 3 matrices of temporaries in
      muon_update, plus the momentum partitions parallelize.muon_at_zero3 copies (M / n); left
      out: muon_update's Newton-Schulz matrices in half precision and the m x m Gram matrices.
    At stage 0 (fp32, no ZeRO) every rank orthogonalises every matrix and sends nothing.
    Under expert parallelism (`ep`, ZeRO-3) the step runs per partition group, one after the other
    (pretrain/optim/muon.py): the dense matrices over the `world`, each rank's E/ep experts of every
    stacked tensor over the world/ep ranks that hold them; the busiest rank's FLOPs, bytes and
    transient are those of the two groups added (an upper bound: not every rank is busiest in both).
    "params" counts every expert (the states over the world are those of ep = 1)."""
    flat = [s for g in muon_matrices(args) for s in g]
    total = sum(math.prod(s) for s in flat)
    if ep > 1 and stage == 3:
        dense = _step([s for s in flat if len(s) == 2], world, bucket, c, method)
        experts = _step([(s[0] // ep, *s[1:]) for s in flat if len(s) == 3], world // ep, bucket, c, method)
        return {"params": total, "flops_total": dense["flops_total"] + ep * experts["flops_total"],
                **{k: dense[k] + experts[k] for k in ("flops", "comm", "transient")}}
    return {**_step(flat, world if stage == 3 else 1, bucket, c, method, zero3=stage == 3), "params": total}


def _step(flat: list[tuple[int, ...]], n: int, bucket: int, c: int, method: str, zero3: bool = True) -> dict:
    """muon_step for the matrices `flat` partitioned over n ranks (zero3=False: no ZeRO-3 step)."""
    numels = [math.prod(s) for s in flat]
    n_muon = sum(numels)
    costs = [matrix_cost(s, method) for s in flat]
    out = {"params": n_muon, "flops_total": sum(costs), "flops": 0, "comm": 0.0}
    if not flat:
        return {**out, "transient": 0.0}
    if not zero3:
        return {**out, "flops": out["flops_total"], "transient": c * 3 * max(numels)}
    parts = [-(-x // n) for x in numels]
    owner = owners(costs, n)
    load, sent, transient = [0] * n, [0] * n, 0.0
    for j, r in enumerate(owner):
        load[r] += costs[j]
        for q in range(n):
            sent[q] += 2 * parts[j] * c * ((n - 1) if q == r else 1) if n > 1 else 0
    for batch in batches(sorted(range(len(flat)), key=lambda j: (-costs[j], j)), numels, n * bucket):
        send = 2 * sum(parts[j] for j in batch)
        for r in range(n):
            own = [j for j in batch if owner[j] == r]
            if own:
                big = max(numels[j] for j in own)
                transient = max(transient, c * (send + 2 * n * sum(parts[j] for j in own) + 5 * big + n * -(-big // n)))
    return {**out, "flops": max(load), "comm": float(max(sent)), "transient": transient + c * n_muon / n}
