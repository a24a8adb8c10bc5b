"""Everything that makes the plain model distributed lives here: the DeepSpeed config generated from
ours, building the model already partitioned (ZeRO-3), activation checkpointing, the engine."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from pretrain.config import Config, zero_sizes
from pretrain.model.args import ModelArgs
from pretrain.model.model import Transformer
from pretrain.optim.optimizer import build_optimizer
from pretrain.parallel import distributed, ulysses


def resolve_precision(cfg: Config, device: torch.device) -> str:
    """The precision DeepSpeed runs: train.precision, auto resolved for the device, fp8 as bf16 (its
    float8 matmuls are the model's: pretrain/model/float8.py), checked against the device."""
    from pretrain.errors import ConfigError

    if cfg.train.precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16 needs CUDA GPUs (DeepSpeed has no fp16 on CPU): use bf16 or fp32")
    if cfg.train.precision == "fp8":
        fp8_check(cfg, device)
        return "bf16"
    if cfg.train.precision != "auto":
        return cfg.train.precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def fp8_check(cfg: Config, device: torch.device) -> None:
    """train.precision=fp8 needs torchao, and float8 GEMMs (compute capability 8.9: Ada, Hopper,
    Blackwell) unless emulated."""
    from pretrain.errors import ConfigError
    from pretrain.model.float8 import import_torchao

    try:
        import_torchao()
    except ImportError:
        raise ConfigError("train.precision=fp8 needs torchao: pip install -e '.[fp8]'") from None
    if cfg.train.fp8_emulate:
        return
    if device.type != "cuda":
        raise ConfigError(f"train.precision=fp8 needs CUDA GPUs with float8 matmuls (compute capability >= 8.9), "
                          f"not {device.type}: set train.fp8_emulate=true to run its arithmetic emulated (slow)")
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ConfigError(f"train.precision=fp8 needs float8 matmuls (compute capability >= 8.9: H100, H200, L40S, "
                          f"B200), and {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: "
                          "use precision=bf16")


def trainer_clips(cfg: Config, precision: str) -> bool:
    """ZeRO stage 0 in fp32 has no DeepSpeed optimizer wrapper: DeepSpeed would compute the gradient
    norm to clip and throw it away, and the trainer needs it to find non-finite steps. The trainer
    then clips itself, with the one norm it computes (every other setup: DeepSpeed clips)."""
    return cfg.distributed.zero_stage == 0 and precision == "fp32"


def grad_norm(params: list, split: set[int]) -> torch.Tensor:
    """The whole model's gradient L2 norm where the trainer clips (ZeRO stage 0: each rank holds its
    parameters' full, data-parallel averaged gradients), as a device tensor. Under tensor
    parallelism the parameters whose ids are in `split` are this rank's slices: their squares are
    summed over the tensor-parallel group; the rest (embedding, norms, head) hold the same gradient
    on every rank of the group and count once. Every rank gets the same norm, so the clip factor,
    the non-finite check and the spike check agree across the group."""
    norm = torch.nn.utils.get_total_norm
    if not split:
        return norm([p.grad for p in params])
    whole = [p.grad for p in params if id(p) not in split]
    sliced = norm([p.grad for p in params if id(p) in split]).float() ** 2
    total = distributed.all_reduce(sliced, group=distributed.tensor_group())
    return (total + norm(whole).float() ** 2).sqrt() if whole else total.sqrt()


def muon_clips_itself(cfg: Config, precision: str) -> bool:
    """Muon at ZeRO 1-3: DeepSpeed takes the gradient norm after Newton-Schulz, over the Muon updates
    (stage3.py:2885; stage_1_and_2.py orthogonalises while it flattens the gradient partitions), and
    would clip those (tiny model: norm 31 where the gradient's is 0.77, every Muon step divided by
    31). The engine's optimizer is wrapped instead (muon_at_zero3, muon_at_zero12) and DeepSpeed
    told not to clip. Not DeepSpeed's bf16 optimizer (bf16 at stage 1 with fp32 gradients): it
    clips the gradients before Newton-Schulz itself (muon_at_bf16)."""
    return cfg.optimizer.name == "muon" and engine_zero_stage(cfg, precision) > 0 \
        and not cfg.distributed.offload_optimizer and not bf16_optimizer(cfg, precision)


def bf16_optimizer(cfg: Config, precision: str) -> bool:
    """Whether DeepSpeed runs its BF16_Optimizer (engine.py, _do_optimizer_sanity_check): bf16 at
    ZeRO-1 (ours at 0 too) with fp32 gradient accumulation, no offload."""
    return precision == "bf16" and engine_zero_stage(cfg, precision) == 1 and cfg.distributed.grad_dtype == "fp32" \
        and not cfg.distributed.offload_optimizer


def muon_at_bf16(opt) -> None:
    """DeepSpeed's bf16 optimizer clips the raw gradients, then orthogonalises and commits the new
    momentum (_prepare_muon_updates, bf16_optimizer.py:436), then runs the inner step, which is all
    the trainer's guard can drop. The orthogonalisation moves into the inner step: a dropped update
    leaves the momentum."""
    prepare, inner = opt._prepare_muon_updates, opt.optimizer
    inner_step = inner.step

    def step(*args, **kwargs):
        prepare()
        return inner_step(*args, **kwargs)

    opt._prepare_muon_updates = lambda: None
    inner.step = step


def muon_at_zero3(zero, clip: float) -> None:
    """Two corrections to DeepSpeed's Muon at ZeRO-3 (`zero`: its stage-3 optimizer, whose step calls
    _apply_muon_to_accumulated_grads, then _get_norm_groups, then the inner optimizer's step per
    sub-group, then _post_step; stage3.py:2873-2940):

    - Clip the gradients, not the Muon updates, as torch.optim.Muon after clip_grad_norm_ and
      Moonshot do, and report their norm (what the trainer's guard, the spike detector and the logs
      read). Newton-Schulz is scale-invariant, so the clip only changes how much of this step's
      gradient enters the momentum.
    - A dropped update leaves the momentum as it was. DeepSpeed folds the gradient into Muon's
      momentum before the inner step, which is all the trainer's guard can drop; the momentum
      partitions are copied before and put back when no inner step ran (4 bytes per Muon
      parameter / world size, for the step).

    And the orthogonalisation itself is ours (pretrain/optim/muon.py zero3_step): each Muon matrix has one
    owner rank, which gathers its gradient and momentum by an all-to-all, runs DeepSpeed's
    muon_update and sends the slices back, in place of DeepSpeed's round robin per bucket."""
    from deepspeed.runtime.utils import combine_grad_norm_groups

    from pretrain.optim.muon import zero3_step

    norm_groups, post_step, inner = zero._get_norm_groups, zero._post_step, zero.optimizer
    plan: dict = {}  # owners and batches, kept between steps

    def apply():  # ours, not DeepSpeed's (its round robin per bucket leaves Newton-Schulz to rank 0: pretrain/optim/muon.py)
        if zero.offload_optimizer or zero.save_muon_momentum_buffer_in_memory or any(
                zero._swappable_optimizer_subgroup(i) for i, m in enumerate(zero.sub_groups_using_muon) if m):
            raise ValueError("Muon's ZeRO-3 step (pretrain/optim/muon.py) keeps its momentum on the device: no offload")
        zero3_step(zero, plan)
    inner_step = inner.step
    raw, saved, ran = [], {}, [False]

    def momenta() -> dict:
        return {i: zero.optimizer.state.get(zero.fp32_partitioned_groups_flat[i], {}).get("momentum_buffer")
                for i, muon in enumerate(zero.sub_groups_using_muon) if muon}

    def restore():
        """Put the momenta back if the last step's update was dropped (also where DeepSpeed itself
        returned before _post_step, on an invalid norm)."""
        if saved and not ran[0]:
            for i, m in momenta().items():
                if m is not None:
                    m.copy_(saved[i]) if saved[i] is not None else m.zero_()
        saved.clear()

    def clip_then_apply():
        restore()
        groups = [zero.get_grad_norm_direct(zero.averaged_gradients[i], zero.fp16_groups[i])
                  for i in range(len(zero.fp16_groups))]
        if clip > 0:  # (as DeepSpeed's unscale_and_clip_grads; no host sync)
            norm = combine_grad_norm_groups(groups) / zero.loss_scale
            factor = torch.clamp((norm + 1e-6) / clip, min=1.0)
            for parts in zero.averaged_gradients.values():
                for part in parts:
                    part.div_(factor)
        raw[:] = groups
        saved.clear()
        saved.update({i: None if m is None else m.clone() for i, m in momenta().items()})
        ran[0] = False
        apply()

    def gradient_norm_groups():
        if not raw:
            return norm_groups()
        out = list(raw)
        raw.clear()
        return out

    def step(*args, **kwargs):
        ran[0] = True
        return inner_step(*args, **kwargs)

    def restore_then_post_step(*args, **kwargs):
        restore()
        return post_step(*args, **kwargs)

    zero._apply_muon_to_accumulated_grads = clip_then_apply
    zero._get_norm_groups = gradient_norm_groups
    zero._post_step = restore_then_post_step
    inner.step = step


def muon_at_zero12(zero, clip: float) -> None:
    """The same two corrections at ZeRO-1/2 (`zero`: DeepSpeed's stage-1/2 optimizer). There DeepSpeed
    orthogonalises inside get_flat_partition, as it cuts each group's reduced gradients into this
    rank's partition at the accumulation boundary (stage_1_and_2.py:2749), before any norm is known;
    step() then takes the norm over the updates, clips them, and commits the momentum staged by the
    orthogonalisation before the inner step (so a dropped update keeps it).

    Here the cut of a Muon group keeps the raw gradient (and the group's full gradients, which the
    partition views anyway); when step() asks for the norm, it gets the raw gradients' norm, every
    gradient is clipped by it, and only then does DeepSpeed's own cut orthogonalise the Muon
    groups (from the clipped full gradients, staging the momentum from the committed one). The
    commit waits for the inner step."""
    cut, norm, commit, inner = zero.get_flat_partition, zero.scaled_global_norm, zero._commit_muon_momentum, zero.optimizer
    inner_step = inner.step
    pending: dict[int, tuple] = {}  # Muon group -> (its cut's arguments, its full gradients)
    uncommitted = [False]

    def raw_cut(tensor_list, first_offset, partition_size, dtype, device, param_group_idx, return_tensor_list=False):
        args = (tensor_list, first_offset, partition_size, dtype, device, param_group_idx, return_tensor_list)
        if not zero._is_muon_group(tensor_list):
            return cut(*args)
        pending[param_group_idx] = (args, list(zero.all_grad_tensors[param_group_idx]))
        for p in tensor_list:  # (DeepSpeed's cut orthogonalises the tensors flagged use_muon)
            p.use_muon = False
        try:
            return cut(*args)
        finally:
            for p in tensor_list:
                p.use_muon = True

    def clip_then_orthogonalise():
        zero.groups_lacking_loss_scale.difference_update(pending)  # (raw gradients carry the loss scale)
        total = norm()
        if clip > 0:  # (as DeepSpeed's unscale_and_clip_grads)
            factor = torch.clamp((total / zero.loss_scale + 1e-6) / clip, min=1.0)
            for i, parts in zero.averaged_gradients.items():
                if i not in pending and parts is not None:
                    for part in parts:
                        part.div_(factor)
            for _, full in pending.values():
                for grad in full:
                    grad.div_(factor)
        for i, (args, full) in pending.items():
            zero.all_grad_tensors[i] = full
            zero.averaged_gradients[i] = cut(*args)
            zero.all_grad_tensors[i] = None
        pending.clear()
        return total

    def commit_later():
        uncommitted[0] = True

    def step(*args, **kwargs):
        if uncommitted[0]:
            commit()
            uncommitted[0] = False
        return inner_step(*args, **kwargs)

    zero.get_flat_partition = raw_cut
    zero.scaled_global_norm = clip_then_orthogonalise
    zero._commit_muon_momentum = commit_later
    inner.step = step


def engine_zero_stage(cfg: Config, precision: str) -> int:
    """The ZeRO stage the engine runs: the configured one, except that bf16 at stage 0 runs as stage
    1. DeepSpeed's stage-0 bf16 path (FP16_UnfusedOptimizer) accumulates gradients in bf16 and checks
    every parameter for overflow on the host: 44 host syncs per step (bench/bench_host_syncs.py).
    Stage 1 is DeepSpeed's bf16 optimizer: fp32 gradient accumulation, 2 syncs; on one device it
    shards nothing and holds an fp32 copy of every gradient (20 bytes of model states per parameter
    against 16), on several it shards the optimizer state."""
    stage = cfg.distributed.zero_stage
    return 1 if stage == 0 and precision == "bf16" else stage


def deepspeed_config(cfg: Config, world_size: int, precision: str, local_size: int = 1) -> dict:
    """The DeepSpeed JSON for this run, from our config: no "auto" values, nothing left to defaults
    that matter (DeepSpeed's gradient_clipping default is 1.0, so it is always written).
    `local_size`: the ranks per node (hpZ's secondary partition spans them).

    DeepSpeed is not told of sequence parallelism: to it every rank is a data-parallel rank with
    micro-batches of its own, ZeRO shards over all of them and averages their gradients, the same at
    every stage. (Its own Ulysses support, an `mpu`, sums the gradients of a sequence group at ZeRO
    1-2 and at ZeRO-3's contiguous reduce, but averages them in ZeRO-3's reduce-scatter: half the
    gradient at N = 2.) What makes the average right is the loss: each rank of a group divides its
    summed loss by the group's labels per rank (data_pipeline.sequence_shard), so the mean of the
    group's losses is the mean over all its tokens."""
    d, sizes = cfg.distributed, zero_sizes(cfg)
    dp_size = world_size // (d.sequence_parallel * d.tensor_parallel)
    zero: dict = {"stage": engine_zero_stage(cfg, precision), "overlap_comm": d.overlap_comm,
                  "contiguous_gradients": True,
                  "reduce_bucket_size": sizes["reduce_bucket_size"]}
    if d.zero_stage == 3:
        zero.update(stage3_param_persistence_threshold=sizes["param_persistence_threshold"],
                    stage3_prefetch_bucket_size=sizes["prefetch_bucket_size"],
                    stage3_max_reuse_distance=d.max_reuse_distance,
                    stage3_gather_16bit_weights_on_model_save=False)
    if d.hpz:  # ZeRO++: a second copy of the 16-bit weights sharded over each node's ranks
        zero["zero_hpz_partition_size"] = local_size
    if d.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if cfg.optimizer.name == "muon":
        # Muon orthogonalises whole matrices, so ZeRO all-reduces gradients and gathers each one
        # instead of reduce-scattering them; DeepSpeed refuses reduce_scatter with it (stage3.py:360).
        zero["reduce_scatter"] = False
    clip = 0.0 if trainer_clips(cfg, precision) or muon_clips_itself(cfg, precision) else cfg.optimizer.grad_clip
    return {
        # (micro x accumulation x ranks: DeepSpeed checks it against the whole world when it reads the
        # config, before its tensor-parallel groups exist)
        "train_batch_size": cfg.global_batch(dp_size) * d.sequence_parallel * d.tensor_parallel,
        "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum(dp_size),
        "gradient_clipping": clip,
        "zero_optimization": zero,
        "bf16": {"enabled": precision == "bf16"},
        **({"data_types": {"grad_accum_dtype": d.grad_dtype}, "communication_data_type": d.grad_dtype}
           if precision == "bf16" else {}),
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 16},
        **({"tensor_parallel": tensor_parallel_config(d.tensor_parallel)} if d.tensor_parallel > 1 else {}),
        "zero_allow_untested_optimizer": True,
        # Offloaded, the master weights and moments live in host memory and our torch AdamW steps
        # them there (fused on the CPU); DeepSpeed otherwise insists on its CPUAdam, a JIT-built op.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**12,  # we log ourselves
        "wall_clock_breakdown": False,
    }


