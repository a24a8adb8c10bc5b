"""Communication per GPU of a run, as DeepSpeed and AutoTP run it.

Communication per GPU per step (ring collectives move (n-1)/n of the data through each GPU; an
all-reduce twice that), as DeepSpeed 0.19 runs ZeRO, counted on 2 and 4 CPU ranks with
pretrain/parallel/traffic.py (bench/bench_comm.py, docs/performance.md; within 0.01% of these figures):
stage 0 all-reduces the gradients once per step: 2 psi; stage 1 the same, and all-gathers the
updated weights once: 2 psi + psi; stage 2 all-reduces the gradients every micro-batch (DeepSpeed's
use_multi_rank_bucket_allreduce, on by default: buckets are all-reduced, not reduce-scattered) and
gathers the weights once: 2 k psi + psi; stage 3 reduce-scatters the gradients every micro-batch
(k psi) and all-gathers in each micro-batch's forward every parameter above the persistence
threshold, in its backward again only those released after forward (zero3_gathered:
DeepSpeed keeps a parameter gathered while it is used again within stage3_max_reuse_distance,
1e9 elements by default, so a model of up to about half that gathers once per micro-batch, not
twice; a 7B model re-gathers all but its last blocks), and the persistent ones once after the step.
psi = (n-1)/n x parameters x bytes, k the micro-batches per GPU per step, the bytes those of the
weights for gathers and of distributed.grad_dtype for gradients (fp32 by default under bf16). The
formula this replaces (3 k psi at stage 3, 2 psi at stage 1, (k + 1) psi at stage 2) counted two
gathers per micro-batch where the tiny model does one, half the bytes of stage 2's all-reduces, and
no weight gather at stage 1. With communication overlapped with compute (DeepSpeed's overlap_comm)
a step takes about the longer of the two; where communication is longer, more GPUs stop paying.
Traffic among the GPUs of one node runs at the in-node bandwidth (Assumptions.sp_gbps, NVLink),
among more at the network's (Assumptions.gbps, per GPU), the two added. Under hpZ the first forward
gathers of a step read the primary partition across nodes and build the secondary; the step's
other gathers (the later micro-batches' forwards, the backward re-gathers) stay in the node
(DeepSpeed drops the secondary at the optimizer step); the reduce-scatters still cross.
Under tensor parallelism ZeRO's psi counts a rank's parameters over the n/t ranks of its slice
(zero3_gathered over the rank's 1/t of each block matrix), and each GPU runs t times the
micro-batches (its group shares each), so at a fixed micro-batch size the block matrices' traffic
per GPU per step is what ZeRO over n moves, and the embedding's and head's is t times it: TP's
gain under ZeRO-3 is activation memory (a larger micro-batch), not traffic.

Tensor parallelism's own all-reduces, per GPU per block per micro-batch, as DeepSpeed's AutoTP runs
them (counted on 2 CPU ranks with pretrain/parallel/traffic.py, tests/test_traffic.py): 2 in forward (the
outputs of the row-split wo and w2), 5 in backward (each column-split layer, wq, wk, wv, w1 and w3,
all-reduces its own input gradient; Megatron's fused layers need 2) and 1 in a checkpointed block's
recomputation (wo's: torch's checkpoint stops recomputing before w2, whose input is the last
tensor backward needs), each 2 (t-1)/t of the micro-batch's b T D activations in p bytes, at the
in-node bandwidth, between a block's matmuls: added to the step. The head, whole on every rank of
a group, is computed t times: each GPU's compute is (FLOPs + (t-1) 6 V D per token) x tokens / n.

Expert parallelism (distributed.expert_parallel: e, a Mixture-of-Experts): each expert's weights
are ZeRO-3-partitioned over the W/e ranks that hold it, so a rank gathers and reduce-scatters only
its E/e experts, over that group (expert_traffic); without it every rank gathers every expert.
The tokens travel instead: per MoE block per micro-batch the rows chosen for other ranks' experts
(k per token) go there and their outputs come back, (e-1)/e of the k x tokens x D activations in p
bytes each way (expert_exchange_bytes); backward sends their gradients, the same bytes; a
checkpointed block's recomputation repeats the forward's. Between a block's computations, like
Ulysses': added to the step.

Ulysses' all-to-alls, per GPU per layer per micro-batch: forward sends (N-1)/N of the rank's
q, k, v (k and v r times) and of the attention output, T/N tokens each; backward sends their
gradients, the same bytes; a checkpointed block's recomputation repeats the forward's. They run
between a layer's computations, so their time (at Assumptions.sp_gbps, NVLink within a node) is
added to the step's.
"""

