"""Assembles a run from its config: tokenizer, data, model, engine, loggers, checkpoints, and the
resume or fine-tune start point. Order matters: the checkpoint to resume from decides the DeepSpeed
config (universal loading at another world size) and the W&B run id, so it is found first."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from pretrain import distributed
from pretrain.checkpoint import CheckpointManager, load_weights, resolve_checkpoint
from pretrain.config import Config
from pretrain.metrics import JsonlLogger, Loggers, MetricLogger, WandbLogger
from pretrain.model.model import flops_per_token, num_params
from pretrain.parallelize import build_engine, build_model, deepspeed_config, resolve_precision


def build_run(cfg: Config, env: distributed.Dist, stop):
    """Returns (Trainer, logger) ready to `fit()`; raises UserError subclasses for user mistakes."""
    import data_pipeline as dp
    from pretrain.trainer import Trainer

    run_dir = Path(cfg.train.run_dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    distributed.barrier()

    tokenizer = dp.load_tokenizer(cfg.data.tokenizer)
    model_args = dataclasses.replace(cfg.model)
    if not model_args.vocab_size:
        model_args.vocab_size = dp.padded_vocab_size(tokenizer, model_args.vocab_multiple_of)
    elif model_args.vocab_size < tokenizer.get_vocab_size():
        from pretrain.errors import ConfigError

        raise ConfigError(f"model.vocab_size={model_args.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.get_vocab_size()} tokens: set it to 0 to derive it")
    resolved = cfg.to_dict()
    resolved["model"]["vocab_size"] = model_args.vocab_size
    fingerprint = {"tokenizer": dp.tokenizer_fingerprint(tokenizer)}
    ckpt = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint, env, resolved, model_args, fingerprint,
                             tokenizer.to_str())

    resume = ckpt.resume_path()
    meta = None
    if resume is not None:
        t0 = time.perf_counter()
        meta = ckpt.verify(resume)
        verify_s = time.perf_counter() - t0
        ckpt.check_resumable(resume, meta)

    # The data comes before the model: a wrong source, tokenizer or resume position fails in
    # seconds, not after a large model has been built.
    loader = dp.build_loader(cfg.data, tokenizer, rank=env.rank, world_size=env.world_size,
                             micro_batch_size=cfg.train.micro_batch_size)
    if resume is not None:
        ckpt.load_data_position(resume, loader)
    val_batches = []
    if cfg.data.validation:
        val_batches = dp.build_validation_batches(
            cfg.data, tokenizer, rank=env.rank, world_size=env.world_size,
            micro_batch_size=cfg.train.micro_batch_size,
            n_batches=cfg.train.eval_batches * cfg.grad_accum(env.world_size))

    launcher_stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    if env.is_main and launcher_stage and int(launcher_stage) != cfg.distributed.zero_stage:
        print(f"note: the accelerate config says zero_stage {launcher_stage}; this run uses "
              f"distributed.zero_stage={cfg.distributed.zero_stage} from the run config", flush=True)
    precision = resolve_precision(cfg, env.device)
    ds_config = deepspeed_config(cfg, env.world_size, precision)
    if meta is not None and meta["world_size"] != env.world_size:
        ds_config["checkpoint"] = {"load_universal": True}
    init, init_meta, c = None, None, cfg.checkpoint
    if resume is None and c.init_from:  # fine-tuning: weights (and optionally more) from another run
        init = resolve_checkpoint(c.init_from)
        init_meta = ckpt.verify(init)
        if c.init_load_optimizer:
            ckpt.check_resumable(init, init_meta)
            if init_meta["world_size"] != env.world_size:
                ds_config["checkpoint"] = {"load_universal": True}
    model = build_model(model_args, cfg, ds_config, seed=cfg.train.seed)
    if init is not None and not c.init_load_optimizer:
        load_weights(model, init, env, zero3=cfg.distributed.zero_stage == 3)
    engine, _, _ = build_engine(model, cfg, ds_config, env.device)

    n_total, n_non_emb = num_params(model_args), num_params(model_args, non_embedding=True)
    fpt = flops_per_token(model_args, cfg.data.seq_len)
    logger: MetricLogger = MetricLogger()
    if env.is_main:
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
        (run_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2))
        loggers: list[MetricLogger] = [JsonlLogger(run_dir)]
        if cfg.logging.wandb != "disabled":
            lg = cfg.logging
            scaling = {"n_params": n_total, "n_params_non_embedding": n_non_emb, "flops_per_token": fpt,
                       "world_size": env.world_size, "precision": precision,
                       "tokens_per_step": cfg.global_batch(env.world_size) * cfg.data.seq_len}
            loggers.append(WandbLogger(run_dir, lg.wandb, lg.project, lg.entity, lg.name,
                                       {**resolved, "scaling": scaling},
                                       run_id=meta.get("wandb_run_id") if meta else None))
        logger = Loggers(loggers)
        print(f"model: {n_total / 1e6:.2f}M parameters ({n_non_emb / 1e6:.2f}M non-embedding), "
              f"{fpt / 1e6:.1f} MFLOPs/token | world size {env.world_size} | {precision} | "
              f"ZeRO-{cfg.distributed.zero_stage} | global batch {cfg.global_batch(env.world_size)} x "
              f"{cfg.data.seq_len} tokens", flush=True)

    trainer = Trainer(cfg, env, engine, loader, val_batches, ckpt, logger, fpt, precision, stop)
    if resume is not None:
        t0 = time.perf_counter()
        ckpt.load(resume, meta, engine)
        logger.log({"checkpoint/load_s": time.perf_counter() - t0, "checkpoint/verify_s": verify_s}, meta["step"])
        trainer.load_state_dict(meta["trainer"])
        if env.is_main:
            print(f"resumed from {resume} at step {trainer.step}"
                  + (f" (saved at world size {meta['world_size']})" if meta["world_size"] != env.world_size else ""),
                  flush=True)
    elif init is not None:
        if c.init_load_optimizer:
            ckpt.load(init, init_meta, engine, load_rng=False, load_scheduler=c.init_keep_step)
        if c.init_keep_step:
            trainer.step = init_meta["trainer"]["step"]
        if env.is_main:
            print(f"fine-tuning from {init} (step {init_meta['step']})", flush=True)
    return trainer, logger
