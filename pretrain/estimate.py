"""`pretrain estimate CONFIG [overrides] --gpus N`: what a run will need before it is launched.

Parameters and FLOPs per token (the trainer's own PaLM formula), memory per GPU by part, tokens per
step, step and total time at an assumed MFU, and for planning past one machine the ZeRO
communication per step and its time at an interconnect bandwidth, over a range of GPU counts,
over the sequence-parallel sizes the model allows (which one a sequence length needs to fit), and
over the layouts of the run's GPUs: ZeRO alone, ZeRO-3 with hpZ, tensor parallelism within a node
with ZeRO across, at the configured sequence_parallel, each checked against the config's own
validation (Config.problems); the fastest that fits is recommended (parallel_options). A run whose
global batch does not split over its GPUs as configured gets the layouts that do, not a refusal.

The memory model (bytes, per GPU, n GPUs), what DeepSpeed 0.19 allocates for each setup (measured
on CPU by counting the tensors alive; docs/performance.md compares it with DeepSpeed's estimators):
- model states, mixed precision (p = 2: bf16 or fp16 weights; fp32 master weights and Adam moments,
  12 bytes, divided over the n GPUs from stage 1 on):
  stage 0 and 1 in bf16 with fp32 gradients (the default; bf16 stage 0 runs as stage 1) is
  DeepSpeed's BF16_Optimizer: the bf16 gradients and an fp32 accumulation buffer for all of them
  stay whole on every GPU: 2 + 2 + 4 + 12/n. Stages 1 and 2 otherwise (ZeRO's optimizer): 2 + 18/n,
  the gradients reduced into a 16-bit and an fp32 partition (DeepSpeed's own figure). Stage 3:
  (2 + a + 12)/n, a the bytes of the gradient accumulation (and reduction) dtype, plus the largest
  module gathered whole: its 16-bit weights and gradient, and that gradient cast to fp32 for the
  reduce-scatter when it is reduced in fp32: 4 (+ 4) bytes per parameter of it. In fp32 the weights
  and gradients take 4 bytes; stage 0 keeps no master copy. Not counted: parameters ZeRO-3 keeps
  gathered between forward and backward because they are used again within
  stage3_max_reuse_distance (DeepSpeed's default, 1e9, can hold a few blocks of a 7B model).
- activations: what autograd saves for backward, per token per transformer block, counted from this
  model's code and checked against torch's saved-tensor hooks (tests/test_estimate.py):
  (8 + 6p) D + 2p KVd + 4p F + 4 H bytes, p the bytes of the training dtype, D the width, KVd the
  key/value width, F the SwiGLU width, H the heads (flash attention: no T^2 term). A block under
  activation checkpointing keeps p D (its input), and one block's activations live again during
  its recomputation. The head keeps (4.5 + 2p) D + 28 bytes per token, plus the fp32
  log-probabilities (4 V) when the loss is one chunk; the loss chunk's logits are the transient peak.
  Under Ulysses sequence parallelism over N GPUs (distributed.sequence_parallel) every figure is per
  token of the rank's T/N tokens: attention's own tensors are for all T tokens over H/N heads, the
  same bytes, with K and V r times (r = kv_replication: KV heads repeated where they are fewer than
  N); the output exchanged back is a second copy, p D, and the RoPE rows of the slice's positions
  4 head_dim once. The exchange's send and receive buffers (2 p D per token) add to the transient.
  (Checked per rank on 2 real ranks, tests/test_estimate.py.)
- DeepSpeed's buffers: the all-reduce of stage 0 and of BF16_Optimizer flattens buckets of up to
  5e8 gradients into a copy; stages 1-3 reduce through a bucket, and ZeRO-3 prefetches weights into
  another.
- tensor parallelism over t GPUs of a node (distributed.tensor_parallel, AutoTP): each rank holds
  1/t of every block matrix (wq wk wv w1 w3 split by columns, wo w2 by rows) and the embedding,
  head and norms whole, and ZeRO shards what it holds over the n/t ranks holding the same slice:
  the block matrices' states per GPU are what ZeRO over n gives, the rest's t times that. The
  largest module gathered is 1/t of a block matrix or the whole embedding or head. Activations
  (Korthikanti et al. 2022, tensor parallelism without sequence parallelism): a block's norms and
  input, (8 + 4p) D, whole on every rank; (2p D + 2p KVd + 4 H + 4p F) / t; the head's whole.
- hpZ (distributed.hpz, ZeRO-3): a secondary copy of the 16-bit weights partitioned over the
  node's GPUs, p x parameters / gpus_per_node.
  The memory of these two is modelled, not yet checked against a run; their communication below
  is counted on CPU ranks.
A row over the GPU's memory (Assumptions.gpu_memory_gib: 80 GiB) is marked as not fitting.

Communication per GPU per step (ring collectives move (n-1)/n of the data through each GPU; an
all-reduce twice that), as DeepSpeed 0.19 runs ZeRO, counted on 2 and 4 CPU ranks with
pretrain/traffic.py (bench/bench_comm.py, docs/performance.md; within 0.01% of these figures):
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
them (counted on 2 CPU ranks with pretrain/traffic.py, tests/test_traffic.py): 2 in forward (the
outputs of the row-split wo and w2), 5 in backward (each column-split layer, wq, wk, wv, w1 and w3,
all-reduces its own input gradient; Megatron's fused layers need 2) and 1 in a checkpointed block's
recomputation (wo's: torch's checkpoint stops recomputing before w2, whose input is the last
tensor backward needs), each 2 (t-1)/t of the micro-batch's b T D activations in p bytes, at the
in-node bandwidth, between a block's matmuls: added to the step. The head, whole on every rank of
a group, is computed t times: each GPU's compute is (FLOPs + (t-1) 6 V D per token) x tokens / n.

Muon (optimizer.name=muon) at ZeRO-3, checked on 1 and 2 CPU ranks (allocations,
the step's transient and the bytes of every collective, tests/test_estimate.py): its matrices hold
the fp32 master and one momentum in the gradients' reduction dtype instead of two Adam moments;
reduce_scatter=false (DeepSpeed's, under Muon) all-reduces (2x) the gradients of the parameters
that fit a reduce bucket, larger ones are still reduce-scattered; once per step, after backward
and not overlapped, our ZeRO-3 step (pretrain/muon.py) sends each matrix's gradient and momentum
slices to its owner rank by an all-to-all, the owner orthogonalises it (Newton-Schulz, 5 steps;
FLOPs counted from DeepSpeed's iteration, at the assumed MFU; owners balance them) and a second
all-to-all returns the update and momentum slices: about 4 M c (n-1)/n^2 bytes per GPU (muon_step),
at the in-node bandwidth where the ranks fit in one node, else at the network's.
At ZeRO 0-2 each rank is counted as orthogonalising every matrix (DeepSpeed's stage-1/2 path does
those of its own partition, so an upper bound) with no step traffic; not checked there.

Ulysses' all-to-alls, per GPU per layer per micro-batch: forward sends (N-1)/N of the rank's
q, k, v (k and v r times) and of the attention output, T/N tokens each; backward sends their
gradients, the same bytes; a checkpointed block's recomputation repeats the forward's. They run
between a layer's computations, so their time (at Assumptions.sp_gbps, NVLink within a node) is
added to the step's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pretrain.config import Config, zero_sizes
from pretrain.errors import ConfigError
from pretrain.model.args import ModelArgs
from pretrain.model.model import LOSS_CHUNK_BYTES, flops_per_token, num_params

GIB = 2**30


def _checkpointed(args: ModelArgs, ac_every: int) -> int:
    """Blocks under activation checkpointing (parallelize.apply_activation_checkpointing)."""
    return len(range(0, args.n_layers, ac_every)) if ac_every else 0


def kv_replication(n_kv_heads: int, size: int) -> int:
    """How many times each KV head is repeated before the exchange over `size` ranks."""
    return size // math.gcd(n_kv_heads, size)


def activation_bytes(args: ModelArgs, tokens: int, p: int, ac_every: int, loss_chunk: int = 0,
                     sp: int = 1, mlp_chunk: int = 0, tp: int = 1) -> dict:
    """Activation memory of one micro-batch of `tokens` tokens (its whole sequences) in dtype of `p`
    bytes, per rank of a sequence-parallel group of `sp`: what autograd keeps for backward ("saved")
    and the largest transient on top of it ("peak_extra").

    Under Ulysses sequence parallelism each rank holds tokens / sp of them, so every per-token part
    divides by sp; attention's own saved tensors are for all tokens over n_heads / sp heads, which
    is the same bytes (keys and values times the KV replication r where kv_heads < sp); the output
    exchanged back is a copy of its own that `wo` keeps (p D per token), and the rows of the RoPE
    table at the slice's positions another (4 head_dim, once).

    MLP tiles (`mlp_chunk`, train.mlp_chunk_tokens, fewer than the rank's tokens) keep none of the
    MLP's four (tokens, hidden_dim) intermediates for backward; one tile's exist while it is
    recomputed.

    Under tensor parallelism over `tp` ranks (Megatron's layout without sequence parallelism,
    Korthikanti et al. 2022) every rank holds all tokens; what lies between a column-split and a
    row-split matrix is split: queries, keys, values, attention's output and log-sum-exp, the MLP's
    intermediates (2 p D + 2 p KVd + 4 H + 4 p F per token, divided by tp); the block's input and
    both norms' tensors (8 D + 4 p D) are whole on every rank, as are the head and the loss."""
    t = tokens // sp  # this rank's tokens
    r = kv_replication(args.kv_heads, sp)
    kvd, qd = args.kv_heads * args.head_dim, args.n_heads * args.head_dim
    mlp = 4 * p * args.hidden_dim // tp  # per token: w1's and w3's outputs, silu's, their product
    tiled = 0 < mlp_chunk < t
    # The norms (fp32 input, cast, scaled output: 4 D + 2 p D each) whole; q, the output, k, v and
    # attention's log-sum-exp split over the tensor-parallel ranks.
    per_layer = ((8 + 4 * p) * args.dim + (2 * p * args.dim + 2 * p * kvd * r + 4 * args.n_heads) // tp
                 + (0 if tiled else mlp))
    if sp > 1:
        per_layer += p * qd
    checkpointed = _checkpointed(args, ac_every)
    layers = (args.n_layers - checkpointed) * per_layer + checkpointed * p * args.dim
    chunk = loss_chunk or max(128, LOSS_CHUNK_BYTES // (4 * args.vocab_size))
    one_chunk = t <= chunk
    head = (4.5 + 2 * p) * args.dim + 28 + (4 * args.vocab_size if one_chunk else 0)
    if sp > 1:
        head += 4 * args.head_dim
    loss_peak = min(t, chunk) * args.vocab_size * (p + 8)  # logits, their fp32 copy, softmax/grad
    # Backward works on one block at a time: its gradients of activations, and under activation
    # checkpointing its recomputed activations as well; under sequence parallelism the exchange's
    # send and receive buffers of its largest tensor (queries, or the output) on top.
    block_backward = per_layer * t * (2 if checkpointed else 1) + (mlp * mlp_chunk if tiled else 0)
    exchange = 2 * p * qd * t if sp > 1 else 0
    return {"saved": (layers + head) * t, "peak_extra": max(loss_peak, block_backward + exchange)}


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


def largest_layer_params(args: ModelArgs, tp: int = 1) -> int:
    """Parameters of the largest module (the embedding or the head, else an FFN matrix), which
    ZeRO-3 gathers whole and whose gradient it reduces whole (DeepSpeed's `largest_layer_params`);
    a tensor-parallel rank's slice of a block matrix is 1/tp of it, the embedding and head whole."""
    D = args.dim
    return max(args.vocab_size * D, D * args.hidden_dim // tp, D * args.n_heads * args.head_dim // tp)


def model_state_bytes(n_params: int, stage: int, world: int, precision: str, grad_dtype: str = "fp32",
                      largest_layer: int = 0, muon: int = 0) -> dict:
    """Weights, gradients, optimizer state (master weights + Adam moments) and, at ZeRO-3, the largest
    module gathered, per GPU, as DeepSpeed allocates them for `stage` as configured. Of the
    parameters, `muon` are Muon's (optimizer.name=muon): one momentum instead of the two Adam
    moments, in the dtype gradients are reduced in (DeepSpeed's communication_data_type at ZeRO-3,
    stage3.py _create_momentum_buffer; fp32 at stage 0 fp32, the only other stage Muon runs at)."""
    n, p = n_params, 4 if precision == "fp32" else 2
    a = 4 if precision == "fp32" or (precision == "bf16" and grad_dtype == "fp32") else 2
    adam = 12 * n - (8 - a) * muon  # fp32 master weights + moments: exp_avg, exp_avg_sq or the momentum
    if precision == "bf16" and stage == 0:
        stage = 1  # parallelize.engine_zero_stage
    if stage == 0:  # fp32: torch's AdamW on the weights; fp16: DeepSpeed's FP16_Optimizer, fp32 copies
        extra = 0 if p == 4 else 4
        return {"weights": p * n, "gradients": (p + extra) * n, "optimizer": adam - (4 - extra) * n}
    if stage == 1 and precision == "bf16" and a == 4:  # BF16_Optimizer
        return {"weights": 2 * n, "gradients": (2 + 4) * n, "optimizer": adam / world}
    if stage <= 2:
        return {"weights": p * n, "gradients": (p + 4) * n / world, "optimizer": adam / world}
    return {"weights": p * n / world, "gradients": a * n / world, "optimizer": adam / world,
            "gathered": (2 * p + (a if a != p else 0)) * largest_layer}


def block_matrices(args: ModelArgs) -> list[tuple[int, int]]:
    """A block's matrices, (fan_out, fan_in): wq wk wv wo w1 w2 w3."""
    qd, kvd, D, F = args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.dim, args.hidden_dim
    return [(qd, D), (kvd, D), (kvd, D), (D, qd), (F, D), (D, F), (F, D)]


def tensor_parallel_params(args: ModelArgs, n_params: int, tp: int) -> int:
    """Parameters one rank of a tensor-parallel group of `tp` holds (before ZeRO shards them over
    the data-parallel ranks): 1/tp of every block matrix, the embedding, head and norms whole."""
    split = args.n_layers * sum(m * k for m, k in block_matrices(args))
    return n_params - split + split // tp


# AutoTP's all-reduces per block per micro-batch: forward (wo, w2), backward (the input gradients of
# wq, wk, wv, w1, w3, one each) and a checkpointed block's recomputation (wo; not w2, tensor_parallel_bytes).
TP_ALLREDUCES = {"forward": 2, "backward": 5, "recomputation": 1}


def tensor_parallel_bytes(args: ModelArgs, tokens: int, p: int, tp: int) -> float:
    """Bytes through each GPU for one all-reduce of `tokens` x D activations or their gradients in
    p bytes over a tensor-parallel group of `tp` ranks, ring: 2 (tp-1)/tp of them. A block runs
    TP_ALLREDUCES of them, as counted (pretrain/traffic.py): 2 in forward (wo's and w2's outputs,
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


def muon_matrices(args: ModelArgs) -> list[list[tuple[int, int]]]:
    """The matrices Muon steps, (fan_out, fan_in), in the order ZeRO-3 steps them: one optimizer group
    per fan-in (optim.muon_param_groups), in the order the model first has it, each group's
    matrices in the model's order (wq wk wv wo w1 w2 w3 per block)."""
    groups: dict[int, list] = {}
    for _ in range(args.n_layers):
        for shape in block_matrices(args):
            groups.setdefault(shape[1], []).append(shape)
    return list(groups.values())


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


def muon_step(args: ModelArgs, stage: int, world: int, bucket: int, c: int, method: str = "gram") -> dict:
    """Muon's optimizer step per GPU, `c` the bytes of its communication dtype (the gradients'
    reduction dtype). At ZeRO-3 ours (pretrain/muon.py, replacing DeepSpeed's round robin per
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
    At stage 0 (fp32, no ZeRO) every rank orthogonalises every matrix and sends nothing."""
    flat = [s for g in muon_matrices(args) for s in g]
    n_muon = sum(m * k for m, k in flat)
    costs = [newton_schulz_flops(m, k, method) for m, k in flat]
    out = {"params": n_muon, "flops_total": sum(costs), "flops": 0, "comm": 0.0}
    if stage != 3:
        return {**out, "flops": out["flops_total"], "transient": c * 3 * max(m * k for m, k in flat)}
    n, numels = world, [m * k for m, k in flat]
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


def allreduced_params(args: ModelArgs, bucket: int) -> int:
    """Parameters whose gradients ZeRO-3 all-reduces rather than reduce-scatters under
    reduce_scatter=false (Muon): those that fit its reduce bucket (stage3.py:1673); a larger one
    is reduced alone, and still reduce-scattered."""
    D = args.dim
    block = [m * k for m, k in block_matrices(args)] + [D, D]  # (and the two norms)
    sizes = block * args.n_layers + [D, args.vocab_size * D] + ([] if args.tie_embeddings else [args.vocab_size * D])
    return sum(x for x in sizes if x <= bucket)


def allreduce_copy_bytes(n_params: int, stage: int, precision: str, grad_dtype: str) -> float:
    """The flat copy DeepSpeed's plain all-reduce makes (engine.allreduce_no_retain): gradients in
    buckets of 5e8 elements, each bucket of several tensors flattened first. BF16_Optimizer hands it
    one flat fp32 buffer per parameter group, copied only when both groups fit in one bucket."""
    if stage == 0 and precision != "bf16":
        return (4 if precision == "fp32" else 2) * min(n_params, 5e8)
    if stage <= 1 and precision == "bf16" and grad_dtype == "fp32":
        return 4 * n_params if n_params <= 5e8 else 0.0
    return 0.0


def comm_volume(n_params: int, stage: int, world: int, micro_steps: int, p: int, g: int | None = None,
                gathered: float | None = None, persistent: int = 0) -> dict:
    """Bytes through each GPU per optimizer step of ZeRO's collectives, by kind (none alone): weights
    of p bytes, gradients reduced in g bytes (default p), k = micro_steps, psi = (n-1)/n x
    parameters. As DeepSpeed 0.19 runs them, counted on 2 and 4 CPU ranks (pretrain/traffic.py,
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


def zero3_trace(args: ModelArgs, tp: int = 1) -> list[tuple[str, int]]:
    """The modules ZeRO-3 fetches parameters for in one micro-batch, in order, each as (its
    parameter, elements; a rank's 1/tp of the block matrices under tensor parallelism): forward
    (the embedding, each block's norms and matrices in the order they run, the final norm, the
    head), then backward in reverse. A tied head is the embedding's parameter. A checkpointed
    block's recomputation adds no fetch of its own: it gathers what its backward then uses
    (counted: the same bytes with and without activation checkpointing)."""
    D, V = args.dim, args.vocab_size
    wq, wk, wv, wo, w1, w2, w3 = (m * k // tp for m, k in block_matrices(args))
    used = [("attention_norm", D), ("wq", wq), ("wk", wk), ("wv", wv), ("wo", wo), ("ffn_norm", D),
            ("w1", w1), ("w3", w3), ("w2", w2)]
    blocks = [(f"layers.{i}.{name}", n) for i in range(args.n_layers) for name, n in used]
    forward = [("tok_embeddings", V * D), *blocks, ("norm", D), ("tok_embeddings" if args.tie_embeddings else "output", V * D)]
    return forward + forward[::-1]


def zero3_gathered(args: ModelArgs, persistence: int, reuse_distance: float = 1e9, tp: int = 1) -> dict:
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
    trace = zero3_trace(args, tp)
    persistent = sum(n for n in dict(trace).values() if n <= persistence)
    gathered, live = 0, set()
    for s, (name, n) in enumerate(trace):
        if n <= persistence:
            continue
        if name not in live:
            gathered += n
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
    return {"gathered": gathered, "persistent": persistent}


@dataclass
class Assumptions:
    gpus: int
    mfu: float = 0.4  # model FLOPs utilization assumed for the step time
    peak_tflops: float = 989.0  # per-GPU dense peak (H100/H200 bf16)
    gbps: float = 400.0  # interconnect bandwidth per GPU, Gbit/s (e.g. one 400G NIC per GPU)
    precision: str = "bf16"
    gpu_memory_gib: float = 80.0  # memory per GPU; rows that need more are marked (H100/A100 80GB)
    # In-node Gbit/s per GPU (NVLink 4: 450 GB/s): Ulysses' all-to-alls, TP's all-reduces, hpZ's
    # gathers, ZeRO within one node.
    sp_gbps: float = 3600.0
    gpus_per_node: int = 8  # GPUs joined by the in-node bandwidth: where TP groups and hpZ's secondary partitions live


def _zero3_gathers(cfg: Config, args: ModelArgs, tp: int = 1) -> dict:
    """zero3_gathered for this config at tensor-parallel size `tp` (comm_bytes's defaults below stage 3)."""
    if cfg.distributed.zero_stage != 3:
        return {}
    return zero3_gathered(args, zero_sizes(cfg)["param_persistence_threshold"], cfg.distributed.max_reuse_distance, tp)


def comm_hint(cfg: Config, args: ModelArgs, world: int, k: int, p: int, spare_gib: float = float("inf")) -> str:
    """What would cut this run's ZeRO traffic per step, by the counted rules of comm_volume ("" if
    nothing that keeps the run exact): ZeRO-2's all-reduce in every micro-batch, ZeRO-3's
    backward re-gathers beyond stage3_max_reuse_distance (a larger distance only where the
    weights it keeps gathered fit the `spare_gib` the GPU has left)."""
    stage, N = cfg.distributed.zero_stage, num_params(args)
    if world == 1:
        return ""
    if stage == 2 and k > 1:
        return (f"ZeRO-2 all-reduces the gradients in each of the {k} micro-batches: distributed.zero_stage=1 "
                f"reduces them once per step ({k}x fewer gradient bytes; the gradients then stay whole on each GPU)")
    if stage == 3:
        z = _zero3_gathers(cfg, args)
        again = z["gathered"] - (N - z["persistent"])  # per micro-batch, in backward
        if again > 0:
            keep = (f"distributed.max_reuse_distance={2 * N} keeps them gathered from forward to backward, "
                    f"at up to {p * N / GIB:.3g} GiB more per GPU; " if p * N / GIB <= spare_gib else "")
            return (f"ZeRO-3 gathers up to {again / 1e6:,.0f}M parameters again in each micro-batch's backward "
                    f"({k * (world - 1) / world * again * p / GIB:.3g} GiB per GPU per step): "
                    f"{keep}fewer, larger micro-batches gather less")
    return ""


def _sp_sizes(args: ModelArgs, seq_len: int) -> list[int]:
    """The sequence-parallel sizes this model and length allow: Ulysses splits heads and tokens."""
    return [n for n in range(1, args.n_heads + 1) if args.n_heads % n == 0 and seq_len % n == 0]


def estimate(cfg: Config, args: ModelArgs, a: Assumptions) -> dict:
    """Every figure of the report, for `a.gpus` GPUs, a scaling table over GPU counts, one over
    sequence-parallel sizes and one over the parallel layouts. A config its own validation refuses
    raises ConfigError, as does one that does not run on `a.gpus` in any layout; one that runs there
    only in another layout (a global batch that does not split over the GPUs as configured) gets
    the tables, with "refused" (why not as configured) instead of the run's own figures."""
    if a.gpus < 1 or not 0 < a.mfu <= 1 or a.peak_tflops <= 0 or a.gbps <= 0:
        raise ConfigError("--gpus must be >= 1, --mfu in (0, 1], --peak-tflops and --gbps > 0")
    if a.sp_gbps <= 0:
        raise ConfigError(f"Assumptions.sp_gbps={a.sp_gbps:g} must be > 0 (Gbit/s per GPU)")
    if a.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node={a.gpus_per_node} must be >= 1")
    if a.gpu_memory_gib <= 0:
        raise ConfigError(f"--gpu-memory={a.gpu_memory_gib:g} must be > 0 (GiB per GPU)")
    if cfg.problems():
        raise ConfigError(cfg.problems())
    p = {"bf16": 2, "fp16": 2, "fp32": 4}[a.precision]
    g = 4 if a.precision == "fp32" or (a.precision == "bf16" and cfg.distributed.grad_dtype == "fp32") else 2
    n_total, n_non_emb = num_params(args), num_params(args, non_embedding=True)
    fpt = flops_per_token(args, cfg.data.seq_len)
    stage, t, d = cfg.distributed.zero_stage, cfg.train, cfg.distributed
    sequences = cfg.global_batch(a.gpus // (d.sequence_parallel * d.tensor_parallel))
    tokens_per_step = sequences * cfg.data.seq_len
    micro_tokens = t.micro_batch_size * cfg.data.seq_len  # whole sequences, split over a sequence-parallel group
    muon = cfg.optimizer.name == "muon"
    bucket = d.reduce_bucket_size or args.dim**2
    flops_s = a.peak_tflops * 1e12 * a.mfu  # FLOP/s assumed, Newton-Schulz's matmuls too

    def at(world: int, sp: int = d.sequence_parallel, tp: int = d.tensor_parallel, hpz: bool = d.hpz) -> dict:
        dp = world // (sp * tp)  # sequence- or tensor-parallel groups: each reads its own micro-batches
        if world % (sp * tp) or sequences % (t.micro_batch_size * dp):
            raise ConfigError(f"the global batch of {sequences} sequences does not split over {world} GPUs")
        k = sequences // (t.micro_batch_size * dp)
        hpz = hpz and stage == 3
        # A tensor-parallel rank holds 1/tp of the block matrices and all of the rest; ZeRO shards
        # what it holds over the ranks that hold the same slice (a sequence-parallel group's too).
        local, zero_world = tensor_parallel_params(args, n_total, tp), world // tp
        opt = muon_step(args, stage, world, bucket, g, cfg.optimizer.muon_ns_method) if muon else None
        states = model_state_bytes(local, stage, zero_world, a.precision, d.grad_dtype, largest_layer_params(args, tp),
                                   opt["params"] if muon else 0)
        if hpz:  # the secondary partition: the 16-bit weights over the node's GPUs
            states["hpz_secondary"] = p * local / min(a.gpus_per_node, zero_world)
        acts = activation_bytes(args, micro_tokens, p, t.activation_checkpointing, t.loss_chunk_tokens, sp,
                                t.mlp_chunk_tokens, tp)
        buffers = allreduce_copy_bytes(local, stage, a.precision, d.grad_dtype)
        if stage > 0:
            buffers += (d.reduce_bucket_size or args.dim**2) * 4 + (
                (d.prefetch_bucket_size or int(0.9 * args.dim**2)) * p if stage == 3 else 0)
        memory = {**states, "activations": acts["saved"] + acts["peak_extra"], "buffers": buffers}
        if muon:
            memory["optimizer_step"] = opt["transient"]
        # The embedding and the head are whole on every rank of a tensor-parallel group, so each
        # computes the head's matmuls (6 V D per token) for the group's tokens.
        head_again = (tp - 1) * 6 * args.vocab_size * args.dim
        compute_s = (fpt + head_again) * tokens_per_step / (world * flops_s)
        # ZeRO's groups are the ranks holding one tensor-parallel slice: a node holds
        # gpus_per_node / tp of each.
        intra, inter = zero_traffic(local, stage, zero_world, k, p, g, max(a.gpus_per_node // tp, 1), hpz,
                                    **_zero3_gathers(cfg, args, tp))
        allreduced = allreduced_params(args, bucket) if muon and stage == 3 else 0
        extra_rs = k * (world - 1) / world * allreduced * g  # an all-reduce moves twice a reduce-scatter's bytes
        if world <= a.gpus_per_node:
            intra += extra_rs
        else:
            inter += extra_rs
        comm = intra + inter
        # The two links are counted one after the other: no credit for running them side by side.
        comm_s = inter / (a.gbps * 1e9 / 8) + intra / (a.sp_gbps * 1e9 / 8)
        # Muon's step runs after backward, its all-to-alls and Newton-Schulz one after the other; the
        # all-to-alls over the ZeRO ranks, within the node where they fit in one.
        muon_gbps = a.sp_gbps if world <= a.gpus_per_node else a.gbps
        opt_s = opt["flops"] / flops_s + opt["comm"] / (muon_gbps * 1e9 / 8) if muon else 0.0
        # Ulysses: forward and backward exchange every layer, a checkpointed block's recomputation
        # again; the all-to-alls sit between the layer's compute, not beside it: added to the step.
        recomputed = _checkpointed(args, t.activation_checkpointing)
        exchange = sequence_exchange_bytes(args, micro_tokens, p, sp)
        a2a = k * (2 * args.n_layers + recomputed) * exchange
        a2a_s = a2a / (a.sp_gbps * 1e9 / 8)
        # Tensor parallelism: the same, its all-reduces wait for the matmul before them and the next
        # one waits for them; 7 per block and 1 per recomputed block (TP_ALLREDUCES).
        allreduce = tensor_parallel_bytes(args, micro_tokens, p, tp)
        per_block = TP_ALLREDUCES["forward"] + TP_ALLREDUCES["backward"]
        tp_bytes = k * (per_block * args.n_layers + TP_ALLREDUCES["recomputation"] * recomputed) * allreduce
        tp_s = tp_bytes / (a.sp_gbps * 1e9 / 8)
        step_s = max(compute_s, comm_s) + a2a_s + tp_s + opt_s
        # The optimizer step's transient comes after backward has freed the activations: the larger counts.
        total_gib = (sum(memory.values()) - min(memory["activations"], memory.get("optimizer_step", 0))) / GIB
        extra = {"muon": {"params": opt["params"], "ns_flops_per_gpu": opt["flops"],
                          "ns_flops_total": opt["flops_total"], "ns_s": opt["flops"] / flops_s,
                          "step_comm_gib_per_gpu": opt["comm"] / GIB,
                          "step_comm_s": opt["comm"] / (muon_gbps * 1e9 / 8), "step_comm_gbps": muon_gbps,
                          "allreduced_params": allreduced}} if muon else {}
        return {"gpus": world, "sequence_parallel": sp, "tensor_parallel": tp, "hpz": hpz, "data_parallel": dp,
                "grad_accum": k, "memory_gib_per_gpu": total_gib,
                "fits": total_gib <= a.gpu_memory_gib, "memory_parts_gib": {k_: v / GIB for k_, v in memory.items()},
                "compute_s": compute_s, "comm_gib_per_gpu": comm / GIB, "comm_intra_node_gib_per_gpu": intra / GIB,
                "comm_inter_node_gib_per_gpu": inter / GIB, "comm_s": comm_s,
                "all_to_all_mib_per_layer": exchange / 2**20, "all_to_all_gib_per_gpu": a2a / GIB,
                "all_to_all_s": a2a_s, "tp_allreduce_mib": allreduce / 2**20,
                "tp_allreduce_gib_per_gpu": tp_bytes / GIB, "tp_allreduce_s": tp_s, "optimizer_step_s": opt_s,
                "step_s": step_s,
                "tokens_per_s": tokens_per_step / step_s, "efficiency": compute_s / step_s,
                "comm_bound": comm_s > compute_s, **extra}

    refused = cfg.problems(a.gpus)  # the batch arithmetic on these GPUs, as configured
    here = {} if refused else at(a.gpus)
    scaling = []
    world = 1
    while world <= max(a.gpus * 8, 8):
        try:
            scaling.append(at(world))
        except ConfigError:  # the global batch does not split over this many GPUs
            pass
        world *= 2
    # Each size the config allows (with its other settings) on the run's GPUs, or on the fewest
    # multiple of it above them; where the config refuses those, on the most GPUs below it accepts.
    by_sp = []
    for n in _sp_sizes(args, cfg.data.seq_len):
        layout = _with_layout(cfg, sequence_parallel=n)
        if layout.problems():  # e.g. with tensor parallelism
            continue
        world = next((w for w in range(math.lcm(a.gpus, n), 0, -n) if not layout.problems(w)), None)
        if world:
            by_sp.append(at(world, n))
    needed = next((r["sequence_parallel"] for r in by_sp if r["fits"]), None)
    options, not_listed = parallel_options(at, cfg, args, a)
    if refused and all("error" in r for r in options):
        raise ConfigError(refused)  # no layout runs on these GPUs
    fitting = [r for r in options if r.get("fits")]
    # The fastest that fits; of equal step times the first listed, the one with less machinery.
    recommended = min(fitting, key=lambda r: r["step_s"]) if fitting else None
    out = {
        "params": n_total, "params_non_embedding": n_non_emb, "flops_per_token": fpt,
        "tokens_per_step": tokens_per_step, "steps": t.max_steps, "tokens_total": tokens_per_step * t.max_steps,
        "flops_total": fpt * tokens_per_step * t.max_steps, "zero_stage": stage, "seq_len": cfg.data.seq_len,
        "assumptions": vars(a), "sequence_parallel": d.sequence_parallel, "tensor_parallel": d.tensor_parallel,
        "hpz": d.hpz and stage == 3, "optimizer": cfg.optimizer.name, "scaling": scaling, "fit_hint": fit_hint(cfg),
        "kv_replication": kv_replication(args.kv_heads, d.sequence_parallel),
        "activation_checkpointing": t.activation_checkpointing > 0,
        "sequence_parallel_table": by_sp, "sequence_parallel_needed": needed,
        "sequence_parallel_max": args.n_heads,
        "parallel_options": options, "not_listed": not_listed, "recommended": recommended and recommended["option"],
    }
    if refused:
        return {**out, "refused": refused}
    total_s = here["step_s"] * t.max_steps
    return {
        **out, **here, "total_s": total_s, "total_h": total_s / 3600,
        "host_checkpoint_copy_gib": ((tensor_parallel_params(args, n_total, d.tensor_parallel) * (4 + 8)
                                      - (8 - g) * here.get("muon", {}).get("params", 0))
                                     / (a.gpus // d.tensor_parallel if stage >= 1 else 1)) / GIB,
        "comm_hint": comm_hint(cfg, args, a.gpus, here["grad_accum"], p, a.gpu_memory_gib - here["memory_gib_per_gpu"]),
    }


def _with_layout(cfg: Config, **layout) -> Config:
    """The config with these distributed.* fields changed (sequence_parallel, tensor_parallel, hpz)."""
    return dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, **layout))


def _tp_sizes(args: ModelArgs, node: int) -> list[int]:
    """Tensor-parallel sizes above 1 within a node that split the heads, KV heads and FFN width."""
    return [n for n in range(2, node + 1) if not (args.n_heads % n or args.kv_heads % n or args.hidden_dim % n)]


def parallel_options(at, cfg: Config, args: ModelArgs, a: Assumptions) -> tuple[list[dict], dict]:
    """The layouts of the run's GPUs at the config's sequence_parallel: ZeRO alone, ZeRO-3 with hpZ
    (over more than one node), tensor parallelism within a node with ZeRO across (and with hpZ),
    each at the config's ZeRO stage, micro-batch size and global batch, with the overrides of
    distributed.* that select it; `at` evaluates one (estimate's). Each is this config with those
    overrides, checked by the config's own validation (Config.problems): one it refuses on any
    number of GPUs (tensor parallelism with sequence parallelism, hpZ with tensor parallelism,
    Muon with tensor parallelism) is not listed, and returned in {layout: the reason}; one it
    refuses on the run's GPUs (a global batch that does not split over them) is listed with the
    reason and no figures."""
    d = cfg.distributed
    stage, hpz_too = d.zero_stage, d.zero_stage == 3 and a.gpus > a.gpus_per_node
    layouts = [(f"ZeRO-{stage}", 1, False)] + [("ZeRO-3 + hpZ", 1, True)] * hpz_too
    for n in _tp_sizes(args, a.gpus_per_node):
        if a.gpus % n == 0:
            layouts += [(f"TP {n} + ZeRO-{stage}", n, False)] + [(f"TP {n} + ZeRO-3 + hpZ", n, True)] * hpz_too
    rows, not_listed = [], {}
    for name, tp, hpz in layouts:
        layout = _with_layout(cfg, tensor_parallel=tp, hpz=hpz)
        if layout.problems():
            not_listed[name] = layout.problems()[0]
            continue
        overrides = {f"distributed.{k}": v for k, v in (("tensor_parallel", tp), ("hpz", hpz)) if getattr(d, k) != v}
        row = {"option": name, "overrides": overrides}
        problems = layout.problems(a.gpus)
        if problems:
            row["error"] = problems[0]
        else:
            row.update(at(a.gpus, d.sequence_parallel, tp, hpz))
        rows.append(row)
    return rows, not_listed


def fit_hint(cfg: Config) -> str:
    """What would lower the memory per GPU of this config."""
    hints = ["more GPUs"]
    if cfg.distributed.zero_stage < 3:
        hints.append("distributed.zero_stage=3")
    if cfg.train.activation_checkpointing != 1:
        hints.append("train.activation_checkpointing=1")
    if cfg.train.micro_batch_size > 1:
        hints.append("a smaller train.micro_batch_size")
    return ", ".join(hints[:-1]) + " or " + hints[-1] if len(hints) > 1 else hints[0]


def _memory_cell(r: dict, a: dict) -> str:
    if r["fits"]:
        return f"{r['memory_gib_per_gpu']:.2f}"
    return f"{r['memory_gib_per_gpu']:.2f}, does not fit (> {a['gpu_memory_gib']:g} GiB)"


def _sp_line(e: dict) -> str:
    """Which sequence-parallel size makes this sequence length fit."""
    gib, n, T = e["assumptions"]["gpu_memory_gib"], e["sequence_parallel_needed"], f"{e['seq_len']:,}"
    if n is None:
        return (f"sequence_parallel: none up to {e['sequence_parallel_max']} (model.n_heads) makes seq_len {T} fit "
                f"in {gib:g} GiB per GPU: also use {e['fit_hint']}")
    if n == 1:
        return f"sequence_parallel: 1 is enough for seq_len {T} to fit in {gib:g} GiB per GPU"
    return f"sequence_parallel: {n} needed for seq_len {T} to fit in {gib:g} GiB per GPU"


def _a2a_line(e: dict) -> str:
    a, sp, mib = e["assumptions"], e["sequence_parallel"], e["all_to_all_mib_per_layer"]
    kv = f", keys and values replicated {e['kv_replication']}x" if e["kv_replication"] > 1 else ""
    recompute = ", again in the recomputation" if e["activation_checkpointing"] else ""
    return (f"Ulysses all-to-all over {sp} GPUs: q, k, v in and the output back{kv}: {mib:.3g} MiB per GPU per layer "
            f"per micro-batch in forward, the same in backward{recompute}; "
            f"{e['all_to_all_gib_per_gpu']:.3g} GiB per GPU per step, {e['all_to_all_s']:.3g} s at "
            f"{a['sp_gbps']:g} Gbit/s (not overlapped: in the step time)")


def _muon_line(e: dict) -> str:
    m, a = e["muon"], e["assumptions"]
    return (f"Muon step (once per step, after backward, not overlapped): Newton-Schulz "
            f"{m['ns_flops_per_gpu'] / 1e12:.3g} TFLOPs on the busiest GPU "
            f"({m['ns_flops_total'] / 1e12:.3g} over all), {m['ns_s']:.3g} s; {m['step_comm_gib_per_gpu']:.3g} GiB "
            "of gradient, momentum and update slices sent per GPU (all-to-all), "
            f"{m['step_comm_s']:.3g} s at {m['step_comm_gbps']:g} Gbit/s; {e['optimizer_step_s']:.3g} s = "
            f"{e['optimizer_step_s'] / e['step_s']:.0%} of the step. {m['params'] / 1e6:,.1f}M parameters on Muon"
            + (f"; reduce_scatter: false all-reduces the gradients of the {m['allreduced_params'] / 1e6:,.1f}M "
               "parameters that fit a reduce bucket" if e["zero_stage"] == 3 else ""))


def report(e: dict) -> str:
    a = e["assumptions"]
    muon = e["optimizer"] == "muon"
    sp = e["sequence_parallel"]
    split = f", each sequence split over {sp} GPUs" if sp > 1 else ""
    if e["tensor_parallel"] > 1:
        split = f", each block's matrices split over {e['tensor_parallel']} GPUs"
    hpz = " with hpZ" if e["hpz"] else ""
    run = f"run: {a['gpus']} GPU(s), ZeRO-{e['zero_stage']}{hpz}, {a['precision']}, {e['optimizer']}, "
    model = (f"model: {e['params'] / 1e6:,.1f}M parameters ({e['params_non_embedding'] / 1e6:,.1f}M non-embedding), "
             f"{e['flops_per_token'] / 1e9:.3f} GFLOPs per token (forward + backward, PaLM)")
    if "refused" in e:  # not on these GPUs as configured: the layouts at the end say what does
        lines = [model, run + f"{e['tokens_per_step']:,} tokens per step{split}: not as configured: "
                 + "; ".join(e["refused"]) + " (the parallel layouts at the end run on these GPUs)", _sp_line(e)]
        return "\n".join(lines + _tables(e))
    lines = [
        model,
        run + f"{e['tokens_per_step']:,} tokens per step "
        f"({e['grad_accum']} micro-batch(es) per GPU{split}), {e['tokens_total'] / 1e9:,.2f}B tokens, "
        f"{e['flops_total']:.3g} FLOPs in all",
        f"memory per GPU: {e['memory_gib_per_gpu']:.2f} GiB = "
        + " + ".join(f"{k} {v:.2f}" for k, v in e["memory_parts_gib"].items())
        + f"; host memory for a checkpoint in flight: {e['host_checkpoint_copy_gib']:.2f} GiB per GPU",
        *([] if e["fits"] else [f"does not fit ({e['memory_gib_per_gpu']:.0f} GiB > {a['gpu_memory_gib']:g} GiB "
                                f"per GPU): use {e['fit_hint']}"]),
        _sp_line(e),
        f"time at {a['mfu']:.0%} MFU of {a['peak_tflops']:g} TFLOPS: {e['step_s']:.3g} s per step, "
        f"{e['total_h']:.3g} h for {e['steps']:,} steps",
        _comm_line(e),
        *([e["comm_hint"]] if e["comm_hint"] else []),
        *([_a2a_line(e)] if sp > 1 else []),
        *([_tp_line(e)] if e["tensor_parallel"] > 1 else []),
        *([_muon_line(e)] if muon else []),
    ]
    return "\n".join(lines + _tables(e))


def _tables(e: dict) -> list[str]:
    """The scaling table over GPU counts, the one over sequence-parallel sizes and the layouts'."""
    a, muon = e["assumptions"], e["optimizer"] == "muon"
    lines = [
        "",
        "The same global batch on other GPU counts (efficiency = compute time / step time: below 1 the",
        "GPUs wait for ZeRO's collectives" + (" or Muon's step" if muon else "") + "; more GPUs then buy less than "
        "their share):",
        "",
        "| GPUs | micro-batches per GPU | memory/GPU GiB | compute s | comm s |" + (" Muon step s |" if muon else "")
        + " step s | tokens/s | efficiency |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if muon else ""),
    ]
    for r in e["scaling"]:
        lines.append(f"| {r['gpus']} | {r['grad_accum']} | {_memory_cell(r, a)} | {r['compute_s']:.3g} | "
                     f"{r['comm_s']:.3g} | " + (f"{r['optimizer_step_s']:.3g} | " if muon else "")
                     + f"{r['step_s']:.3g} | {r['tokens_per_s']:,.0f} | {r['compute_s'] / r['step_s']:.0%} |")
    lines += [
        "",
        f"Sequence parallelism (distributed.sequence_parallel) at seq_len {e['seq_len']:,}: each sequence split over",
        "N GPUs, the same global batch, on the run's GPUs or the fewest multiple of N above them (fewer where the",
        "batch does not split over those); all-to-all per GPU per layer per micro-batch, forward (backward the same):",
        "",
        "| sequence_parallel | GPUs | activations/GPU GiB | memory/GPU GiB | all-to-all MiB | all-to-all s | step s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in e["sequence_parallel_table"]:
        lines.append(f"| {r['sequence_parallel']} | {r['gpus']} | {r['memory_parts_gib']['activations']:.2f} | "
                     f"{_memory_cell(r, a)} | {r['all_to_all_mib_per_layer']:.3g} | {r['all_to_all_s']:.3g} | "
                     f"{r['step_s']:.3g} |")
    return lines + _options_lines(e)


def _comm_line(e: dict) -> str:
    a = e["assumptions"]
    intra, inter = e["comm_intra_node_gib_per_gpu"], e["comm_inter_node_gib_per_gpu"]
    where = (f"{inter:.3g} GiB across nodes at {a['gbps']:g} Gbit/s" if not intra else
             f"{intra:.3g} GiB within the node at {a['sp_gbps']:g} Gbit/s" if not inter else
             f"{intra:.3g} GiB within the node at {a['sp_gbps']:g} Gbit/s + {inter:.3g} GiB across nodes at "
             f"{a['gbps']:g} Gbit/s")
    return (f"ZeRO communication per GPU per step: {where}, {e['comm_s']:.3g} s "
            f"({'longer than' if e['comm_bound'] else 'hidden behind'} the compute, if overlapped)")


def _tp_line(e: dict) -> str:
    a = e["assumptions"]
    recompute = f", {TP_ALLREDUCES['recomputation']} more in the recomputation" if e["activation_checkpointing"] else ""
    return (f"tensor parallelism over {e['tensor_parallel']} GPUs: {e['tp_allreduce_mib']:.3g} MiB per GPU per "
            f"all-reduce, {TP_ALLREDUCES['forward']} per block per micro-batch in forward, "
            f"{TP_ALLREDUCES['backward']} in backward{recompute}; "
            f"{e['tp_allreduce_gib_per_gpu']:.3g} GiB per GPU per step, {e['tp_allreduce_s']:.3g} s at "
            f"{a['sp_gbps']:g} Gbit/s (not overlapped: in the step time)")


def _options_lines(e: dict) -> list[str]:
    a, sp = e["assumptions"], e["sequence_parallel"]
    lines = [
        "",
        f"Parallel layouts on {a['gpus']} GPUs ({a['gpus_per_node']} per node), the same global batch"
        + (f", micro-batch size and sequence_parallel={sp}" if sp > 1 else " and micro-batch size")
        + ", overrides from this config",
        f"(-: its own layout); TP's all-reduces and hpZ's gathers within a node at {a['sp_gbps']:g} Gbit/s, "
        f"the rest across nodes at {a['gbps']:g} Gbit/s:",
        "",
        "| layout | overrides | memory/GPU GiB | compute s | ZeRO comm s (in node + across, GiB) | TP all-reduce s "
        "| step s | efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in e["parallel_options"]:
        overrides = " ".join(f"{k}={str(v).lower()}" for k, v in r["overrides"].items()) or "-"
        if "error" in r:
            lines.append(f"| {r['option']} | {overrides} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['option']} | {overrides} | {_memory_cell(r, a)} | {r['compute_s']:.3g} | "
                     f"{r['comm_s']:.3g} ({r['comm_intra_node_gib_per_gpu']:.3g} + "
                     f"{r['comm_inter_node_gib_per_gpu']:.3g}) | {r['tp_allreduce_s']:.3g} | {r['step_s']:.3g} | "
                     f"{r['efficiency']:.0%} |")
    rec = next((r for r in e["parallel_options"] if r["option"] == e["recommended"]), None)
    if rec is None:
        lines.append(f"recommended: none of these fits in {a['gpu_memory_gib']:g} GiB per GPU: use {e['fit_hint']}")
    else:
        overrides = " ".join(f"{k}={str(v).lower()}" for k, v in rec["overrides"].items())
        lines.append(f"recommended: {rec['option']} (the fastest that fits: {rec['step_s']:.3g} s per step)"
                     + (f": {overrides}" if overrides else ": this config's layout"))
        if rec["comm_bound"]:  # every layout's ZeRO traffic per token falls with the micro-batch size
            lines.append("it still waits for ZeRO's collectives: a larger train.micro_batch_size (fewer gathers per "
                         "token) would shorten the step where memory allows")
    reasons: dict[str, list[str]] = {}
    for name, reason in e["not_listed"].items():
        reasons.setdefault(reason, []).append(name)
    for reason, names in reasons.items():
        lines.append(f"(not listed, the config refuses them: {', '.join(names)}: {reason})")
    return lines