from __future__ import annotations

from pretrain.estimate.memory import block_matrices, kv_replication
from pretrain.model.args import ModelArgs


def sequence_exchange_bytes(args: ModelArgs, tokens: int, p: int, sp: int) -> float:
    """Bytes each rank sends in the all-to-alls of one layer's forward under Ulysses sequence
    parallelism over `sp` ranks, for one micro-batch of `tokens` tokens (whole sequences): queries,
    keys and values in (keys and values replicated r times where kv_heads < sp) and the output back,
    4 exchanges of the rank's tokens / sp tokens, of which each keeps 1/sp and sends the rest.
    Backward exchanges the gradients of the same tensors: the same bytes again; a checkpointed
    block repeats its forward's in the recomputation."""
    if sp <= 1:
        return 0.0
    r = kv_replication(args.kv_heads, sp)
    heads = 2 * args.n_heads + 2 * args.kv_heads * r  # q, output; k, v
    return (sp - 1) / sp * (tokens / sp) * heads * args.head_dim * p


def expert_exchange_bytes(args: ModelArgs, tokens: int, p: int, ep: int) -> float:
    """Bytes each rank sends in one MoE block's forward under expert parallelism over `ep` ranks,
    for `tokens` tokens of its own: the k rows per token to their experts and the outputs back,
    (ep-1)/ep of them on other ranks when the routing is balanced (pretrain/parallel/expert_parallel.py)."""
    if ep <= 1:
        return 0.0
    return 2 * (ep - 1) / ep * tokens * args.moe_top_k * args.dim * p


def expert_params(args: ModelArgs) -> int:
    """The routed experts' weights of every MoE block: what expert parallelism shares out."""
    return args.moe_layers * 3 * args.moe_experts * args.moe_expert_hidden_dim * args.dim


# AutoTP's all-reduces per block per micro-batch: forward (wo, w2), backward (the input gradients of
# wq, wk, wv, w1, w3, one each) and a checkpointed block's recomputation (wo; not w2, tensor_parallel_bytes).
TP_ALLREDUCES = {"forward": 2, "backward": 5, "recomputation": 1}


def tensor_parallel_bytes(args: ModelArgs, tokens: int, p: int, tp: int) -> float:
    """Bytes through each GPU for one all-reduce of `tokens` x D activations or their gradients in
    p bytes over a tensor-parallel group of `tp` ranks, ring: 2 (tp-1)/tp of them. A block runs
    TP_ALLREDUCES of them, as counted (pretrain/parallel/traffic.py): 2 in forward (wo's and w2's outputs,
    row-split), 5 in backward (AutoTP's column-split wq, wk, wv, w1 and w3 each all-reduce their
    input's gradient) and 1 in a checkpointed block's recomputation (wo's; torch's checkpoint stops
    once it has recomputed the last tensor backward needs, w2's input, so w2 does not run again)."""
    return 2 * (tp - 1) / tp * tokens * args.dim * p if tp > 1 else 0.0


