"""`pretrain estimate CONFIG [overrides] --gpus N`: what a run will need before it is launched.

Parameters and FLOPs per token (the trainer's own PaLM formula), memory per GPU by part, tokens per
step, step and total time at an assumed MFU, and for planning past one machine the ZeRO
communication per step and its time at an interconnect bandwidth, over a range of GPU counts.

The memory model (bytes, per GPU):
- model states, mixed precision (bf16 weights and gradients, fp32 master weights and Adam moments:
  2 + 2 + 12 bytes per parameter), divided over the n GPUs as ZeRO does: stage 1 divides the 12,
  stage 2 also the gradients, stage 3 everything (Rajbhandari et al. 2020). In fp32 the weights and
  gradients take 4 bytes each and the master copy exists only from stage 1 on.
- activations: what autograd saves for backward, per token per transformer block, counted from this
  model's code and checked against torch's saved-tensor hooks (tests/test_estimate.py):
  (8 + 6p) D + 2p KVd + 4p F + 4 H bytes, p the bytes of the training dtype, D the width, KVd the
  key/value width, F the SwiGLU width, H the heads (flash attention: no T^2 term). A block under
  activation checkpointing keeps p D (its input), and one block's activations live again during
  its recomputation. The head keeps (4.5 + 2p) D + 28 bytes per token, plus the fp32
  log-probabilities (4 V) when the loss is one chunk; the loss chunk's logits are the transient peak.
- DeepSpeed's buffers: stage 0 flattens all gradients into a copy for its all-reduce (also alone);
  stages 1-3 reduce through a bucket, and ZeRO-3 prefetches weights into another.

Communication per GPU per step (ring collectives move (n-1)/n of the data through each GPU):
stage 0 and 1 all-reduce (or reduce-scatter + all-gather) the gradients once per step: 2 psi;
stage 2 reduce-scatters every micro-batch and gathers the weights once: (k + 1) psi;
stage 3 gathers the weights twice (forward, backward) and reduce-scatters once per micro-batch:
3 k psi; psi = (n-1)/n x parameters x bytes, k the micro-batches per GPU per step. With
communication overlapped with compute (DeepSpeed's overlap_comm) a step takes about the longer of
the two; where communication is longer, more GPUs stop paying.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pretrain.config import Config
from pretrain.errors import ConfigError
from pretrain.model.args import ModelArgs
from pretrain.model.model import LOSS_CHUNK_BYTES, flops_per_token, num_params

GIB = 2**30


def activation_bytes(args: ModelArgs, tokens: int, p: int, ac_every: int, loss_chunk: int = 0) -> dict:
    """Activation memory of one micro-batch of `tokens` tokens in dtype of `p` bytes: what autograd
    keeps for backward ("saved") and the largest transient on top of it ("peak_extra")."""
    kvd = args.kv_heads * args.head_dim
    per_layer = (8 + 6 * p) * args.dim + 2 * p * kvd + 4 * p * args.hidden_dim + 4 * args.n_heads
    checkpointed = len(range(0, args.n_layers, ac_every)) if ac_every else 0
    layers = (args.n_layers - checkpointed) * per_layer + checkpointed * p * args.dim
    chunk = loss_chunk or max(128, LOSS_CHUNK_BYTES // (4 * args.vocab_size))
    one_chunk = tokens <= chunk
    head = (4.5 + 2 * p) * args.dim + 28 + (4 * args.vocab_size if one_chunk else 0)
    loss_peak = min(tokens, chunk) * args.vocab_size * (p + 8)  # logits, their fp32 copy, softmax/grad
    # Backward works on one block at a time: its gradients of activations, and under activation
    # checkpointing its recomputed activations as well.
    block_backward = per_layer * tokens * (2 if checkpointed else 1)
    return {"saved": (layers + head) * tokens, "peak_extra": max(loss_peak, block_backward)}


def model_state_bytes(n_params: int, stage: int, world: int, precision: str) -> dict:
    """Weights, gradients and optimizer state (master weights + Adam moments) per GPU."""
    mixed = precision in ("bf16", "fp16")
    w = g = 2 if mixed else 4
    master = 4 if mixed or stage >= 1 else 0  # fp32 stage 0 updates the weights themselves
    return {"weights": n_params * w / (world if stage >= 3 else 1),
            "gradients": n_params * g / (world if stage >= 2 else 1),
            "optimizer": n_params * (master + 8) / (world if stage >= 1 else 1)}


def comm_bytes(n_params: int, stage: int, world: int, micro_steps: int, p: int) -> float:
    """Bytes through each GPU per optimizer step for ZeRO's collectives (0 alone)."""
    if world == 1:
        return 0.0
    psi = (world - 1) / world * n_params * p
    return {0: 2, 1: 2, 2: micro_steps + 1, 3: 3 * micro_steps}[stage] * psi


