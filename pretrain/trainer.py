"""The training run: `pretrain train CONFIG [overrides]`, under any launcher.

`run()` sets up (process group, config, data, model, engine, loggers, checkpoints), hands over to a
small `Trainer` whose methods are one step, one evaluation, one save, and always closes the loggers
and the process group, also on error.

Exit codes: 0 done; 2 user error (config, data, checkpoint); 3 non-finite loss with
train.on_nonfinite=stop; 75 stopped by SIGTERM/SIGUSR1 after saving a checkpoint (resume with
checkpoint.resume=auto).
"""

from __future__ import annotations

import functools
import math
import os
import signal
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pretrain import distributed
from pretrain.checkpoint import CheckpointManager
from pretrain.config import Config, load_config
from pretrain.errors import UserError
from pretrain.metrics import MetricLogger, memory_stats, peak_flops

EXIT_NONFINITE = 3
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again" - the job is resumable from its checkpoint


class NonFiniteLoss(UserError):
    exit_code = EXIT_NONFINITE


class Preempted(Exception):
    """Raised after the checkpoint for a SIGTERM/SIGUSR1 has been saved."""

    def __init__(self, signum: int, step: int):
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name}: saved step {step}")


class StopSignal:
    """Remembers SIGTERM/SIGUSR1; the trainer checks it between steps (all ranks agree). Installed
    first thing in `run()`, so a signal during start-up is not lost."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum


class Trainer:
    def __init__(self, cfg: Config, env: distributed.Dist, engine, loader, val_batches, ckpt: CheckpointManager,
                 logger: MetricLogger, flops_per_token: float, precision: str, stop: StopSignal):
        self.cfg, self.env, self.engine, self.loader = cfg, env, engine, loader
        self.val_batches, self.ckpt, self.logger = val_batches, ckpt, logger
        self.flops_per_token = flops_per_token
        self.accum = cfg.grad_accum(env.world_size)
        self.tokens_per_step = cfg.global_batch(env.world_size) * cfg.data.seq_len
        self.peak = peak_flops(env.device, precision, cfg.distributed.peak_flops)
        self.step = 0  # optimizer steps done
        self.skipped = 0  # optimizer steps dropped for a non-finite loss (on_nonfinite=skip)
        self.skip_update = False  # set by train_step when this step's update must be dropped
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # torch AdamW inside ZeRO
        inner.step = self._skippable(inner.step)
        self.saved_step = -1  # step of the newest checkpoint of this run (no second save of a step)
        self.data_iter = None  # made in fit(), after a resume has positioned the loader
        self.stop = stop
        self.timers = dict.fromkeys(("data", "compute"), 0.0)

    def _skippable(self, step):
        """DeepSpeed has no "skip this update" outside fp16 loss scaling, so the inner optimizer's
        step is wrapped: with on_nonfinite=skip, a step whose loss was not finite leaves weights and
        Adam moments untouched (DeepSpeed clears the gradients as usual; the LR schedule advances)."""
        @functools.wraps(step)  # keeps the marks torch's LR scheduler put on it
        def maybe_step(*args, **kwargs):
            if self.skip_update:
                return None
            return step(*args, **kwargs)
        return maybe_step

    # -- state that survives a restart (the data position is saved by the checkpoint manager)
    def state_dict(self) -> dict:
        return {"step": self.step, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.skipped = state["step"], state.get("skipped", 0)
        self.saved_step = self.step

    @property
    def tokens_seen(self) -> int:
        return self.step * self.tokens_per_step

    def _next_batch(self):
        t0 = time.perf_counter()
        batch = next(self.data_iter)
        self.timers["data"] += time.perf_counter() - t0
        return (batch["input_ids"].to(self.env.device, non_blocking=True),
                batch["labels"].to(self.env.device, non_blocking=True))

    def train_step(self) -> float:
        """One optimizer step over `accum` micro-batches; returns the global mean loss."""
        total = torch.zeros((), device=self.env.device)
        self.skip_update = False
        for _ in range(self.accum):
            inputs, labels = self._next_batch()
            t0 = time.perf_counter()
            logits = self.engine(inputs)  # (B, T, V)
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
            # One all-reduce gives both the global loss and an agreement on finiteness, so every
            # rank takes the same branch.
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            global_loss /= self.env.world_size
            if not torch.isfinite(global_loss):
                if self.cfg.train.on_nonfinite == "stop":
                    raise NonFiniteLoss(
                        f"loss is {global_loss.item()} at step {self.step + 1}: stopped before the update, "
                        f"so the weights and the last checkpoint are intact; lower optimizer.lr or set "
                        f"train.on_nonfinite=skip, then resume with checkpoint.resume=auto")
                self.skip_update = True
            total += global_loss
            # Backward runs even for a bad micro-batch: ZeRO's backward and step are collective
            # and expect gradients; the update itself is dropped by _skippable (see __init__).
            self.engine.backward(loss)
            self.engine.step()
            self.timers["compute"] += time.perf_counter() - t0
        self.step += 1
        self.skipped += self.skip_update
        return (total / self.accum).item()

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss and perplexity over the fixed validation batches (the same in every run)."""
        self.engine.eval()
        sums = torch.zeros(2, device=self.env.device, dtype=torch.float64)
        for batch in self.val_batches:
            inputs, labels = batch["input_ids"].to(self.env.device), batch["labels"].to(self.env.device)
            logits = self.engine(inputs)
            sums[0] += F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            sums[1] += labels.numel()
        dist.all_reduce(sums)
        self.engine.train()
        loss = (sums[0] / sums[1]).item()
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}

    def save(self) -> None:
        if self.saved_step != self.step:
            t0 = time.perf_counter()
            path = self.ckpt.save(self.step, self.engine, self.loader, self.state_dict(), self.logger.run_id)
            seconds = time.perf_counter() - t0
            self.saved_step = self.step
            if self.env.is_main:
                size = sum(p.stat().st_size for p in path.iterdir() if p.is_file()) / 1e6
                self.logger.log({"checkpoint/save_s": seconds, "checkpoint/size_mb": size}, self.step)

    def _stop_requested(self) -> int:
        """The signal any rank received (0 = none): all ranks must stop at the same step."""
        flag = torch.tensor([self.stop.received or 0], device=self.env.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def fit(self) -> dict:
        cfg, env = self.cfg, self.env
        t = cfg.train
        self.data_iter = iter(self.loader)
        progress = _progress(env.is_main and cfg.logging.progress, self.step, t.max_steps)
        first_loss = last_loss = None
        window_start, window_steps = time.perf_counter(), 0
        losses = []
        while self.step < t.max_steps:
            step_start = time.perf_counter()
            loss = self.train_step()
            losses.append(loss)
            window_steps += 1
            first_loss = loss if first_loss is None else first_loss
            last_loss = loss
            if env.is_main:
                progress.update(1)
                tok_s = self.tokens_per_step / (time.perf_counter() - step_start)
                progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            if self.step % cfg.logging.log_every == 0 or self.step == t.max_steps:
                elapsed = time.perf_counter() - window_start
                self._log_train(losses, window_steps, elapsed, progress)
                losses, window_start, window_steps = [], time.perf_counter(), 0
            if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps:
                self._log_eval(self.evaluate(), progress)
            if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < t.max_steps:
                self.save()
            signum = self._stop_requested()
            if signum:
                self.save()
                self.data_iter = None  # stop the data workers now, before the process is torn down
                raise Preempted(signum, self.step)
        progress.close()
        summary = {"final_step": self.step, "first_loss": first_loss, "final_loss": last_loss}
        if self.val_batches:
            summary.update(self.evaluate())
            self._log_eval(summary, _NoProgress())
        self.save()
        return summary

    def _log_eval(self, result: dict, progress) -> None:
        if self.env.is_main:
            record = {k: result[k] for k in ("eval/loss", "eval/perplexity")}
            self.logger.log({**record, **self._axes()}, self.step)
            progress.write(f"step {self.step:>6} | eval loss {record['eval/loss']:.4f} | "
                           f"perplexity {record['eval/perplexity']:.2f}")

    def _axes(self) -> dict:
        return {"tokens_seen": self.tokens_seen, "flops": self.tokens_seen * self.flops_per_token}

    def _log_train(self, losses, steps, elapsed, progress) -> None:
        tokens_per_s = steps * self.tokens_per_step / elapsed
        per_device = tokens_per_s / self.env.world_size
        record = {
            "train/loss": sum(losses) / len(losses),
            "train/lr": self.engine.get_lr()[0],
            "train/grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
            "train/skipped_steps": self.skipped,
            "perf/step_time_s": elapsed / steps,
            "perf/tokens_per_s": tokens_per_s,
            "perf/tokens_per_s_per_device": per_device,
            "perf/data_wait_share": self.timers["data"] / elapsed,
            "perf/outside_compute_share": max(0.0, 1 - self.timers["compute"] / elapsed),
            **memory_stats(self.env.device), **self._axes(),
        }
        if self.peak:
            record["perf/mfu"] = per_device * self.flops_per_token / self.peak
        self.timers = dict.fromkeys(self.timers, 0.0)
        if self.env.is_main:
            self.logger.log(record, self.step)
            mfu = f" mfu {record['perf/mfu']:.1%}" if "perf/mfu" in record else ""
            progress.write(f"step {self.step:>6} | loss {record['train/loss']:.4f} | lr {record['train/lr']:.2e} "
                           f"| grad {record['train/grad_norm']:.3f} | {tokens_per_s:,.0f} tok/s{mfu}")


class _NoProgress:
    """No bar (logging.progress=false, batch logs), but the log lines still print."""

    def update(self, n): pass
    def set_postfix(self, **kw): pass
    def close(self): pass

    def write(self, s):
        print(s, flush=True)


def _progress(enabled: bool, initial: int, total: int):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                file=sys.stdout, mininterval=1.0)


