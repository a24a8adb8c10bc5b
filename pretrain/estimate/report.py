"""`pretrain estimate CONFIG [overrides] --gpus N`: what a run will need before it is launched.

Parameters and FLOPs per token (the trainer's own PaLM formula), memory per GPU by part, tokens per
step, step and total time at an assumed MFU, and for planning past one machine the ZeRO
communication per step and its time at an interconnect bandwidth, over a range of GPU counts,
over the sequence-parallel sizes the model allows (which one a sequence length needs to fit), and
over the layouts of the run's GPUs: ZeRO alone, ZeRO-3 with hpZ, tensor parallelism within a node
with ZeRO across, at the configured sequence_parallel, each checked against the config's own
validation (Config.problems); the fastest that fits is recommended (parallel_options). A run whose
global batch does not split over its GPUs as configured gets the layouts that do, not a refusal.

The parts: memory (pretrain/estimate/memory.py), communication (comm.py), Muon's step (muon.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pretrain.config import Config, zero_sizes
from pretrain.errors import ConfigError
from pretrain.estimate.comm import (TP_ALLREDUCES, allreduced_params, expert_exchange_bytes, expert_params,
                                    sequence_exchange_bytes, tensor_parallel_bytes, zero3_expert_gathers, zero3_gathered,
                                    zero_traffic)
from pretrain.estimate.memory import (GIB, activation_bytes, allreduce_copy_bytes, checkpointed_blocks,
                                      float8_block_params, float8_saved_weight_bytes, kv_replication,
                                      largest_layer_params, model_state_bytes, tensor_parallel_params)
from pretrain.estimate.muon import muon_step
from pretrain.model.args import ModelArgs
from pretrain.model.model import flops_per_token, num_params


@dataclass
class Assumptions:
    gpus: int
    mfu: float = 0.4  # model FLOPs utilization assumed for the step time
    peak_tflops: float = 989.0  # per-GPU dense peak (H100/H200 bf16)
    gbps: float = 400.0  # interconnect bandwidth per GPU, Gbit/s (e.g. one 400G NIC per GPU)
    precision: str = "bf16"  # bf16 | fp16 | fp32 | fp8 (bf16 with the blocks' linears in float8)
    gpu_memory_gib: float = 80.0  # memory per GPU; rows that need more are marked (H100/A100 80GB)
    # In-node Gbit/s per GPU (NVLink 4: 450 GB/s): Ulysses' all-to-alls, TP's all-reduces, hpZ's
    # gathers, ZeRO within one node.
    sp_gbps: float = 3600.0
    gpus_per_node: int = 8  # GPUs joined by the in-node bandwidth: where TP groups and hpZ's secondary partitions live
    # fp8: how much faster the converted linears' matmuls run than in bf16, casts included (0 = the
    # recipe's FP8_SPEEDUP)
    fp8_speedup: float = 0.0


# The converted linears' matmul time, bf16 over fp8 with the casts, by recipe: what makes the
# end-to-end gains torchao reports for Llama-3 8B on 8 H100s with torch.compile (its float8 README:
# +25% tokens/s tensorwise, +10% rowwise; torchtitan's Llama-3.1 8B 6,667 -> 8,532 tokens/s/GPU,
# +28%) when the converted linears are 80% of the step's FLOPs, as they are there at seq 8192:
# 1 / (0.2 + 0.8 / s) = 1.25 -> s = 1.33; 1.10 -> 1.12. (The GEMM's peak is 2x bf16's; the casts,
# the amax reductions and the unconverted work take the rest.)
FP8_SPEEDUP = {"tensorwise": 1.33, "rowwise": 1.12}


def _zero3_gathers(cfg: Config, args: ModelArgs, tp: int = 1, ep: int = 1) -> dict:
    """zero3_gathered for this config at tensor-parallel size `tp` and expert-parallel size `ep`
    (comm_bytes's defaults below stage 3)."""
    if cfg.distributed.zero_stage != 3:
        return {}
    return zero3_gathered(args, zero_sizes(cfg)["param_persistence_threshold"], cfg.distributed.max_reuse_distance, tp, ep)


def _zero_traffic(cfg: Config, args: ModelArgs, local: int, world: int, k: int, p: int, g: int, node: int,
                  hpz: bool, tp: int, ep: int) -> tuple[float, float]:
    """ZeRO's (within a node, across nodes) bytes per GPU per step; under expert parallelism the
    routed experts' apart: a rank's E/ep of them over the world/ep ranks that hold the same ones
    (its expert-data-parallel group: every ep-th rank, node/ep of them on a node)."""
    z, stage = _zero3_gathers(cfg, args, tp, ep), cfg.distributed.zero_stage
    if ep == 1:
        return zero_traffic(local, stage, world, k, p, g, node, hpz, **z)
    experts = expert_params(args)
    if stage < 3:  # (ZeRO-1/2: the experts' gradients reduced, their weights gathered, over their group)
        intra, inter = zero_traffic(local - experts, stage, world, k, p, g, node, hpz)
        e_intra, e_inter = zero_traffic(experts // ep, stage, world // ep, k, p, g, max(node // ep, 1), False)
        return intra + e_intra, inter + e_inter
    threshold, reuse = zero_sizes(cfg)["param_persistence_threshold"], cfg.distributed.max_reuse_distance
    gathered = zero3_expert_gathers(args, threshold, reuse, ep)
    intra, inter = zero_traffic(local - experts, 3, world, k, p, g, node, hpz, z["gathered"] - gathered, z["persistent"])
    e_intra, e_inter = zero_traffic(experts // ep, 3, world // ep, k, p, g, max(node // ep, 1), False, gathered)
    return intra + e_intra, inter + e_inter


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
    if a.precision not in ("bf16", "fp16", "fp32", "fp8"):
        raise ConfigError(f"precision {a.precision!r}: one of bf16, fp16, fp32, fp8")
    if a.fp8_speedup < 0:
        raise ConfigError(f"--fp8-speedup={a.fp8_speedup:g} must be > 0 (0 = the recipe's)")
    fp8 = a.precision == "fp8"
    cfg = dataclasses.replace(cfg, model=args)  # (every check on the model estimated: an HF model's config.json)
    if fp8 and cfg.train.precision != "fp8":  # (--precision fp8: the layouts fp8 refuses are refused)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision="fp8"))
    if cfg.problems():
        raise ConfigError(cfg.problems())
    precision = "bf16" if fp8 else a.precision  # what DeepSpeed runs (fp8: bf16, float8 matmuls in the model)
    p = {"bf16": 2, "fp16": 2, "fp32": 4}[precision]
    g = 4 if precision == "fp32" or (precision == "bf16" and cfg.distributed.grad_dtype == "fp32") else 2
    n_total, n_non_emb = num_params(args), num_params(args, non_embedding=True)
    fpt = flops_per_token(args, cfg.data.seq_len)
    # Local layers count twice their causal band of keys per query (flops_per_token): the step time below follows;
    # their activations do not change (memory.activation_bytes: no T x T term on the GPU path).
    local = sum(bool(args.layer_window(i)) for i in range(args.n_layers))
    window = {"local_layers": local, "layers": args.n_layers, "sliding_window": args.sliding_window,
              "flops_vs_full": fpt / flops_per_token(dataclasses.replace(args, sliding_window=0, layer_pattern=[]),
                                                     cfg.data.seq_len)} if local else None
    stage, t, d = cfg.distributed.zero_stage, cfg.train, cfg.distributed
    sequences = cfg.global_batch(a.gpus // (d.sequence_parallel * d.tensor_parallel))
    tokens_per_step = sequences * cfg.data.seq_len
    micro_tokens = t.micro_batch_size * cfg.data.seq_len  # whole sequences, split over a sequence-parallel group
    muon = cfg.optimizer.name == "muon"
    bucket = d.reduce_bucket_size or args.dim**2
    flops_s = a.peak_tflops * 1e12 * a.mfu  # FLOP/s assumed, Newton-Schulz's matmuls too
    # fp8: the converted linears' FLOPs per token (forward 2, backward 4 per weight) run `speedup` faster
    fp8_flops = 6 * sum(float8_block_params(args, i) for i in range(args.n_layers)) if fp8 else 0
    speedup = (a.fp8_speedup or FP8_SPEEDUP[cfg.train.fp8_recipe]) if fp8 else 1.0

    def at(world: int, sp: int = d.sequence_parallel, tp: int = d.tensor_parallel, hpz: bool = d.hpz,
           ep: int = d.expert_parallel) -> dict:
        dp = world // (sp * tp)  # sequence- or tensor-parallel groups: each reads its own micro-batches
        if world % (sp * tp) or world % ep or sequences % (t.micro_batch_size * dp):
            raise ConfigError(f"the global batch of {sequences} sequences does not split over {world} GPUs")
        k = sequences // (t.micro_batch_size * dp)
        hpz = hpz and stage == 3
        # A tensor-parallel rank holds 1/tp of the block matrices and all of the rest; ZeRO shards
        # what it holds over the ranks that hold the same slice (a sequence-parallel group's too).
        local, zero_world = tensor_parallel_params(args, n_total, tp), world // tp
        opt = muon_step(args, stage, world, bucket, g, cfg.optimizer.muon_ns_method, ep) if muon else None
        copied = local  # (the parameters whose gradients DeepSpeed's plain all-reduce flattens into a copy)
        if ep > 1 and stage < 3:  # each rank holds its E/ep experts, their states sharded over world/ep ranks
            experts = expert_params(args)
            copied = local - experts  # (the experts' own group is one flat buffer: reduced in place)
            dense = model_state_bytes(local - experts, stage, zero_world, precision, d.grad_dtype)
            mine = model_state_bytes(experts // ep, stage, zero_world // ep, precision, d.grad_dtype)
            states = {key: dense[key] + mine[key] for key in dense}
        else:
            states = model_state_bytes(local, stage, zero_world, precision, d.grad_dtype, largest_layer_params(args, tp),
                                       opt["params"] if muon else 0)
        if hpz:  # the secondary partition: the 16-bit weights over the node's GPUs
            states["hpz_secondary"] = p * local / min(a.gpus_per_node, zero_world)
        acts = activation_bytes(args, micro_tokens, p, t.activation_checkpointing, t.loss_chunk_tokens, sp,
                                t.mlp_chunk_tokens, tp)
        buffers = allreduce_copy_bytes(copied, stage, precision, d.grad_dtype)
        if stage > 0:
            buffers += (d.reduce_bucket_size or args.dim**2) * 4 + (
                (d.prefetch_bucket_size or int(0.9 * args.dim**2)) * p if stage == 3 else 0)
        memory = {**states, "activations": acts["saved"] + acts["peak_extra"], "buffers": buffers}
        if fp8:
            memory["fp8_saved_weights"] = float8_saved_weight_bytes(args, p, t.activation_checkpointing, stage)
        if muon:
            memory["optimizer_step"] = opt["transient"]
        # The embedding and the head are whole on every rank of a tensor-parallel group, so each
        # computes the head's matmuls (6 V D per token) for the group's tokens.
        head_again = (tp - 1) * 6 * args.vocab_size * args.dim
        compute_s = (fpt + head_again - fp8_flops * (1 - 1 / speedup)) * tokens_per_step / (world * flops_s)
        # ZeRO's groups are the ranks holding one tensor-parallel slice: a node holds
        # gpus_per_node / tp of each.
        intra, inter = _zero_traffic(cfg, args, local, zero_world, k, p, g, max(a.gpus_per_node // tp, 1), hpz, tp, ep)
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
        recomputed = checkpointed_blocks(args, t.activation_checkpointing)
        exchange = sequence_exchange_bytes(args, micro_tokens, p, sp)
        a2a = k * (2 * args.n_layers + recomputed) * exchange
        a2a_s = a2a / (a.sp_gbps * 1e9 / 8)
        # Expert parallelism: the tokens' rows to their experts and back in every MoE block, the same
        # in backward and in a checkpointed block's recomputation; within a node where the group
        # fits in one.
        moe_recomputed = sum(args.is_moe_layer(i) for i in range(args.n_layers)
                             if t.activation_checkpointing and i % t.activation_checkpointing == 0)
        dispatch = expert_exchange_bytes(args, micro_tokens // sp, p, ep)
        ep_bytes = k * (2 * args.moe_layers + moe_recomputed) * dispatch
        ep_s = ep_bytes / ((a.sp_gbps if ep <= a.gpus_per_node else a.gbps) * 1e9 / 8)
        # Tensor parallelism: the same, its all-reduces wait for the matmul before them and the next
        # one waits for them; 7 per block and 1 per recomputed block (TP_ALLREDUCES).
        allreduce = tensor_parallel_bytes(args, micro_tokens, p, tp)
        per_block = TP_ALLREDUCES["forward"] + TP_ALLREDUCES["backward"]
        tp_bytes = k * (per_block * args.n_layers + TP_ALLREDUCES["recomputation"] * recomputed) * allreduce
        tp_s = tp_bytes / (a.sp_gbps * 1e9 / 8)
        step_s = max(compute_s, comm_s) + a2a_s + tp_s + opt_s + ep_s
        # The optimizer step's transient comes after backward has freed the activations: the larger counts.
        total_gib = (sum(memory.values()) - min(memory["activations"], memory.get("optimizer_step", 0))) / GIB
        extra = {"muon": {"params": opt["params"], "ns_flops_per_gpu": opt["flops"],
                          "ns_flops_total": opt["flops_total"], "ns_s": opt["flops"] / flops_s,
                          "step_comm_gib_per_gpu": opt["comm"] / GIB,
                          "step_comm_s": opt["comm"] / (muon_gbps * 1e9 / 8), "step_comm_gbps": muon_gbps,
                          "allreduced_params": allreduced}} if muon else {}
        return {"gpus": world, "sequence_parallel": sp, "tensor_parallel": tp, "expert_parallel": ep, "hpz": hpz,
                "data_parallel": dp, "expert_all_to_all_mib_per_block": dispatch / 2**20,
                "expert_all_to_all_gib_per_gpu": ep_bytes / GIB, "expert_all_to_all_s": ep_s,
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
        "params": n_total, "params_non_embedding": n_non_emb, "params_active": num_params(args, active=True),
        "flops_per_token": fpt, "window": window,
        "tokens_per_step": tokens_per_step, "steps": t.max_steps, "tokens_total": tokens_per_step * t.max_steps,
        "flops_total": fpt * tokens_per_step * t.max_steps, "zero_stage": stage, "seq_len": cfg.data.seq_len,
        "assumptions": vars(a), "sequence_parallel": d.sequence_parallel, "tensor_parallel": d.tensor_parallel,
        "expert_parallel": d.expert_parallel,
        "hpz": d.hpz and stage == 3, "optimizer": cfg.optimizer.name, "scaling": scaling, "fit_hint": fit_hint(cfg),
        "kv_replication": kv_replication(args.kv_heads, d.sequence_parallel),
        "activation_checkpointing": t.activation_checkpointing > 0,
        "sequence_parallel_table": by_sp, "sequence_parallel_needed": needed,
        "sequence_parallel_max": args.n_heads,
        "parallel_options": options, "not_listed": not_listed, "recommended": recommended and recommended["option"],
        "fp8": {"recipe": cfg.train.fp8_recipe, "speedup": speedup, "matmul_share": fp8_flops / fpt} if fp8 else None,
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
    layouts = [(f"ZeRO-{stage}", 1, False, 1)] + [("ZeRO-3 + hpZ", 1, True, 1)] * hpz_too
    for n in _tp_sizes(args, a.gpus_per_node):
        if a.gpus % n == 0:
            layouts += [(f"TP {n} + ZeRO-{stage}", n, False, 1)] + [(f"TP {n} + ZeRO-3 + hpZ", n, True, 1)] * hpz_too
    # A Mixture-of-Experts: expert parallelism over each size that divides the experts and the GPUs
    layouts += [(f"EP {n} + ZeRO-{stage}", 1, False, n) for n in range(2, args.moe_experts + 1)
                if args.moe_experts % n == 0 and a.gpus % n == 0]
    rows, not_listed = [], {}
    for name, tp, hpz, ep in layouts:
        layout = _with_layout(cfg, tensor_parallel=tp, hpz=hpz, expert_parallel=ep)
        if layout.problems():
            not_listed[name] = layout.problems()[0]
            continue
        overrides = {f"distributed.{k}": v for k, v in (("tensor_parallel", tp), ("hpz", hpz), ("expert_parallel", ep))
                     if getattr(d, k) != v}
        row = {"option": name, "overrides": overrides}
        problems = layout.problems(a.gpus)
        if problems:
            row["error"] = problems[0]
        else:
            row.update(at(a.gpus, d.sequence_parallel, tp, hpz, ep))
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
    m = e["muon"]
    return (f"Muon step (once per step, after backward, not overlapped): Newton-Schulz "
            f"{m['ns_flops_per_gpu'] / 1e12:.3g} TFLOPs on the busiest GPU "
            f"({m['ns_flops_total'] / 1e12:.3g} over all), {m['ns_s']:.3g} s; {m['step_comm_gib_per_gpu']:.3g} GiB "
            "of gradient, momentum and update slices sent per GPU (all-to-all), "
            f"{m['step_comm_s']:.3g} s at {m['step_comm_gbps']:g} Gbit/s; {e['optimizer_step_s']:.3g} s = "
            f"{e['optimizer_step_s'] / e['step_s']:.0%} of the step. {m['params'] / 1e6:,.1f}M parameters on Muon"
            + (f"; reduce_scatter: false all-reduces the gradients of the {m['allreduced_params'] / 1e6:,.1f}M "
               "parameters that fit a reduce bucket" if e["zero_stage"] == 3 else ""))


def _window_text(e: dict) -> str:
    w = e["window"]
    if not w:
        return ""
    return (f"; sliding window of {w['sliding_window']:,} tokens in {w['local_layers']} of {w['layers']} layers: "
            f"{w['flops_vs_full']:.2f}x the FLOPs per token of full attention at seq_len {e['seq_len']:,}")


def _fp8_line(e: dict) -> str:
    f = e["fp8"]
    saved = e["memory_parts_gib"].get("fp8_saved_weights", 0.0)
    return (f"fp8 ({f['recipe']}): the blocks' linears, {f['matmul_share']:.0%} of the FLOPs, at {f['speedup']:g}x "
            f"bf16's speed (assumed: --fp8-speedup); MFU is of bf16's peak"
            + (f"; {saved:.2f} GiB of gathered weights kept for backward (ZeRO-3)" if saved else ""))


def report(e: dict) -> str:
    a = e["assumptions"]
    muon = e["optimizer"] == "muon"
    sp = e["sequence_parallel"]
    split = f", each sequence split over {sp} GPUs" if sp > 1 else ""
    if e["tensor_parallel"] > 1:
        split = f", each block's matrices split over {e['tensor_parallel']} GPUs"
    hpz = " with hpZ" if e["hpz"] else ""
    run = f"run: {a['gpus']} GPU(s), ZeRO-{e['zero_stage']}{hpz}, {a['precision']}, {e['optimizer']}, "
    active = f", {e['params_active'] / 1e6:,.1f}M active per token" if e["params_active"] != e["params"] else ""
    model = (f"model: {e['params'] / 1e6:,.1f}M parameters ({e['params_non_embedding'] / 1e6:,.1f}M non-embedding"
             f"{active}), {e['flops_per_token'] / 1e9:.3f} GFLOPs per token (forward + backward, PaLM)"
             + _window_text(e))
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
        *([_fp8_line(e)] if e["fp8"] else []),
        _comm_line(e),
        *([e["comm_hint"]] if e["comm_hint"] else []),
        *([_a2a_line(e)] if sp > 1 else []),
        *([_tp_line(e)] if e["tensor_parallel"] > 1 else []),
        *([_ep_line(e)] if e["expert_parallel"] > 1 else []),
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


def _ep_line(e: dict) -> str:
    a, ep = e["assumptions"], e["expert_parallel"]
    where = f"{a['sp_gbps']:g} Gbit/s (within a node)" if ep <= a["gpus_per_node"] else f"{a['gbps']:g} Gbit/s"
    recompute = ", again in the recomputation" if e["activation_checkpointing"] else ""
    held = ("1/{ep} of the experts and gathers only those" if e["zero_stage"] == 3 else
            "1/{ep} of the experts whole, their optimizer state split over the {n} GPUs that hold the same ones")
    held = held.format(ep=ep, n=a["gpus"] // ep)
    return (f"expert parallelism over {ep} GPUs: each holds {held}; the tokens' "
            f"rows to their experts and back, {e['expert_all_to_all_mib_per_block']:.3g} MiB per GPU per MoE block per "
            f"micro-batch in forward, the same in backward{recompute}; {e['expert_all_to_all_gib_per_gpu']:.3g} GiB per "
            f"GPU per step, {e['expert_all_to_all_s']:.3g} s at {where} (not overlapped: in the step time)")


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
        "| layout | overrides | memory/GPU GiB | compute s | ZeRO comm s (in node + across, GiB) | TP all-reduce "
        "/ EP all-to-all s | step s | efficiency |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in e["parallel_options"]:
        overrides = " ".join(f"{k}={str(v).lower()}" for k, v in r["overrides"].items()) or "-"
        if "error" in r:
            lines.append(f"| {r['option']} | {overrides} | {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['option']} | {overrides} | {_memory_cell(r, a)} | {r['compute_s']:.3g} | "
                     f"{r['comm_s']:.3g} ({r['comm_intra_node_gib_per_gpu']:.3g} + "
                     f"{r['comm_inter_node_gib_per_gpu']:.3g}) | {r['tp_allreduce_s'] + r['expert_all_to_all_s']:.3g} | "
                     f"{r['step_s']:.3g} | "
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