# DeepSpeed AutoTP's partition of our blocks, by parameter name (nothing else is split): q, k, v and
# the SwiGLU's w1, w3 column-split (dim 0: each rank holds n_heads/size query heads and
# n_kv_heads/size key/value heads, contiguous, so GQA groups stay whole, and hidden_dim/size of the
# FFN units), wo and w2 row-split (dim 1), their outputs all-reduced over the tensor-parallel group.
# The embedding, the norms and the LM head stay whole on every rank of the group (ZeRO still shards
# them over the data-parallel ranks), so every rank computes the TP=1 model's loss.
TP_SPLITS = {"column": [r".*\.attention\.w[qkv]\.weight$", r".*\.feed_forward\.w[13]\.weight$"],
             "row": [r".*\.attention\.wo\.weight$", r".*\.feed_forward\.w2\.weight$"]}


def tensor_parallel_config(size: int) -> dict:
    """DeepSpeed's `tensor_parallel` section: AutoTP over `size` ranks with our partition (TP_SPLITS)."""
    return {"autotp_size": size, "partition_config": {"use_default_specs": False, "layer_specs": [
        {"patterns": patterns, "partition_type": kind} for kind, patterns in TP_SPLITS.items()]}}


def tensor_parallel_dim(name: str) -> int | None:
    """The dimension along which tensor parallelism splits parameter `name` (None: kept whole)."""
    import re

    for kind, patterns in TP_SPLITS.items():
        if any(re.match(p, name) for p in patterns):
            return 0 if kind == "column" else 1
    return None


