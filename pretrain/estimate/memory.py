"""Memory per GPU of a run, as DeepSpeed allocates it.

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
  key/value width, F the SwiGLU width, H the heads (flash attention: no T^2 term). A local
  (sliding-window) layer's is the same: FlexAttention keeps the same q, k, v, output and fp32
  log-sum-exp whatever the window (its block mask, (T/128)^2 indices shared by the layers, is not
  counted); the window cuts FLOPs (flops_per_token), not these bytes. Not counted either: on the
  path without FlexAttention (CPU) SDPA keeps the dense window mask, made additive in the training
  dtype, one (T, T) per local layer: p T^2 bytes (tests/test_estimate.py; 256 MiB at T = 8192 in
  fp32). A block under activation checkpointing keeps p D (its input), and one block's
  activations live again during its recomputation. The head keeps (4.5 + 2p) D + 28 bytes per
  token, plus the fp32 log-probabilities (4 V) when the loss is one chunk; the loss chunk's logits
  are the transient peak.
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
- fp8 (train.precision=fp8, torchao's Float8Linear): weights, gradients and optimizer states as
  bf16's; the float8 copies of a matmul's operands are transients of that matmul, and backward
  recasts from the bf16 tensors autograd keeps as for bf16 (no more activations). What it adds is
  under ZeRO-3: a Float8Linear keeps its gathered weight (a view, weight.t()) for backward, so the
  storage ZeRO would free after forward stays until the block's backward: p x the converted
  weights of every block not under activation checkpointing, plus one checkpointed block's during
  its recomputation (float8_saved_weight_bytes; at stages 0-2 the weights are whole anyway). The
  scales (a scalar per tensor, or one fp32 per row with rowwise) are not counted.
A row over the GPU's memory (Assumptions.gpu_memory_gib: 80 GiB) is marked as not fitting.
"""

from __future__ import annotations

import math

from pretrain.model.args import ModelArgs
from pretrain.model.float8 import ALIGN
from pretrain.model.model import LOSS_CHUNK_BYTES


GIB = 2**30


def checkpointed_blocks(args: ModelArgs, ac_every: int) -> int:
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
    # attention's log-sum-exp split over the tensor-parallel ranks. (A local layer's the same: the
    # window cuts its FLOPs, not what attention keeps; the module docstring.)
    per_layer = ((8 + 4 * p) * args.dim + (2 * p * args.dim + 2 * p * kvd * r + 4 * args.n_heads) // tp
                 + (0 if tiled else mlp))
    if sp > 1:
        per_layer += p * qd
    per_moe_layer = per_layer - (0 if tiled else mlp) + moe_bytes_per_token(args, p)
    checkpointed = checkpointed_blocks(args, ac_every)
    layers = sum(p * args.dim if ac_every > 0 and i % ac_every == 0 else
                 (per_moe_layer if args.is_moe_layer(i) else per_layer) for i in range(args.n_layers))
    per_layer = max(per_layer, per_moe_layer if args.moe_experts else 0)  # (the largest block, for backward)
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


def moe_bytes_per_token(args: ModelArgs, p: int) -> int:
    """What an MoE block's feed-forward keeps for backward per token, in place of the dense MLP's
    4 p F (pretrain/model/moe.py, measured against autograd's saved tensors in tests/test_estimate.py):
    the router's fp32 input (a copy unless the model is fp32; the block's count has the norm's
    output, which nothing but shared experts keeps here), its logits and scores (for the
    softmax, the z-loss's logsumexp), the routing's int64 indices and weights; per routed copy
    (k per token) the row sent to its expert, the expert's four SwiGLU intermediates, its output
    (kept by the weighting) and the weighted output (kept by index_add's backward for its shape):
    3 p D + 4 p H; the shared experts' four intermediates, 4 p S H."""
    D, E, k, H = args.dim, args.moe_experts, args.moe_top_k, args.moe_expert_hidden_dim
    # (in fp32 the router's input is the norm's output itself, counted with the block; in a lower
    # precision its fp32 copy, and the norm's output is kept only by shared experts)
    router = (0 if p == 4 else 4 * D - (0 if args.moe_shared_experts else p * D)) + 12 * E + 44 * k + 16
    return router + k * (3 * p * D + 4 * p * H) + 4 * p * args.moe_shared_experts * H


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


def float8_block_params(args: ModelArgs, i: int) -> int:
    """Parameters of block i's linears that train.precision=fp8 converts (pretrain/model/float8.py):
    attention's four and the SwiGLU's three (an MoE block: its shared experts', not the router's or
    the routed experts'), where both dimensions are multiples of 16."""
    qd, kvd, D = args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.dim
    F = args.moe_shared_experts * args.moe_expert_hidden_dim if args.is_moe_layer(i) else args.hidden_dim
    linears = [(qd, D), (kvd, D), (kvd, D), (D, qd)] + ([(F, D), (D, F), (F, D)] if F else [])
    return sum(m * k for m, k in linears if m % ALIGN == 0 and k % ALIGN == 0)


def float8_saved_weight_bytes(args: ModelArgs, p: int, ac_every: int, stage: int) -> int:
    """ZeRO-3: the gathered weights Float8Linear keeps for backward (module docstring, fp8)."""
    if stage != 3:
        return 0
    blocks = [float8_block_params(args, i) for i in range(args.n_layers)]
    checkpointed = [n for i, n in enumerate(blocks) if ac_every and i % ac_every == 0]
    return p * (sum(blocks) - sum(checkpointed) + max(checkpointed, default=0))


def tensor_parallel_params(args: ModelArgs, n_params: int, tp: int) -> int:
    """Parameters one rank of a tensor-parallel group of `tp` holds (before ZeRO shards them over
    the data-parallel ranks): 1/tp of every block matrix, the embedding, head and norms whole."""
    split = args.n_layers * sum(m * k for m, k in block_matrices(args))
    return n_params - split + split // tp


def allreduce_copy_bytes(n_params: int, stage: int, precision: str, grad_dtype: str) -> float:
    """The flat copy DeepSpeed's plain all-reduce makes (engine.allreduce_no_retain): gradients in
    buckets of 5e8 elements, each bucket of several tensors flattened first. BF16_Optimizer hands it
    one flat fp32 buffer per parameter group, copied only when both groups fit in one bucket."""
    if stage == 0 and precision != "bf16":
        return (4 if precision == "fp32" else 2) * min(n_params, 5e8)
    if stage <= 1 and precision == "bf16" and grad_dtype == "fp32":
        return 4 * n_params if n_params <= 5e8 else 0.0
    return 0.0