def zero_traffic(n_params: int, stage: int, world: int, micro_steps: int, p: int, g: int, node: int,
                 hpz: bool, gathered: float | None = None, persistent: int = 0) -> tuple[float, float]:
    """ZeRO's bytes per GPU per step (comm_bytes) split into (within a node, across nodes) for
    ranks on nodes of `node` GPUs: all within when the ranks fit in one node, all across otherwise
    (a ring over several nodes runs at the network's bandwidth), except under hpZ (ZeRO-3): the
    first micro-batch's forward gathers read the primary partition, over every rank, and build the
    secondary one within the node, which serves every later gather of the step (DeepSpeed
    invalidates it at the optimizer step); those, and the gradients' reduce-scatter, cross."""
    total = comm_bytes(n_params, stage, world, micro_steps, p, g, gathered, persistent)
    if world <= node:
        return total, 0.0
    if not (hpz and stage == 3):
        return 0.0, total
    gathered = 2 * n_params if gathered is None else gathered
    across = total - (world - 1) / world * micro_steps * gathered * p  # (the reduce-scatters, the persistent)
    across += (world - 1) / world * (n_params - persistent) * p  # the first forward's gathers
    in_node = (node - 1) / node * (micro_steps * gathered - (n_params - persistent)) * p
    return in_node, across


def allreduced_params(args: ModelArgs, bucket: int) -> int:
    """Parameters whose gradients ZeRO-3 all-reduces rather than reduce-scatters under
    reduce_scatter=false (Muon): those that fit its reduce bucket (stage3.py:1673); a larger one
    is reduced alone, and still reduce-scattered."""
    D = args.dim
    block = [m * k for m, k in block_matrices(args)] + [D, D]  # (and the two norms)
    sizes = block * args.n_layers + [D, args.vocab_size * D] + ([] if args.tie_embeddings else [args.vocab_size * D])
    return sum(x for x in sizes if x <= bucket)


def comm_volume(n_params: int, stage: int, world: int, micro_steps: int, p: int, g: int | None = None,
                gathered: float | None = None, persistent: int = 0) -> dict:
    """Bytes through each GPU per optimizer step of ZeRO's collectives, by kind (none alone): weights
    of p bytes, gradients reduced in g bytes (default p), k = micro_steps, psi = (n-1)/n x
    parameters. As DeepSpeed 0.19 runs them, counted on 2 and 4 CPU ranks (pretrain/parallel/traffic.py,
    bench/bench_comm.py):
    - stage 0: the gradients all-reduced once per step (2 psi g);
    - stage 1 (DeepSpeed's ZeRO optimizer and BF16_Optimizer alike): the same, plus the updated
      weights all-gathered once (psi p);
    - stage 2: the gradients all-reduced every micro-batch, not reduce-scattered (DeepSpeed's
      use_multi_rank_bucket_allreduce, on by default, all-reduces each bucket): 2 k psi g, plus the
      weights once (psi p);
    - stage 3: the gradients reduce-scattered every micro-batch (k psi g); per micro-batch the
      `gathered` parameters all-gathered in forward and backward (default 2 x parameters:
      zero3_gathered counts what DeepSpeed keeps between them), and the `persistent` ones
      (under stage3_param_persistence_threshold, never gathered in forward) all-gathered once
      after the step."""
    if world == 1:
        return {}
    g = p if g is None else g
    psi = (world - 1) / world * n_params
    if stage == 3:
        gathered = 2 * n_params if gathered is None else gathered
        return {"all_gather": (world - 1) / world * (micro_steps * gathered + persistent) * p,
                "reduce_scatter": micro_steps * psi * g}
    reduces = micro_steps if stage == 2 else 1
    return {"all_reduce": 2 * reduces * psi * g, **({"all_gather": psi * p} if stage > 0 else {})}


def comm_bytes(n_params: int, stage: int, world: int, micro_steps: int, p: int, g: int | None = None,
               gathered: float | None = None, persistent: int = 0) -> float:
    """Bytes through each GPU per optimizer step for ZeRO's collectives (0 alone): comm_volume's sum."""
    return sum(comm_volume(n_params, stage, world, micro_steps, p, g, gathered, persistent).values())