def apply_activation_checkpointing(model: Transformer, every: int) -> None:
    """Recompute every `every`-th block's activations in backward instead of storing them (1 = all
    blocks, 0 = none). The block's forward is replaced in place rather than wrapped in a new module,
    so parameter names, and with them checkpoints and exports, do not depend on this setting."""
    if every <= 0:
        return
    for i, block in enumerate(model.layers):
        if i % every == 0:
            block.forward = functools.partial(_checkpointed_forward, block, block.forward)


def _checkpointed_forward(block: torch.nn.Module, forward, *args, **kwargs):
    if not block.training:
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def build_model(args: ModelArgs, cfg: Config, ds_config: dict, seed: int) -> Transformer:
    """Build and initialise the model. Under ZeRO-3 every parameter is partitioned as soon as its
    module is built (deepspeed.zero.Init), so a model larger than one device can start; weights are
    then initialised one group at a time, gathered, in the same order as without ZeRO, so the
    initial weights are the same for any world size."""
    import deepspeed

    torch.manual_seed(seed)
    if cfg.distributed.zero_stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds_config, data_parallel_group=distributed.data_parallel_group()):
            model = Transformer(args)
        model.reset_rope_table()  # zero.Init built it in bf16 (its patched constructors)
        for layer in model.moe_layers():  # and the routers' biases, which a step moves by ~1e-3
            layer.expert_bias = layer.expert_bias.float()
        model.init_weights(gather=lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=0))
    else:
        model = Transformer(args)
        model.init_weights()
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    for block in model.layers:
        block.feed_forward.chunk = cfg.train.mlp_chunk_tokens
    for layer in model.moe_layers():  # the balancing loss counts tokens over every rank's batch (DP x SP)
        layer.reduce_counts = distributed.all_reduce
    if cfg.distributed.sequence_parallel > 1:
        ulysses.apply(model, distributed.sequence_group(), cfg.distributed.sequence_parallel)
    return model


