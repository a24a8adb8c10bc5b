"""The run config: typed sections under one root.

Precedence, lowest to highest: dataclass defaults < model preset < YAML file (and the files it
`extends:`) < dotted command-line overrides (`train.max_steps=50 model.n_layers=2`).
Unknown keys, wrong types and impossible combinations are collected and reported together.

Relative paths: one rule. A relative path written in a config file is relative to that file's
directory (`extends:`, data sources, the tokenizer, train.run_dir, checkpoint.resume and
init_from); on the command line, relative to the working directory. They are made absolute as the
config is loaded, so a run starts the same from any directory and its saved config.yaml names
the files it used. (A source like `org/name` that is no local path is a hub dataset, left as is.)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from data_pipeline.config import DataConfig
from pretrain.errors import ConfigError
from pretrain.model.args import PRESETS, ModelArgs, _divisor_hint
from pretrain.model.float8 import RECIPES


@dataclass
class OptimizerConfig:
    lr: float = 3e-4  # peak learning rate (after warmup)
    weight_decay: float = 0.1  # decoupled (AdamW) decay of matrices; never on norms or biases
    decay_embeddings: bool = False  # also decay the token embedding (off: GPT-NeoX/OLMo default)
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam epsilon
    grad_clip: float = 1.0  # max global gradient L2 norm (0 = no clipping)
    name: str = "adamw"  # adamw | muon: Muon on the 2-D hidden matrices, AdamW (the fields above) on the rest (docs/optimizers.md)
    muon_momentum: float = 0.95  # Muon's momentum (an EMA of the gradient, as torch.optim.Muon's)
    muon_nesterov: bool = True  # Muon orthogonalises the Nesterov blend of gradient and momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations per orthogonalisation
    muon_ns_method: str = "gram"  # gram (DeepSpeed's default: fp16 on GPU, fp32 on CPU) | standard (torch.optim.Muon's iteration, bf16)
    muon_lr_rule: str = "match_adamw"  # match_adamw: update RMS of AdamW's (0.2 sqrt(max(fan_out, fan_in))), so optimizer.lr and weight_decay carry over
    # (under mup/completep: that rule at the base shape, then spectral muP across width; optim.muon_lr_scale)


@dataclass
class ScheduleConfig:
    kind: str = "cosine"  # cosine | linear (decay after warmup) | wsd (warmup-stable-decay) | constant
    warmup_steps: int = 100  # optimizer steps of linear warmup from 0 to optimizer.lr
    decay_steps: int = 0  # cosine/linear: steps of decay after warmup (0 = until train.max_steps)
    min_lr: float = 3e-5  # the rate the decay ends at (held after decay_steps)
    decay_fraction: float = 0.2  # wsd: share of the run (or of a branch) spent decaying, at its end
    decay_shape: str = "linear"  # wsd: shape of the decay: linear | cosine | 1-sqrt
    decay_points: list[int] = field(default_factory=list)  # wsd: steps where extra decay branches end (WSD-S)


@dataclass
class TrainConfig:
    max_steps: int = 1000  # optimizer steps in the whole run
    micro_batch_size: int = 8  # sequences per device per forward/backward
    global_batch_size: int = 0  # sequences per optimizer step across all devices (0 = micro * world)
    global_batch_tokens: int = 0  # or the same in tokens; must be a multiple of data.seq_len (0 = unused)
    seed: int = 42  # model init and dropout-free RNG seed
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32 | fp8 (bf16 with float8 matmuls in the blocks' linears, torchao: docs/performance.md)
    fp8_recipe: str = "tensorwise"  # precision=fp8: tensorwise (one scale per tensor) | rowwise (one per row, more accurate, slower)
    fp8_emulate: bool = False  # precision=fp8: the same scaled-float8 arithmetic with high-precision matmuls (CPU, tests, numerics)
    activation_checkpointing: int = 0  # 0 = off, 1 = every block, n = every n-th block
    eval_every: int = 0  # steps between validation passes (0 = only at the end; needs data.validation)
    eval_batches: int = 8  # global batches in one validation pass (fixed, the same every run)
    eval_tasks: list[str] = field(default_factory=list)  # downstream tasks scored at each eval, at the end and after each WSD-S branch (docs/evaluation.md)
    eval_task_limit: int = 1000  # instances per task in-loop (the first N; OLMo-core's cap; 0 = all)
    eval_task_fewshot: int = 0  # few-shot examples before each task instance in-loop
    on_nonfinite: str = "stop"  # non-finite loss or gradient norm: stop (exit 3) | skip (drop the update)
    max_consecutive_skips: int = 10  # with on_nonfinite=skip: stop (exit 3) after this many in a row (0 = never)
    run_dir: str = "runs/default"  # where metrics, configs and checkpoints of this run go; one run owns it
    overwrite: bool = False  # a fresh run into a run dir holding another run: move that run to run_dir/replaced/
    compile: bool = False  # torch.compile the model (DeepSpeed's engine.compile(); docs/performance.md)
    loss_chunk_tokens: int = 0  # tokens per chunk of the output projection + loss (0 = 256 MiB of fp32 logits)
    mlp_chunk_tokens: int = 0  # tokens per tile of the MLP, recomputed in backward a tile at a time (0 = whole; long sequences: docs/long_context.md)


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints (0 = only at the end and on SIGTERM/SIGINT/SIGUSR1)
    every_minutes: float = 0.0  # also save when this many minutes passed since the last save (0 = off)
    keep_last: int = 2  # complete checkpoints kept (older ones are deleted)
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this (0 = none)
    resume: str = "none"  # none | auto (latest complete checkpoint in run_dir, if any) | PATH
    init_from: str = ""  # checkpoint to take model weights from, for fine-tuning ("" = none)
    init_load_optimizer: bool = False  # with init_from: also load optimizer state
    init_keep_step: bool = False  # with init_from: continue its step count and LR schedule


@dataclass
class LoggingConfig:
    log_every: int = 10  # steps between metric lines
    wandb: str = "auto"  # auto (online with an API key, else offline) | online | offline | disabled
    project: str = "pretrain"  # W&B project
    entity: str = ""  # W&B entity ("" = your default)
    name: str = ""  # W&B run name ("" = the run_dir name)
    group: str = ""  # W&B group ("" = none; a scaling sweep sets its name)
    progress: bool = True  # progress bar on rank 0
    comm_bytes: bool = False  # count the bytes of each kind of collective, intra/inter node, in each logged step (comm/*; pretrain/parallel/traffic.py; that step runs 1.3-1.5x slower on CPU)
    attn_logits: bool = False  # log train/max_attn_logit, the largest attention logit (q.k x scale) of the step's last micro-batch: a no-grad forward at each log step, 0.4-0.45 x a micro-batch's forward+backward on CPU (pretrain/metrics.py; docs/model.md)


@dataclass
class DistributedConfig:
    zero_stage: int = 3  # DeepSpeed ZeRO stage 0-3; one device: 0 (ZeRO-3 there is overhead, docs/performance.md)
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | nccl | gloo
    param_persistence_threshold: int = -1  # ZeRO-3: params with fewer elements stay whole (-1 = 10 x model.dim)
    reduce_bucket_size: int = 0  # elements per gradient reduce bucket (0 = model.dim^2)
    prefetch_bucket_size: int = 0  # ZeRO-3: elements of parameters gathered ahead (0 = 0.9 x model.dim^2)
    max_reuse_distance: int = 1_000_000_000  # ZeRO-3: a parameter used again within this many elements of other parameters stays gathered, e.g. from forward to backward (fewer gathers, more memory; DeepSpeed's default; `pretrain estimate` counts the gathers)
    overlap_comm: bool = True  # overlap gradient reduction with backward
    offload_optimizer: bool = False  # ZeRO optimizer state on CPU memory
    grad_dtype: str = "fp32"  # bf16 runs: dtype gradients accumulate over micro-batches and reduce across ranks in: fp32 | bf16 (half the traffic, inexact; docs/performance.md)
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU (0 = from the device type)
    timeout_s: float = 1800.0  # a collective (NCCL, gloo) waiting this long for a peer fails the run
    sequence_parallel: int = 1  # Ulysses: each sequence split over this many ranks (divides the world, n_heads and seq_len; docs/long_context.md)
    tensor_parallel: int = 1  # AutoTP: each block's matrices split over this many consecutive ranks (one node's GPUs), which read the same batch (divides the world, n_heads, n_kv_heads and the FFN width; docs/performance.md)
    expert_parallel: int = 1  # Mixture-of-Experts: each rank holds model.moe_experts / this many experts, the tokens travel to them by all-to-all among this many consecutive ranks (ZeRO 1-3; divides the world and moe_experts; docs/moe.md)
    hpz: bool = False  # ZeRO++ hierarchical partitioning (ZeRO-3, more than one node): a second copy of the 16-bit weights sharded within each node, so the forward and backward gathers never leave it (docs/performance.md)


# The hang report's fixed waits (pretrain/faults/watchdog.py). They bound how long a report takes, which
# the config keeps below the collective timeout (resilience.hang_timeout_s).
REPORT_WAIT_S = 10.0  # the most the asking watchdog waits for every rank's answer
IO_TIMEOUT_S = 5.0  # a report's file I/O (stacks, the exit record) is abandoned after this
STORE_TIMEOUT_S = 5.0  # an operation on the rendezvous store that takes longer fails
# From a watchdog firing to every rank's exit, at most: the answers, then the verdict's I/O.
HANG_EXIT_S = REPORT_WAIT_S + 2 * IO_TIMEOUT_S + STORE_TIMEOUT_S


@dataclass
class ResilienceConfig:
    """Faults at scale (docs/reliability.md)."""

    hang_timeout_s: float = 0.0  # a rank without progress this long: stacks, one line naming it, exit 4 (0 = learned: 5x the longest step, at least 300 s)
    spike_sigma: float = 6.0  # drop the update of a step whose loss or gradient norm exceeds mean + this many std (0 = off)
    spike_window: int = 128  # applied steps the mean and std are over
    spike_warmup: int = 64  # applied steps before spikes are looked for
    rollback_after: int = 3  # this many spikes within rollback_window steps: roll back and skip their data (0 = never)
    rollback_window: int = 50  # steps
    rollback_skip_batches: int = 200  # global batches skipped from the first spike's step after a rollback
    max_rollbacks: int = 3  # more would be needed: stop (exit 3)
    skip_batches: list[list[int]] = field(default_factory=list)  # [[step, batches], ...]: skip batches before these steps, by hand
    straggler_warn: float = 1.2  # warn when a rank's host or compute time is this many times the median rank's for 3 log steps in a row (0 = never)


@dataclass
class ScalingConfig:
    """What a run of a scaling sweep is for (written by `pretrain scaling plan`; also in W&B)."""

    sweep: str = ""  # the sweep's name ("" = not part of a sweep)
    budgets: list[float] = field(default_factory=list)  # compute budgets (FLOPs) this run gives points for


@dataclass
class Config:
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def problems(self, world_size: int | None = None, model: bool = True) -> list[str]:
        """Cross-field checks; with `world_size`, also the batch arithmetic of that run. `model`: the
        model's own checks and the layout's against it too. Only `load_config` leaves them out, for a
        Hugging Face checkpoint.init_from: its config.json defines the model, of which the `model`
        section holds the overrides until the start reads it (pretrain/build.py resolve_model) and
        checks the config that will train (`validate`)."""
        bad = non_finite(self)
        if bad:  # (alone: a NaN passes every comparison below)
            return bad
        m = self.model if model else None
        out = (m.problems() if m else []) + self.data.problems()
        t, s = self.train, self.schedule
        if t.max_steps <= 0:
            out.append(f"train.max_steps={t.max_steps} must be positive")
        if t.micro_batch_size <= 0:
            out.append(f"train.micro_batch_size={t.micro_batch_size} must be positive")
        if t.global_batch_size and t.global_batch_tokens:
            out.append("set only one of train.global_batch_size and train.global_batch_tokens")
        if self.data.seq_len > 0 and t.global_batch_tokens % self.data.seq_len:
            out.append(f"train.global_batch_tokens={t.global_batch_tokens} is not a multiple of "
                       f"data.seq_len={self.data.seq_len}")
        if m and self.data.seq_len > m.max_seq_len:
            out.append(f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len="
                       f"{m.max_seq_len}: raise model.max_seq_len or lower data.seq_len")
        _choice(out, "train.precision", t.precision, ("auto", "bf16", "fp16", "fp32", "fp8"))
        out += fp8_problems(self)
        _choice(out, "train.on_nonfinite", t.on_nonfinite, ("stop", "skip"))
        _choice(out, "logging.wandb", self.logging.wandb, ("auto", "online", "offline", "disabled"))
        _choice(out, "distributed.backend", self.distributed.backend, ("auto", "nccl", "gloo"))
        _choice(out, "distributed.zero_stage", self.distributed.zero_stage, (0, 1, 2, 3))
        _choice(out, "distributed.grad_dtype", self.distributed.grad_dtype, ("fp32", "bf16"))
        if t.activation_checkpointing < 0:
            out.append("train.activation_checkpointing must be 0 (off), 1 (every block) or n (every n-th)")
        if s.warmup_steps < 0 or s.decay_steps < 0:
            out.append("schedule.warmup_steps and schedule.decay_steps must be >= 0")
        _choice(out, "schedule.kind", s.kind, ("cosine", "linear", "wsd", "constant"))
        _choice(out, "schedule.decay_shape", s.decay_shape, ("linear", "cosine", "1-sqrt"))
        if not 0 < s.decay_fraction <= 1:
            out.append(f"schedule.decay_fraction={s.decay_fraction} must be in (0, 1]")
        if s.decay_points:
            if s.kind != "wsd":
                out.append("schedule.decay_points needs schedule.kind=wsd")
            if sorted(set(s.decay_points)) != s.decay_points:
                out.append(f"schedule.decay_points={s.decay_points} must be increasing")
            late = [p for p in s.decay_points if p >= t.max_steps]
            if late:
                out.append(f"schedule.decay_points {late} must be before train.max_steps={t.max_steps} (the run "
                           "itself decays at its end)")
            starts = [p - max(1, round(s.decay_fraction * p)) for p in s.decay_points]
            if len(set(starts)) < len(starts):
                out.append(f"schedule.decay_points={s.decay_points}: two of them start their decay at the same step "
                           f"(decay_fraction={s.decay_fraction}); space them further apart")
            early = [p for p, start in zip(s.decay_points, starts) if start < s.warmup_steps]
            if early:
                out.append(f"schedule.decay_points {early}: their decay would start inside the warmup "
                           f"({s.warmup_steps} steps): use later points or a shorter warmup")
        o = self.optimizer
        bad = [f"optimizer.{k}={getattr(o, k)}" for k in ("lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip")
               if not math.isfinite(getattr(o, k))] + [f"schedule.min_lr={s.min_lr}"] * (not math.isfinite(s.min_lr))
        if bad:
            out.append(", ".join(bad) + ": must be finite numbers")
        elif o.lr < 0:
            out.append(f"optimizer.lr={o.lr} must be >= 0")
        out += muon_problems(self)
        out += moe_problems(self, m)
        if s.min_lr > self.optimizer.lr:
            out.append(f"schedule.min_lr={s.min_lr} is above optimizer.lr={self.optimizer.lr}")
        if not (math.isfinite(self.checkpoint.every_minutes) and self.checkpoint.every_minutes >= 0):
            out.append(f"checkpoint.every_minutes={self.checkpoint.every_minutes} must be a number >= 0 (0 = off)")
        hang, timeout = self.resilience.hang_timeout_s, self.distributed.timeout_s
        if not (math.isfinite(timeout) and timeout > 0):
            out.append(f"distributed.timeout_s={timeout} must be a number > 0")
        elif not (math.isfinite(hang) and 0 <= hang and hang + HANG_EXIT_S < timeout):
            out.append(f"resilience.hang_timeout_s={hang} must be >= 0 (0 = learned) and at least {HANG_EXIT_S:g} s "
                       f"below distributed.timeout_s={timeout} (the hang report's time), so that the watchdog names "
                       "the hanging rank before a collective times out")
        r = self.resilience
        if not (math.isfinite(r.spike_sigma) and r.spike_sigma >= 0) or r.spike_window < 2 or r.spike_warmup < 2 \
                or r.spike_warmup > r.spike_window:
            out.append(f"resilience.spike_sigma={r.spike_sigma} must be >= 0 (0 = off), spike_window="
                       f"{r.spike_window} and spike_warmup={r.spike_warmup} >= 2 with the warmup at most the window")
        if r.rollback_after < 0 or r.rollback_window < 1 or r.rollback_skip_batches < 0 or r.max_rollbacks < 0:
            out.append("resilience.rollback_after, max_rollbacks and rollback_skip_batches must be >= 0, "
                       "rollback_window >= 1")
        if any(not (isinstance(x, list) and len(x) == 2 and x[0] >= 1 and x[1] >= 0) for x in r.skip_batches):
            out.append(f"resilience.skip_batches={r.skip_batches}: give [[step, batches], ...] with step >= 1")
        if not (math.isfinite(self.resilience.straggler_warn) and (self.resilience.straggler_warn == 0
                                                                  or self.resilience.straggler_warn > 1)):
            out.append(f"resilience.straggler_warn={self.resilience.straggler_warn} must be > 1 (or 0 = never)")
        if self.checkpoint.keep_last < 1:
            out.append("checkpoint.keep_last must be >= 1 (a run always keeps its latest checkpoint)")
        d = self.distributed
        if d.max_reuse_distance < 0:
            out.append(f"distributed.max_reuse_distance={d.max_reuse_distance} must be >= 0 (elements; 0 = gather "
                       "every parameter again in backward)")
        if d.param_persistence_threshold < -1 or d.reduce_bucket_size < 0 or d.prefetch_bucket_size < 0:
            out.append("distributed.param_persistence_threshold must be >= -1 (-1 = derived), the bucket sizes "
                       ">= 0 (0 = derived)")
        if t.loss_chunk_tokens < 0:
            out.append("train.loss_chunk_tokens must be >= 0 (0 = derived from the vocabulary size)")
        if t.mlp_chunk_tokens < 0:
            out.append("train.mlp_chunk_tokens must be >= 0 (0 = the MLP in one piece)")
        if t.max_consecutive_skips < 0:
            out.append("train.max_consecutive_skips must be >= 0 (0 = no limit)")
        if t.overwrite and self.checkpoint.resume != "none":
            out.append(f"train.overwrite=true starts the run over, checkpoint.resume={self.checkpoint.resume} "
                       "continues it: set only one (a requeued job must never overwrite)")
        if t.eval_every and not self.data.validation and not t.eval_tasks:
            out.append("train.eval_every is set but data.validation and train.eval_tasks are empty: add a "
                       "validation source or tasks")
        if t.eval_task_limit < 0 or t.eval_task_fewshot < 0:
            out.append("train.eval_task_limit and train.eval_task_fewshot must be >= 0")
        sp = d.sequence_parallel
        if sp < 1:
            out.append(f"distributed.sequence_parallel={sp} must be >= 1 (1 = off)")
        elif sp > 1:
            if m and m.n_heads % sp:
                out.append(f"distributed.sequence_parallel={sp} does not divide model.n_heads={m.n_heads}: "
                           f"each rank attends with n_heads / {sp} heads (use one of {_divisor_hint(m.n_heads)})")
            if self.data.seq_len % sp:
                out.append(f"distributed.sequence_parallel={sp} does not divide data.seq_len={self.data.seq_len}: "
                           "each rank holds seq_len / sequence_parallel tokens")
        tp = d.tensor_parallel
        if tp < 1:
            out.append(f"distributed.tensor_parallel={tp} must be >= 1 (1 = off)")
        elif tp > 1:
            for name, size in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads),
                               ("the FFN width (model.ffn_hidden_dim)", m.hidden_dim)) if m else ():
                if size % tp:
                    out.append(f"distributed.tensor_parallel={tp} does not divide {name}={size}: each rank holds "
                               f"1/{tp} of it (use one of {_divisor_hint(size)})")
            lacking = [f"model.{k}={getattr(m, k)}" for k, off in TP_LACKS if m and getattr(m, k) != off]
            if lacking:
                out.append(f"distributed.tensor_parallel={tp} does not split {', '.join(lacking)} yet (weights shared by "
                           "the heads it splits): use distributed.sequence_parallel, or tensor_parallel=1")
            if sp > 1:
                out.append("distributed.tensor_parallel and distributed.sequence_parallel do not combine yet (both "
                           "would take each node's consecutive ranks): use one of them")
        if d.hpz and d.zero_stage != 3:
            out.append(f"distributed.hpz=true partitions ZeRO-3's weights within each node, but distributed.zero_stage="
                       f"{d.zero_stage}: use zero_stage=3 or hpz=false")
        if d.hpz and tp > 1:
            out.append("distributed.hpz and distributed.tensor_parallel do not combine yet (hpZ's node groups span "
                       "the whole world, not the data-parallel ranks): use one of them")
        if world_size is not None:
            out += self._world_problems(world_size)
        return out

    def _world_problems(self, world_size: int) -> list[str]:
        """How the layout and the batch split over `world_size` ranks: the parallel sizes must divide
        the world, the global batch the data-parallel ranks (checked where the sizes themselves are
        valid; their own problems are reported above)."""
        d, t, out = self.distributed, self.train, []
        group = max(d.sequence_parallel, 1) * max(d.tensor_parallel, 1)  # the ranks reading one batch
        for name, size in (("tensor_parallel", d.tensor_parallel), ("sequence_parallel", d.sequence_parallel),
                           ("expert_parallel", d.expert_parallel)):
            if size > 1 and world_size % size:
                out.append(f"distributed.{name}={size} does not divide the world size {world_size}: "
                           f"use one of {_divisor_hint(world_size)}")
        if out or world_size % group or t.micro_batch_size <= 0 or self.data.seq_len <= 0:
            return out
        dp = world_size // group
        try:
            self.grad_accum(dp)
        except ConfigError as e:
            out.append(str(e))
        if self.data.num_streams % dp:
            what = "world size" if group == 1 else "data-parallel size"  # (the group: the ranks reading one batch)
            out.append(f"data.num_streams={self.data.num_streams} is not divisible by the {what} "
                       f"{dp}: set data.num_streams to a multiple of it (it is fixed for a run)")
        return out

    def validate(self, world_size: int) -> None:
        """Raise ConfigError listing every problem of this config at `world_size`: the start's check,
        of the config whose `model` is the one to train (pretrain/build.py resolve_model)."""
        problems = self.problems(world_size)
        if problems:
            raise ConfigError(problems)

    def global_batch(self, dp_size: int) -> int:
        """Sequences per optimizer step across all ranks; `dp_size`: the data-parallel ranks (the
        world size without sequence parallelism; a sequence-parallel group reads one rank's share)."""
        t = self.train
        if t.global_batch_tokens:
            return t.global_batch_tokens // self.data.seq_len
        return t.global_batch_size or t.micro_batch_size * dp_size

    def grad_accum(self, dp_size: int) -> int:
        """Micro-batches per rank per optimizer step; raises ConfigError if the batch does not divide."""
        gb, mb = self.global_batch(dp_size), self.train.micro_batch_size
        if gb % (mb * dp_size):
            d = self.distributed
            what = "world size" if d.sequence_parallel == d.tensor_parallel == 1 else "data-parallel size"
            raise ConfigError(
                f"global batch of {gb} sequences is not divisible by micro_batch_size {mb} x {what} "
                f"{dp_size}: pick a global batch that is a multiple of {mb * dp_size}")
        return gb // (mb * dp_size)


# The per-layer description's pieces that AutoTP's partition (pretrain/parallel/parallelize.py TP_SPLITS)
# does not cover: q/k norms and sinks are shared by heads that it splits (their gradients would be each
# rank's heads' only), the biases are not in the partition or the checkpoint converter. (field, its off value)
TP_LACKS = (("qk_norm", "none"), ("attn_sinks", False), ("qkv_bias", False), ("attn_out_bias", False))


def _choice(out: list[str], name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        out.append(f"{name}={value!r} is not one of {', '.join(map(str, allowed))}")


def muon_problems(cfg: "Config") -> list[str]:
    """optimizer.name and Muon's fields. DeepSpeed 0.19.8 runs Muon's step inside ZeRO (it gathers
    each hidden matrix's full gradient to orthogonalise it) with 5 Newton-Schulz steps and Nesterov
    momentum fixed (deepspeed/runtime/zero/muon/original_muon.py, muon_update's defaults, which no
    ZeRO stage passes on): other values would be silently ignored, so they are refused."""
    o, out = cfg.optimizer, []
    _choice(out, "optimizer.name", o.name, ("adamw", "muon"))
    _choice(out, "optimizer.muon_ns_method", o.muon_ns_method, ("standard", "gram"))
    _choice(out, "optimizer.muon_lr_rule", o.muon_lr_rule, ("match_adamw",))
    if not (math.isfinite(o.muon_momentum) and 0 <= o.muon_momentum < 1):
        out.append(f"optimizer.muon_momentum={o.muon_momentum} must be in [0, 1)")
    if o.name != "muon":
        return out
    if not o.muon_nesterov or o.muon_ns_steps != 5:
        out.append(f"optimizer.muon_nesterov={o.muon_nesterov} muon_ns_steps={o.muon_ns_steps}: DeepSpeed's Muon "
                   "runs Nesterov momentum and 5 Newton-Schulz steps, fixed; keep true and 5")
    if cfg.distributed.offload_optimizer:
        # DeepSpeed's offload path orthogonalises before the norm (stage_1_and_2.py:3038,
        # _apply_muon_updates_cpu_offload) and clips the updates; not corrected (docs/optimizers.md).
        out.append("optimizer.name=muon with distributed.offload_optimizer=true: DeepSpeed's offload path clips the "
                   "Muon update instead of the gradient; turn offload off")
    if cfg.distributed.tensor_parallel > 1:
        out.append("optimizer.name=muon with distributed.tensor_parallel > 1: Muon orthogonalises whole matrices and "
                   "each rank holds a slice of them (pretrain/optim/muon.py gathers over data-parallel ranks only); use "
                   "adamw or tensor_parallel=1")
    return out


def moe_problems(cfg: "Config", model: ModelArgs | None) -> list[str]:
    """What a Mixture-of-Experts model (model.moe_experts > 0) does not run with yet, each one line;
    distributed.expert_parallel's own checks. `model`: the model to train (None: not yet known, a
    Hugging Face model's until its config.json is read; its checks wait)."""
    d, t, out = cfg.distributed, cfg.train, []
    ep, experts = d.expert_parallel, model.moe_experts if model else 0
    if ep < 1:
        out.append(f"distributed.expert_parallel={ep} must be >= 1 (1 = off)")
    elif ep > 1:
        if model and not experts:
            out.append(f"distributed.expert_parallel={ep} needs a Mixture-of-Experts model: set model.moe_experts "
                       "or expert_parallel=1")
        elif experts % ep:
            out.append(f"distributed.expert_parallel={ep} does not divide model.moe_experts={experts}: each rank "
                       f"holds moe_experts / expert_parallel experts (use one of {_divisor_hint(experts)})")
        if d.zero_stage == 0:
            # (stage 0 saves the model and its optimizer from rank 0 alone: the other ranks' experts
            # would not be in the checkpoint)
            out.append(f"distributed.expert_parallel={ep} with distributed.zero_stage=0: each rank holds its own "
                       "experts and stage 0 checkpoints rank 0's model only; use zero_stage=1, 2 or 3")
        elif d.zero_stage < 3 and cfg.optimizer.name == "muon":
            # (DeepSpeed's ZeRO-1/2 reduce the experts' gradients over their own ranks only with
            # reduce_scatter, which its Muon turns off: stage_1_and_2.py _configure_moe_settings)
            out.append(f"distributed.expert_parallel={ep} with optimizer.name=muon at distributed.zero_stage="
                       f"{d.zero_stage}: DeepSpeed's ZeRO-1/2 reduce the experts' gradients apart only with "
                       "reduce_scatter, which Muon turns off; use zero_stage=3 or adamw")
        if d.hpz:
            out.append(f"distributed.expert_parallel={ep} with distributed.hpz=true: hpZ's secondary partition "
                       "spans each node's ranks, the experts' partition their expert-data-parallel ranks; use one")
    if not experts:
        return out
    why = {
        "distributed.tensor_parallel > 1": (d.tensor_parallel > 1, "AutoTP does not split stacked experts; use "
                                            "tensor_parallel=1"),
        "train.mlp_chunk_tokens": (t.mlp_chunk_tokens > 0, "the experts' tokens are not tiled; use 0"),
        "train.precision=fp16": (t.precision == "fp16", "use bf16 (the router runs in fp32 either way)"),
    }
    for name, (bad, fix) in why.items():
        if bad:
            out.append(f"model.moe_experts={experts} with {name}: {fix}")
    if t.precision in ("bf16", "fp8"):
        out += moe_muon_bf16_problems(cfg, "bf16")
    return out


def fp8_problems(cfg: "Config") -> list[str]:
    """train.precision=fp8 and its two fields (the device is checked at start-up:
    parallelize.resolve_precision)."""
    t, out = cfg.train, []
    _choice(out, "train.fp8_recipe", t.fp8_recipe, RECIPES)
    if t.precision != "fp8":
        if t.fp8_emulate:
            out.append(f"train.fp8_emulate=true needs train.precision=fp8 (not {t.precision})")
        if t.fp8_recipe != "tensorwise":
            out.append(f"train.fp8_recipe={t.fp8_recipe} needs train.precision=fp8 (not {t.precision})")
    elif cfg.distributed.tensor_parallel > 1:
        # (AutoTP replaces every nn.Linear, Float8Linear included, with its own layers: no float8 left)
        out.append(f"train.precision=fp8 with distributed.tensor_parallel={cfg.distributed.tensor_parallel}: "
                   "AutoTP's layers replace the float8 linears; use tensor_parallel=1 or precision=bf16")
    return out


def moe_muon_bf16_problems(cfg: "Config", precision: str) -> list[str]:
    """Muon on an MoE model at `precision` (resolved: train.precision=auto is bf16 on GPUs) where
    DeepSpeed runs its bf16 optimizer (bf16, ZeRO-0/1, fp32 gradients, no offload), which takes
    Muon's 2-D matrices only (bf16_optimizer.py: "dense two-dimensional matrices only")."""
    d = cfg.distributed
    if cfg.model.moe_experts and cfg.optimizer.name == "muon" and precision == "bf16" and d.zero_stage <= 1 \
            and d.grad_dtype == "fp32" and not d.offload_optimizer:
        return [f"model.moe_experts={cfg.model.moe_experts} with optimizer.name=muon at bf16 and distributed.zero_stage="
                f"{d.zero_stage}: DeepSpeed's bf16 optimizer (ZeRO-0/1 with fp32 gradients) runs Muon on 2-D matrices "
                "only, not stacked experts; use zero_stage=2 or 3"]
    return []


def zero_sizes(cfg: Config) -> dict:
    """ZeRO's bucket sizes and persistence threshold in elements: as configured, or derived from the
    hidden size D by the rule of the Hugging Face DeepSpeed integration's "auto" values: reduce
    buckets D^2 (a few layers' gradients per reduce), prefetch 0.9 D^2, and parameters below 10 D
    elements (norms, small biases) kept whole, since gathering them costs more than they save."""
    d, dim = cfg.distributed, cfg.model.dim
    return {"reduce_bucket_size": d.reduce_bucket_size or dim * dim,
            "prefetch_bucket_size": d.prefetch_bucket_size or int(0.9 * dim * dim),
            "param_persistence_threshold": 10 * dim if d.param_persistence_threshold < 0
            else d.param_persistence_threshold}


def is_hf_model(spec: str | Path) -> bool:
    """checkpoint.init_from names a Hugging Face model: `hub:NAME`, or a directory holding a
    `config.json` (and not one of our checkpoints, which hold meta.json)."""
    spec = str(spec)
    if spec.startswith("hub:"):
        return True
    p = Path(spec).expanduser()
    return bool(spec) and (p / "config.json").is_file() and not (p / "meta.json").is_file()


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                world_size: int | None = None, saved: bool = False) -> Config:
    """Build the Config from defaults, a YAML file and dotted overrides; raise ConfigError listing
    every problem found. `saved`: the file is a run's saved config.yaml, whose paths are already
    absolute (or, written by an older version, relative to the working directory)."""
    raw = _read_yaml(Path(path), set(), anchor=not saved) if path else {}
    errors: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            errors.append(f"override {item!r} is not of the form section.key=value")
            continue
        value = yaml.safe_load(value) if value.strip() else ""
        alone: dict = {}  # the override by itself, its paths anchored at the working directory
        _set_dotted(alone, key.strip(), value)
        _anchor_paths(alone, Path.cwd())
        node = alone
        for part in key.strip().split("."):
            node = node[part]
        _set_dotted(raw, key.strip(), node)
    model = raw.get("model")
    if isinstance(model, dict) and model.get("preset"):
        preset = model["preset"]
        if preset not in PRESETS:
            errors.append(f"model.preset={preset!r} is unknown{_closest(preset, PRESETS)}; "
                          f"presets: {', '.join(PRESETS)}")
        else:
            raw["model"] = {**PRESETS[preset], **model}
    cfg = _build(Config, raw, "", errors)
    if not errors:
        errors = cfg.problems(world_size, model=not is_hf_model(cfg.checkpoint.init_from))
    if errors:
        raise ConfigError(errors)
    cfg.train.run_dir = os.path.abspath(cfg.train.run_dir)  # the default too
    return cfg


def non_finite(cfg: Config) -> list[str]:
    """One line naming every float of the config, in any section or list, that is NaN or infinite
    (none: []). No field means anything by them: NaN passes every range check (`x < 0` is false) and
    trains, e.g. model.moe_bias_rate=nan collapses the routing. No field keeps inf either: each
    limit, timeout or threshold that can be off says so with 0 (checkpoint.every_minutes,
    distributed.peak_flops, resilience.hang_timeout_s, spike_sigma, straggler_warn,
    optimizer.grad_clip), and inf in a rate, a coefficient, a share or a budget is no number to train with."""
    bad = []

    def walk(node, where: str) -> None:
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name), f"{where}.{f.name}" if where else f.name)
        elif isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{where}[{i}]")
        elif isinstance(node, float) and not math.isfinite(node):
            bad.append(f"{where}={node}")

    walk(cfg, "")
    return [", ".join(bad) + ": must be finite numbers"] if bad else []