def zero3_trace(args: ModelArgs, tp: int = 1, ep: int = 1) -> list[tuple[str, int]]:
    """The modules ZeRO-3 fetches parameters for in one micro-batch, in order, each as (its
    parameter, elements; a rank's 1/tp of the block matrices under tensor parallelism): forward
    (the embedding, each block's norms and matrices in the order they run, the final norm, the
    head), then backward in reverse. A tied head is the embedding's parameter. A checkpointed
    block's recomputation adds no fetch of its own: it gathers what its backward then uses
    (counted: the same bytes with and without activation checkpointing). An MoE block's
    feed-forward is its router, its stacked experts (a rank's E/ep under expert parallelism; named
    `experts.*`) and its shared experts."""
    D, V = args.dim, args.vocab_size
    wq, wk, wv, wo, w1, w2, w3 = (m * k // tp for m, k in block_matrices(args))
    attention = [("attention_norm", D), ("wq", wq), ("wk", wk), ("wv", wv), ("wo", wo), ("ffn_norm", D)]
    dense = [("w1", w1), ("w3", w3), ("w2", w2)]
    H, E = args.moe_expert_hidden_dim, args.moe_experts
    shared = args.moe_shared_experts * H * D
    moe = [("router", E * D), *((f"experts.{w}", E // ep * H * D) for w in ("w1", "w2", "w3")),
           *((f"shared.{w}", shared) for w in ("w1", "w3", "w2") if shared)]
    blocks = [(f"layers.{i}.{name}", n) for i in range(args.n_layers)
              for name, n in attention + (moe if args.is_moe_layer(i) else dense)]
    forward = [("tok_embeddings", V * D), *blocks, ("norm", D), ("tok_embeddings" if args.tie_embeddings else "output", V * D)]
    return forward + forward[::-1]


def zero3_gathered(args: ModelArgs, persistence: int, reuse_distance: float = 1e9, tp: int = 1, ep: int = 1) -> dict:
    """Parameters ZeRO-3 all-gathers per micro-batch ("gathered") and those it keeps whole
    ("persistent", at most `persistence` elements each: stage3_param_persistence_threshold), by
    DeepSpeed's rule once it has traced a step (partitioned_param_coordinator.py,
    __params_to_release): after a module runs, its parameters are released unless the modules
    that follow, up to `reuse_distance` elements of their parameters (stage3_max_reuse_distance,
    DeepSpeed's default 1e9), use them again.

    A model within that distance keeps every parameter from forward to backward and gathers each
    once per micro-batch, not twice (the tiny model, counted: bench/bench_comm.py). Beyond it the
    backward re-gathers are an upper bound: DeepSpeed also keeps parameters its prefetcher has
    marked for a later use, which this rule does not follow (the tiny model at reuse distance 0
    kept the head and the last 2 of its 4 blocks: 25% fewer gather bytes than this bound). The
    first step, which traces, gathers everything in backward again."""
    trace = zero3_trace(args, tp, ep)
    persistent = sum(n for n in dict(trace).values() if n <= persistence)
    return {"gathered": sum(_gathers(trace, persistence, reuse_distance).values()), "persistent": persistent}


def zero3_expert_gathers(args: ModelArgs, persistence: int, reuse_distance: float = 1e9, ep: int = 1) -> int:
    """The part of zero3_gathered's "gathered" that is a rank's routed experts (E/ep of each MoE
    block's): under expert parallelism gathered over their own group (expert_traffic)."""
    gathers = _gathers(zero3_trace(args, 1, ep), persistence, reuse_distance)
    return sum(n for name, n in gathers.items() if ".experts." in name)


def _gathers(trace: list[tuple[str, int]], persistence: int, reuse_distance: float) -> dict[str, int]:
    """Elements all-gathered per micro-batch, by parameter, by DeepSpeed's release rule (zero3_gathered)."""
    gathered, live = {}, set()
    for s, (name, n) in enumerate(trace):
        if n <= persistence:
            continue
        if name not in live:
            gathered[name] = gathered.get(name, 0) + n
            live.add(name)
        traversed = 0
        for later, m in trace[s + 1:]:
            if traversed >= reuse_distance:
                live.discard(name)
                break
            if later == name:
                break
            traversed += m
        else:
            live.discard(name)
    return gathered