@dataclass
class Assumptions:
    gpus: int
    mfu: float = 0.4  # model FLOPs utilization assumed for the step time
    peak_tflops: float = 989.0  # per-GPU dense peak (H100/H200 bf16)
    gbps: float = 400.0  # interconnect bandwidth per GPU, Gbit/s (e.g. one 400G NIC per GPU)
    precision: str = "bf16"


def estimate(cfg: Config, args: ModelArgs, a: Assumptions) -> dict:
    """Every figure of the report, for `a.gpus` GPUs, and a scaling table over GPU counts."""
    if a.gpus < 1 or not 0 < a.mfu <= 1 or a.peak_tflops <= 0 or a.gbps <= 0:
        raise ConfigError("--gpus must be >= 1, --mfu in (0, 1], --peak-tflops and --gbps > 0")
    cfg.validate(a.gpus)
    p = {"bf16": 2, "fp16": 2, "fp32": 4}[a.precision]
    n_total, n_non_emb = num_params(args), num_params(args, non_embedding=True)
    fpt = flops_per_token(args, cfg.data.seq_len)
    stage, t = cfg.distributed.zero_stage, cfg.train
    tokens_per_step = cfg.global_batch(a.gpus) * cfg.data.seq_len

    def at(world: int) -> dict:
        k = cfg.grad_accum(world)
        states = model_state_bytes(n_total, stage, world, a.precision)
        acts = activation_bytes(args, t.micro_batch_size * cfg.data.seq_len, p, t.activation_checkpointing,
                                t.loss_chunk_tokens)
        d = cfg.distributed
        if stage == 0:
            buffers = states["gradients"]
        else:
            buffers = (d.reduce_bucket_size or args.dim**2) * 4 + (
                (d.prefetch_bucket_size or int(0.9 * args.dim**2)) * p if stage == 3 else 0)
        memory = {**states, "activations": acts["saved"] + acts["peak_extra"], "buffers": buffers}
        compute_s = fpt * tokens_per_step / (world * a.peak_tflops * 1e12 * a.mfu)
        comm_s = comm_bytes(n_total, stage, world, k, p) / (a.gbps * 1e9 / 8)
        step_s = max(compute_s, comm_s)
        return {"gpus": world, "grad_accum": k, "memory_gib_per_gpu": sum(memory.values()) / GIB,
                "memory_parts_gib": {k_: v / GIB for k_, v in memory.items()}, "compute_s": compute_s,
                "comm_gib_per_gpu": comm_bytes(n_total, stage, world, k, p) / GIB, "comm_s": comm_s,
                "step_s": step_s, "tokens_per_s": tokens_per_step / step_s, "comm_bound": comm_s > compute_s}

    here = at(a.gpus)
    scaling = []
    world = 1
    while world <= max(a.gpus * 8, 8):
        try:
            scaling.append(at(world))
        except ConfigError:  # the global batch does not split over this many GPUs
            pass
        world *= 2
    total_s = here["step_s"] * t.max_steps
    return {
        "params": n_total, "params_non_embedding": n_non_emb, "flops_per_token": fpt,
        "tokens_per_step": tokens_per_step, "steps": t.max_steps, "tokens_total": tokens_per_step * t.max_steps,
        "flops_total": fpt * tokens_per_step * t.max_steps, "zero_stage": stage,
        "assumptions": vars(a), **here, "total_s": total_s, "total_h": total_s / 3600,
        "host_checkpoint_copy_gib": (n_total * (4 + 8) / (a.gpus if stage >= 1 else 1)) / GIB,
        "scaling": scaling,
    }