def build_engine(model: Transformer, cfg: Config, ds_config: dict, device: torch.device):
    """deepspeed.initialize with our optimizer (pretrain/optim/optimizer.py). No LR scheduler: the trainer sets each step's rate
    (pretrain/optim/schedule.py)."""
    import deepspeed

    from pretrain.parallel.expert_parallel import engine_with_experts, marked

    optimizer = build_optimizer(model, cfg.optimizer, device)
    with engine_with_experts(marked(model)):  # (expert parallelism at ZeRO-1/2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    zero = ds_config["zero_optimization"]
    if cfg.optimizer.name == "muon" and zero["stage"] > 0 and "offload_optimizer" not in zero:
        if hasattr(engine.optimizer, "_prepare_muon_updates"):  # (DeepSpeed's BF16_Optimizer: bf16_optimizer())
            muon_at_bf16(engine.optimizer)
        else:
            (muon_at_zero3 if zero["stage"] == 3 else muon_at_zero12)(engine.optimizer, cfg.optimizer.grad_clip)
    check_rope_table(engine.module)
    return engine


def check_rope_table(model: Transformer) -> None:
    """The table the engine trains with must be the fp32 one that eval, generate and the HF export
    rebuild from the weights, or they would run another model than the one trained. DeepSpeed has
    cast and built it in bf16 before (zero.Init's constructors, engine-level casts), so it is checked
    where training starts, not trusted."""
    for local, table in ((False, model.freqs_cis), (True, model.freqs_cis_local)):
        if table is None:
            continue
        expected = model.rope_table(table.device, local=local)
        if table.dtype != torch.float32 or not torch.equal(table, expected):
            error = (table.float() - expected).abs().max().item()
            raise RuntimeError(f"the RoPE table the engine holds is {table.dtype}, off the fp32 table by up to "
                               f"{error:.3g}: positions would be wrong")