def config_from_dict(raw: dict) -> Config:
    """A Config from a resolved dict (e.g. the config.yaml saved in a checkpoint)."""
    errors: list[str] = []
    cfg = _build(Config, raw, "", errors)
    if errors:
        raise ConfigError(errors)
    return cfg


def _read_yaml(path: Path, seen: set, anchor: bool = True) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.resolve() in seen:
        raise ConfigError(f"config {path} extends itself (cycle through extends:)")
    seen.add(path.resolve())
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    parent = data.pop("extends", None)
    if anchor:
        _anchor_paths(data, path.parent.absolute())
    if parent:
        base = _read_yaml(path.parent / os.path.expanduser(parent), seen, anchor)
        data = _deep_merge(base, data)
    return data


def _anchor_paths(raw: dict, base: Path) -> None:
    """Make the relative paths in `raw` (a config file's dict, or one override) absolute against
    `base`, in place (the rule in the module doc). Values of the wrong type are left for the type
    check to report."""
    from data_pipeline.sources import _looks_like_hub

    def local(path: str) -> str:
        return os.path.normpath(os.path.join(base, os.path.expanduser(path)))

    def section(name: str) -> dict:
        node = raw.get(name)
        return node if isinstance(node, dict) else {}

    train, ckpt, data = section("train"), section("checkpoint"), section("data")
    if isinstance(train.get("run_dir"), str) and train["run_dir"]:
        train["run_dir"] = local(train["run_dir"])
    if isinstance(ckpt.get("resume"), str) and ckpt["resume"] not in ("", "none", "auto"):
        ckpt["resume"] = local(ckpt["resume"])
    if isinstance(ckpt.get("init_from"), str) and ckpt["init_from"] and not ckpt["init_from"].startswith("hub:"):
        ckpt["init_from"] = local(ckpt["init_from"])
    tok = data.get("tokenizer")
    if isinstance(tok, str) and tok and not tok.startswith(("builtin:", "hub:")):
        data["tokenizer"] = local(tok)
    for key in ("sources", "validation"):
        items = data.get(key) or []
        for src in [items] if isinstance(items, dict) else items:  # (one source may be a mapping)
            if not isinstance(src, dict) or not isinstance(src.get("path"), str) or not src["path"]:
                continue
            path, kind = src["path"], src.get("kind", "auto")
            if path.startswith("builtin:") or kind == "builtin":
                continue
            if os.path.exists(local(path)) or kind not in ("auto", "hub") or not _looks_like_hub(path):
                src["path"] = local(path)  # (a hub-named directory that is here is read from here)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _set_dotted(raw: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    node = raw
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {p} is not a section")
    node[last] = value


def _closest(name: str, valid) -> str:
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _build(cls, raw, where: str, errors: list[str]):
    """Instantiate dataclass `cls` from a dict, checking keys and types; problems go to `errors`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        errors.append(f"{where or 'config'} must be a mapping, got {type(raw).__name__}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{where}{key}"
        if key not in names:
            errors.append(f"unknown key {full!r}{_closest(key, names)}; valid keys here: {', '.join(names)}")
            continue
        kwargs[key] = _convert(hints[key], value, full, errors)
    return cls(**kwargs)


def _convert(tp, value, where: str, errors: list[str]):
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where + ".", errors)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp)
        if not isinstance(value, list):
            value = [value] if dataclasses.is_dataclass(item_tp) and isinstance(value, dict) else value
        if not isinstance(value, list):
            errors.append(f"{where} must be a list, got {value!r}")
            return []
        return [_convert(item_tp, v, f"{where}[{i}]", errors) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        errors.append(f"{where} must be {tp.__name__}, got {value!r} ({type(value).__name__})")
        return tp()
    return value
