"""`pretrain eval MODEL [CONFIG] [overrides]`: loss, perplexity and bits per byte of a model on data
it was not trained on.

MODEL is a checkpoint (a step folder), a run dir or checkpoints folder (its newest complete
checkpoint), or a Hugging Face model directory / `hub:NAME`. The config gives the data: CONFIG if
given, else the config saved in the checkpoint; its validation sources, else its training sources,
or the one source `--data PATH_OR_HUB_NAME`. The model's own tokenizer is used. `--batches N` scores
the first N global batches of the run that trained the checkpoint (train.global_batch_size
sequences each, or micro_batch_size x its world size: the ones the training run's own evaluation
scores with train.eval_batches=N), whatever the world size of the eval; batches that repeat windows
(a small validation set) are warned of. Without it, one full pass. `--by-position N` adds the mean
loss per bucket of N positions in the window ([0, N), [N, 2N), ...): after a context extension the
loss past the old context should fall (docs/long_context.md). `model.max_seq_len=` and the RoPE
settings (`model.rope_theta=`, `model.rope_scaling_factor=`, ...) among the overrides score the model
under other values (no weight depends on them), e.g. a checkpoint past the context it was trained at.

Every rank holds the whole model (no ZeRO: scoring needs no optimizer state) and scores global
sequences rank, rank + W, ...; the sums are reduced, so the result is the same at any world size.

`--tasks T1,T2 [--limit N] [--fewshot K]` scores downstream tasks instead (pretrain/eval/tasks/,
docs/evaluation.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from pretrain.eval import tasks

log = logging.getLogger(__name__)


def _config(model_path: Path, is_hf: bool, config: str | None, overrides: list[str], data: str | None):
    from data_pipeline.config import SourceConfig
    from pretrain.config import load_config
    from pretrain.errors import ConfigError

    saved = config is None and not is_hf
    if saved:
        config = str(model_path / "config.yaml")
    if config is None and data is None:
        raise ConfigError(f"{model_path} is a Hugging Face model: give a CONFIG with the data, or --data SOURCE")
    cfg = load_config(config, overrides, saved=saved)
    if data is not None:
        cfg.data.validation = [SourceConfig(path=data)]
    elif not cfg.data.validation:
        log.warning("eval: the config has no validation sources: scoring its training sources")
        cfg.data.validation = list(cfg.data.sources)
    return cfg


def evaluate(model, tokenizer, cfg, env, batches: int = 0, micro_batch_size: int = 0, trained_world: int = 1,
             by_position: int = 0) -> dict:
    """{"loss", "perplexity", "bits_per_byte", "tokens", "bytes", "sequences"} over this world;
    `batches` global batches of the run that trained the model at `trained_world` data-parallel ranks.

    `by_position` = N > 0 adds "by_position": for each bucket of N positions of the window ([0, N),
    [N, 2N), ..., the last one shorter if N does not divide data.seq_len), {"start", "end" (positions,
    end excluded), "loss" (mean nats per token), "tokens"}. Position t is the prediction of the
    window's token t + 1 from the t + 1 tokens before it (packed windows: across documents)."""
    import data_pipeline as dp
    from pretrain.parallel import distributed

    sequences = batches * cfg.global_batch(trained_world) if batches else 0
    windows = dp.evaluation_windows(cfg.data, tokenizer, env.rank, env.world_size, sequences)
    B = micro_batch_size or cfg.train.micro_batch_size
    sums = torch.zeros(4, dtype=torch.float64)  # loss sum (nats), tokens, bytes, sequences
    T = cfg.data.seq_len
    bucket_of = torch.arange(T) // max(by_position, 1)  # (T,) each position's bucket
    # per bucket: loss sum (nats), tokens. float64 sums of fp32 losses: any split of the windows over
    # ranks or batches gives the same sums up to float64 rounding (none in tests/: equal to the bit).
    buckets = torch.zeros(2, -(-T // by_position) if by_position else 0, dtype=torch.float64)
    done = False
    with torch.no_grad():
        while not done:
            rows = []
            for w in windows:
                rows.append(torch.from_numpy(w.astype("int64")))
                if len(rows) == B:
                    break
            else:
                done = True
            if not rows:
                break
            batch = torch.stack(rows).to(env.device)
            inputs, labels = batch[:, :-1], batch[:, 1:]
            if by_position:
                loss, token_losses = _token_losses(model, inputs, labels)
                buckets[0].index_add_(0, bucket_of, token_losses.double().sum(0).cpu())
                buckets[1].index_add_(0, bucket_of, torch.full((T,), float(len(rows)), dtype=torch.float64))
            else:
                loss = model(inputs, labels, **_documents(model, inputs))  # mean over the batch's tokens, fp32
            sums[0] += float(loss) * labels.numel()
            sums[1] += labels.numel()
            sums[2] += sum(len(tokenizer.decode(row.tolist(), skip_special_tokens=False).encode("utf-8"))
                           for row in labels.cpu())
            sums[3] += len(rows)
    reduced = distributed.host_sum(sums.tolist() + buckets.flatten().tolist())  # one collective for both
    loss_sum, tokens, n_bytes, n_seq = reduced[:4]
    if not tokens:
        from pretrain.errors import UserError

        raise UserError("eval: the data gave no sequences to score")
    loss = loss_sum / tokens
    out = {"loss": loss, "perplexity": math.exp(min(loss, 50.0)),
           "bits_per_byte": loss_sum / (math.log(2) * n_bytes) if n_bytes else float("nan"),
           "tokens": int(tokens), "bytes": int(n_bytes), "sequences": int(n_seq)}
    if by_position:
        n = buckets.size(1)
        bucket_sums, bucket_tokens = reduced[4:4 + n], reduced[4 + n:]
        out["by_position"] = [{"start": i * by_position, "end": min((i + 1) * by_position, T),
                               "loss": s / c, "tokens": int(c)}
                              for i, (s, c) in enumerate(zip(bucket_sums, bucket_tokens))]
    return out


def _documents(model, tokens: torch.Tensor) -> dict:
    """The model's document arguments for `tokens` (model.document_mask)."""
    import data_pipeline as dp

    a = model.args
    return dp.document_inputs(tokens, a.document_eot, a.document_positions)


def _token_losses(model, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's mean loss, as without this, and every token's loss (B, T) fp32, nats). The LM
    head's input is caught on its way in and put through the head again a chunk of tokens at a time,
    as the model's own loss is, so the (B, T, V) logits never exist at once (the head runs twice)."""
    from pretrain.model.model import LOSS_CHUNK_BYTES

    caught = []
    hook = model.output.register_forward_pre_hook(lambda module, args: caught.append(args[0]))
    try:
        loss = model(inputs, labels, **_documents(model, inputs))
    finally:
        hook.remove()
    h, flat = caught[0].flatten(0, 1), labels.flatten()  # (B*T, D), (B*T,)
    chunk = max(128, LOSS_CHUNK_BYTES // (4 * model.output.out_features))
    token_losses = torch.cat([F.cross_entropy(model.output(h[i:i + chunk]).float(), flat[i:i + chunk], reduction="none")
                              for i in range(0, len(flat), chunk)])
    return loss, token_losses.view_as(labels)


def eval_cli(args) -> None:
    from pretrain.parallel import distributed

    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides, args.config = [args.config, *args.overrides], None  # overrides without a CONFIG
    from pretrain.errors import ConfigError

    if args.batches < 0 or args.micro_batch_size < 0:
        raise ConfigError("--batches and --micro-batch-size must be >= 0")
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit {args.limit}: give N >= 1 instances per task (leave it out for all of them)")
    if args.fewshot < 0:
        raise ConfigError(f"--fewshot {args.fewshot}: give K >= 0 examples")
    if (args.limit is not None or args.fewshot) and not args.tasks:
        raise ConfigError("--limit and --fewshot go with --tasks")
    if args.by_position < 0:
        raise ConfigError(f"--by-position {args.by_position}: give a bucket width in tokens >= 1 (0 = off)")
    if args.by_position and args.tasks:
        raise ConfigError("--by-position goes with the loss eval, not --tasks")
    if not args.tasks:
        _rope_overrides(args.overrides)  # a model field that cannot change: one line before any process group
    env = distributed.init("auto")
    try:
        _eval(args, env)
    finally:
        # Tear the groups down before the interpreter does: gloo's threads destroyed at exit abort
        # the process now and then ("terminate called without an active exception").
        distributed.shutdown()


def _eval(args, env) -> None:
    from pretrain.checkpoint.layout import open_checkpoint
    from pretrain.config import is_hf_model
    from pretrain.hf import hub
    from pretrain.hf.export import load_for_inference
    from pretrain.parallel import distributed

    is_hf = is_hf_model(args.model)
    path, meta = (hub.resolve(args.model), {}) if is_hf else distributed.agree(lambda: open_checkpoint(args.model))
    if args.tasks:
        # every rank reads the task files; one line for a bad one before the model is loaded
        specs = [t.strip() for t in args.tasks.split(",") if t.strip()]
        suite = distributed.agree(tasks.TaskSuite, specs, args.limit or 0, args.fewshot, args.seed)
    else:
        cfg = _config(path, is_hf, args.config, args.overrides, args.data)
    model, tokenizer, eot = load_for_inference(str(path), str(env.device), verified=True)
    # bf16 on CUDA by default, for speed; its log-likelihoods are not fp32's (lm-eval's HFLM on the
    # fp32 export), which --dtype fp32 gives (docs/evaluation.md: how far apart they were).
    args.dtype = args.dtype if args.dtype != "auto" else ("bf16" if env.device.type == "cuda" else "fp32")
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    if args.tasks:
        return _eval_tasks(args, env, path, model, tokenizer, eot, suite)
    rope = {name: getattr(cfg.model, name) for name in _rope_overrides(args.overrides)}
    if rope:  # the RoPE table only: rebuilt for the new values, the weights as they are
        model.args = dataclasses.replace(model.args, **rope)
        model.reset_rope_table()
    if cfg.data.seq_len > model.args.max_seq_len:
        from pretrain.errors import ConfigError

        raise ConfigError(f"data.seq_len={cfg.data.seq_len} is longer than the model's max_seq_len "
                          f"{model.args.max_seq_len}: lower data.seq_len, or raise model.max_seq_len (the RoPE "
                          "table, no weight)")
    trained_dp = meta.get("data_parallel", meta.get("world_size", 1))  # (not recorded before tensor parallelism)
    result = evaluate(model, tokenizer, cfg, env, args.batches, args.micro_batch_size, trained_dp,
                      args.by_position)
    result = {"model": str(path), "world_size": env.world_size, "dtype": args.dtype,
              **({"model_overrides": rope} if rope else {}), **result}
    if env.is_main:
        print(f"eval {path}: loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f} | "
              f"bits per byte {result['bits_per_byte']:.4f} | {result['sequences']:,} sequences, "
              f"{result['tokens']:,} tokens ({args.dtype})", flush=True)
        if args.by_position:
            print("eval loss by position: " + " | ".join(f"[{b['start']}, {b['end']}) {b['loss']:.4f}"
                                                         for b in result["by_position"]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


def _rope_overrides(overrides: list[str]) -> list[str]:
    """The model fields among the dotted overrides, all of them ROPE_FIELDS (the eval's model is the
    checkpoint's: another shape would not load its weights); raises ConfigError for any other."""
    from pretrain.errors import ConfigError
    from pretrain.model.args import ROPE_FIELDS

    names = [o.split("=", 1)[0].strip()[len("model."):] for o in overrides if o.strip().startswith("model.")]
    other = [n for n in names if n not in ROPE_FIELDS]
    if other:
        raise ConfigError(f"model.{other[0]}: the model is the checkpoint's; an eval may change only "
                          + ", ".join(f"model.{f}" for f in ROPE_FIELDS) + " (the RoPE table, no weight)")
    return names


def _eval_tasks(args, env, path, model, tokenizer, eot, suite) -> None:
    from pretrain.parallel import distributed

    if eot is None:
        from pretrain.errors import UserError

        raise UserError(f"{path}: the model names no end-of-text token (config.json eos_token_id), which "
                        "scoring an empty context needs")
    results = suite(lambda tokens: model(tokens, **_documents(model, tokens)), env.device, env.rank, env.world_size,
                    distributed.all_gather_objects, tokenizer=tokenizer, eot=eot, max_len=model.args.max_seq_len)
    if env.is_main:
        for task, r in results.items():
            shown = " | ".join(f"{k} {v:.4f}" for k, v in r["metrics"].items())
            print(f"eval {path}: {task} ({r['n']} instances, {r['format']}, {args.fewshot}-shot, {args.dtype}): "
                  f"{shown}", flush=True)
        if args.json:
            out = {"model": str(path), "world_size": env.world_size, "dtype": args.dtype, "fewshot": args.fewshot,
                   "seed": args.seed, "tasks": results}
            Path(args.json).write_text(json.dumps(out, indent=1))