def _requeue_if_slurm(env: distributed.Dist, signum: int) -> None:
    """Under slurm/pretrain.sbatch (PRETRAIN_REQUEUE=1), SIGUSR1 (the time-limit/preemption warning
    asked for with --signal) puts the job back in the queue; the rerun resumes from the checkpoint
    just saved. SIGTERM (scancel, or the end of the time limit) only saves: a cancelled job stays
    cancelled."""
    job = os.environ.get("SLURM_JOB_ID")
    if env.is_main and job and signum == signal.SIGUSR1 and os.environ.get("PRETRAIN_REQUEUE") == "1":
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        # The requeue itself signals every process of the job, scontrol included: -SIGTERM is success.
        ok = result.returncode in (0, -signal.SIGTERM)
        print(f"pretrain: scontrol requeue {job}: {'ok' if ok else result.stderr.strip()}", flush=True)


def run(config_path: str, overrides: list[str]) -> None:
    """Entry point of `pretrain train`: raises UserError subclasses for user mistakes; exits with
    EXIT_PREEMPTED after a signal-triggered save."""
    from pretrain.build import build_run

    stop = StopSignal()
    # torch.distributed warns at every ZeRO-3 collective that DeepSpeed still calls by its old name.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    env = distributed.init(_backend_override(overrides))
    logger: MetricLogger = MetricLogger()
    try:
        cfg = load_config(config_path, overrides, world_size=env.world_size)
        trainer, logger = build_run(cfg, env, stop)
        summary = trainer.fit()
        if env.is_main:
            trained = (f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
                       if summary["first_loss"] is not None else "nothing left to train")
            print(f"done: {summary['final_step']} steps, {trained}"
                  + (f", eval loss {summary['eval/loss']:.3f}" if "eval/loss" in summary else "")
                  + f", run dir {cfg.train.run_dir}", flush=True)
    except Preempted as e:
        if env.is_main:
            print(f"pretrain: {e}; exiting with {EXIT_PREEMPTED} (resume with checkpoint.resume=auto)",
                  flush=True)
        # The requeue makes Slurm signal every process of the job: flush W&B before it, and let no
        # rank exit before it is done (an early exit makes srun/torchrun kill rank 0).
        logger.close()
        logger = MetricLogger()
        distributed.barrier()
        _requeue_if_slurm(env, e.signum)
        distributed.barrier()
        preempted = True
    else:
        preempted = False
    finally:
        logger.close()
        distributed.shutdown()
    if preempted:
        sys.exit(EXIT_PREEMPTED)


def _backend_override(overrides: list[str]) -> str:
    for item in overrides:
        if item.startswith("distributed.backend="):
            return item.split("=", 1)[1]
    return "auto"
