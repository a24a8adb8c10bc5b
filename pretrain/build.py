"""The parts of a run, each built from the config: tokenizer and model shape, data, model and
engine, loggers. pretrain/train.py calls them in order, with the start point in between."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from pretrain.config import Config, is_hf_model, moe_muon_bf16_problems
from pretrain.errors import ConfigError
from pretrain.hf import hub
from pretrain.metrics import JsonlLogger, Loggers, MetricLogger, WandbLogger
from pretrain.model.args import LOSS_FIELDS, MASK_FIELDS, RECIPE_FIELDS, ROPE_FIELDS, ModelArgs
from pretrain.parallel import distributed

log = logging.getLogger(__name__)


def resolve_model(cfg: Config):
    """(tokenizer, the config whose `model` is the one to train): the vocabulary from the tokenizer,
    a Hugging Face init_from's config.json with the run config's overrides, the end-of-text id. The
    start checks (Config.validate) and everything after them read this model."""
    tokenizer, args = tokenizer_and_model_args(cfg)
    return tokenizer, dataclasses.replace(cfg, model=args)


def tokenizer_and_model_args(cfg: Config):
    """(tokenizer, ModelArgs with the vocabulary size filled in from the tokenizer)."""
    import data_pipeline as dp

    tokenizer = dp.load_tokenizer(cfg.data.tokenizer)
    args = hf_model_args(cfg) if is_hf_model(cfg.checkpoint.init_from) else dataclasses.replace(cfg.model)
    if not args.vocab_size:
        args.vocab_size = dp.padded_vocab_size(tokenizer, args.vocab_multiple_of)
    elif args.vocab_size < tokenizer.get_vocab_size():
        if is_hf_model(cfg.checkpoint.init_from):  # the vocabulary is the model's: the tokenizer must fit it
            raise ConfigError(f"data.tokenizer={cfg.data.tokenizer} has {tokenizer.get_vocab_size()} tokens, more "
                              f"than the vocabulary of checkpoint.init_from={cfg.checkpoint.init_from} "
                              f"({args.vocab_size}): use the model's own tokenizer (data.tokenizer={cfg.checkpoint.init_from})")
        raise ConfigError(f"model.vocab_size={args.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.get_vocab_size()} tokens: set it to 0 to derive it")
    if args.document_mask and args.eot_id < 0:
        args.eot_id = dp.eot_id(tokenizer, cfg.data.eot_token)
    return tokenizer, args


# What defines the architecture, as effective values. model.max_seq_len and the RoPE settings
# (ROPE_FIELDS: the RoPE table, no weight) may be set freely: a longer context, a larger rope_theta.
_ARCH = {"dim": "dim", "n_layers": "n_layers", "n_heads": "n_heads", "kv_heads": "n_kv_heads",
         "hidden_dim": "ffn_hidden_dim", "vocab_size": "vocab_size", "norm_eps": "norm_eps",
         "tie_embeddings": "tie_embeddings", "moe_experts": "moe_experts", "moe_top_k": "moe_top_k",
         "moe_expert_hidden_dim": "moe_hidden_dim", "moe_shared_experts": "moe_shared_experts",
         "moe_dense_layers": "moe_dense_layers", "moe_router": "moe_router", "moe_norm_topk": "moe_norm_topk",
         "head_dim": "head_size", **{f: f for f in RECIPE_FIELDS if f != "head_size"}}


def hf_model_args(cfg: Config) -> ModelArgs:
    """The model of `checkpoint.init_from`, a Hugging Face model: its config.json defines it. The
    fields the run config's `model:` section sets are applied on top: the RoPE settings and
    max_seq_len replace config.json's (continuing at a longer context), and the document masking
    fields (MASK_FIELDS) and the loss weights (LOSS_FIELDS: an MoE's balancing, the output z-loss),
    which config.json does not hold, are the run config's; any other change of
    the architecture is an error, not silently mixed."""
    if cfg.model.parametrization != "sp":
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from} is a Hugging Face model, whose "
                          f"weights are in the standard parametrization: fine-tune it with "
                          f"model.parametrization=sp (not {cfg.model.parametrization})")
    path = hub.resolve(cfg.checkpoint.init_from)
    args, default = hub.model_args(path), ModelArgs()
    user = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(ModelArgs)
            if f.name != "max_seq_len" and getattr(cfg.model, f.name) != getattr(default, f.name)}
    if {"multiple_of", "ffn_dim_multiplier"} & user.keys():  # the user's SwiGLU rule, not config.json's width
        user.setdefault("ffn_hidden_dim", 0)
    merged = dataclasses.replace(args, **user)
    differ = [f"model.{field}={getattr(merged, prop)} (config.json: {getattr(args, prop)})"
              for prop, field in _ARCH.items() if getattr(merged, prop) != getattr(args, prop)
              and (prop != "head_dim" or "head_size" in user)]  # (a width alone changes the derived head_dim)
    if differ:
        raise ConfigError(f"checkpoint.init_from={cfg.checkpoint.init_from}: the model is defined by "
                          f"{path / 'config.json'}, and the run config differs in " + ", ".join(differ)
                          + ": remove these from the model section (or make them match)")
    if cfg.model.max_seq_len != default.max_seq_len:
        args.max_seq_len = cfg.model.max_seq_len
    return dataclasses.replace(args, **{f: getattr(merged, f) for f in ROPE_FIELDS + MASK_FIELDS + LOSS_FIELDS
                                        if f != "max_seq_len"})


def data(cfg: Config, tokenizer, env: distributed.Dist):
    """(training loader of this rank, this rank's fixed validation batches)."""
    import data_pipeline as dp

    # A sequence-parallel group reads as one data-parallel rank; each rank keeps its slice (Trainer).
    loader = dp.build_loader(cfg.data, tokenizer, rank=env.dp_rank, world_size=env.dp_size,
                             micro_batch_size=cfg.train.micro_batch_size)
    val_batches = []
    if cfg.data.validation:
        val_batches = dp.build_validation_batches(
            cfg.data, tokenizer, rank=env.dp_rank, world_size=env.dp_size,
            micro_batch_size=cfg.train.micro_batch_size,
            n_batches=cfg.train.eval_batches * cfg.grad_accum(env.dp_size))
    return loader, val_batches


def engine(cfg: Config, args: ModelArgs, env: distributed.Dist, precision: str, init_weights_from: Path | None):
    """The DeepSpeed engine over a freshly built model (ZeRO-3: built partitioned), initialised from
    the seed or, for fine-tuning, with the weights of `init_weights_from`. Returns (engine,
    DeepSpeed config)."""
    from pretrain.checkpoint.weights import load_weights
    from pretrain.parallel.parallelize import apply_compile, build_engine, build_model, deepspeed_config

    launcher_stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if launcher_stage and int(launcher_stage) != cfg.distributed.zero_stage:
        log.info("note: the accelerate config says zero_stage %s; this run uses distributed.zero_stage=%d "
                 "from the run config", launcher_stage, cfg.distributed.zero_stage)
    if moe_muon_bf16_problems(cfg, precision):  # (train.precision=auto, resolved to bf16 on this device)
        raise ConfigError(moe_muon_bf16_problems(cfg, precision))
    ds_config = deepspeed_config(cfg, env.world_size, precision, env.local_size)
    model = build_model(args, cfg, ds_config, seed=cfg.train.seed)
    if init_weights_from is not None:
        load_weights(model, init_weights_from, env, zero3=cfg.distributed.zero_stage == 3)
    if env.ep > 1:  # (after the whole experts are initialised or loaded: the same weights as one rank's)
        from pretrain.parallel.expert_parallel import shard_experts

        shard_experts(model, env, zero3=cfg.distributed.zero_stage == 3)
    if cfg.train.precision == "fp8":  # (after zero.Init partitioned the linears: the same Parameters, swapped modules)
        from pretrain.model.float8 import convert

        convert(model, cfg.train.fp8_recipe, cfg.train.fp8_emulate)
    engine = build_engine(model, cfg, ds_config, env.device)
    if cfg.train.compile:
        apply_compile(engine, cfg.distributed.zero_stage)
    return engine, ds_config


def loggers(cfg: Config, env: distributed.Dist, run_dir: Path, run_id: str, start_step: int,
            wandb_config: dict) -> MetricLogger:
    """Rank 0: metrics.jsonl (rewound to `start_step`, so a resume from an older checkpoint does not
    repeat steps) and W&B (run id = the run's id, so a resumed run continues its W&B run).
    Other ranks: the no-op logger."""
    if not env.is_main:
        return MetricLogger()
    out: list[MetricLogger] = [JsonlLogger(run_dir, keep_until_step=start_step)]
    lg = cfg.logging
    if lg.wandb != "disabled":
        out.append(WandbLogger(run_dir, lg.wandb, lg.project, lg.entity, lg.name, wandb_config, run_id=run_id,
                               group=lg.group))
    return Loggers(out)


def model_args(cfg: Config) -> ModelArgs:
    """The model shape with its vocabulary size: a Hugging Face init_from's config.json, or the config's
    model with the vocabulary from its tokenizer if it is not set."""
    if is_hf_model(cfg.checkpoint.init_from):
        return hf_model_args(cfg)
    if cfg.model.vocab_size:
        return cfg.model
    from data_pipeline.errors import DataError

    try:
        return tokenizer_and_model_args(cfg)[1]
    except DataError as e:
        raise ConfigError(f"{e} (or set model.vocab_size=N to estimate without the tokenizer)") from None