def report(e: dict) -> str:
    a = e["assumptions"]
    lines = [
        f"model: {e['params'] / 1e6:,.1f}M parameters ({e['params_non_embedding'] / 1e6:,.1f}M non-embedding), "
        f"{e['flops_per_token'] / 1e9:.3f} GFLOPs per token (forward + backward, PaLM)",
        f"run: {a['gpus']} GPU(s), ZeRO-{e['zero_stage']}, {a['precision']}, {e['tokens_per_step']:,} tokens per step "
        f"({e['grad_accum']} micro-batch(es) per GPU), {e['tokens_total'] / 1e9:,.2f}B tokens, "
        f"{e['flops_total']:.3g} FLOPs in all",
        f"memory per GPU: {e['memory_gib_per_gpu']:.2f} GiB = "
        + " + ".join(f"{k} {v:.2f}" for k, v in e["memory_parts_gib"].items())
        + f"; host memory for a checkpoint in flight: {e['host_checkpoint_copy_gib']:.2f} GiB per GPU",
        f"time at {a['mfu']:.0%} MFU of {a['peak_tflops']:g} TFLOPS: {e['step_s']:.3g} s per step, "
        f"{e['total_h']:.3g} h for {e['steps']:,} steps",
        f"ZeRO communication at {a['gbps']:g} Gbit/s per GPU: {e['comm_gib_per_gpu']:.3g} GiB per GPU per step, "
        f"{e['comm_s']:.3g} s ({'longer than' if e['comm_bound'] else 'hidden behind'} the compute, if overlapped)",
        "",
        "The same global batch on other GPU counts (efficiency = compute time / step time: below 1 the",
        "GPUs wait for ZeRO's collectives; more GPUs then buy less than their share):",
        "",
        "| GPUs | micro-batches per GPU | memory/GPU GiB | compute s | comm s | step s | tokens/s | efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in e["scaling"]:
        lines.append(f"| {r['gpus']} | {r['grad_accum']} | {r['memory_gib_per_gpu']:.2f} | {r['compute_s']:.3g} | "
                     f"{r['comm_s']:.3g} | {r['step_s']:.3g} | {r['tokens_per_s']:,.0f} | "
                     f"{r['compute_s'] / r['step_s']:.0%} |")
    return "\n".join(lines)


def estimate_cli(args) -> None:
    from pretrain.config import load_config
    from pretrain.metrics import PEAK_FLOPS

    cfg = load_config(args.config, args.overrides)
    model_args = _model_args(cfg)
    precision = args.precision or (cfg.train.precision if cfg.train.precision != "auto" else "bf16")
    peak = args.peak_tflops or (cfg.distributed.peak_flops / 1e12 if cfg.distributed.peak_flops
                                else PEAK_FLOPS[("H100", "bf16" if precision != "fp32" else "fp32")] / 1e12)
    e = estimate(cfg, model_args, Assumptions(args.gpus, args.mfu, peak, args.gbps, precision))
    print(report(e))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(e, f, indent=1)


def _model_args(cfg: Config) -> ModelArgs:
    """The model shape with its vocabulary size: a Hugging Face init_from's config.json, or the config's
    model with the vocabulary from its tokenizer if it is not set."""
    from pretrain import hub

    if hub.is_hf_model(cfg.checkpoint.init_from):
        from pretrain.build import hf_model_args

        return hf_model_args(cfg)
    if cfg.model.vocab_size:
        return cfg.model
    from data_pipeline.errors import DataError
    from pretrain.build import tokenizer_and_model_args

    try:
        return tokenizer_and_model_args(cfg)[1]
    except DataError as e:
        raise ConfigError(f"{e} (or set model.vocab_size=N to estimate without the tokenizer)") from None