def apply_compile(engine, zero_stage: int) -> None:
    """train.compile (compiles at the first step). ZeRO 0-2: the whole model through DeepSpeed's
    engine.compile(), one graph without breaks. ZeRO-3: each block and the LM head apart, as
    torchtitan does. DeepSpeed gathers and releases parameters in hooks on every submodule, kept out
    of graphs (torch.compiler.disable), so the model falls into pieces either way; per block it is
    fewer (tiny model with activation checkpointing: 3 graphs and 12 breaks against 5 and 22;
    bench/bench_compile_graphs.py, docs/performance.md).

    Under tensor parallelism the whole model's compile would also take in DeepSpeed's check that
    the ranks of a group read the same batch (a forward pre-hook on the module, run once:
    engine.py check_dataloader_inputs_same_across_ranks), whose code differs by rank: rank 0
    broadcasts its batch, the others compare theirs with torch.equal. Traced, it breaks the graph
    in different places on each rank, and the ranks' collectives (its all-reduce among them, traced
    as a functional collective) stop lining up: gloo aborts ("Received data size doesn't match").
    It runs eagerly instead (per block at ZeRO-3, it is never traced)."""
    if zero_stage < 3:
        eager_batch_check(engine)
        engine.compile()
        return
    for block in engine.module.layers:
        block.compile()
    engine.module.output.compile()


def eager_batch_check(engine) -> None:
    """Keep DeepSpeed's tensor-parallel batch check (a forward pre-hook on the module, present under
    tensor parallelism) out of the compiled module (torch.compiler.disable): apply_compile."""
    handle, hooks = getattr(engine, "first_dataloader_check", None), engine.module._forward_pre_hooks
    if handle is not None and handle.id in hooks:
        hooks[handle.id] = torch.compiler.disable(hooks[handle.id])
