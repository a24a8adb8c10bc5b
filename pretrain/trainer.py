"""The Trainer: one optimizer step, one evaluation, one save, and the loop around them.

It knows nothing of launchers, signals' origins, exit codes or files: pretrain/train.py builds it,
pretrain/checkpoint/manager.py saves and restores it (`state_dict()`), and it raises NonFiniteStep or
StopRequested for the entry point to turn into exit codes.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import time

import torch

import data_pipeline as dp
from pretrain.errors import NonFiniteStep
from pretrain.faults import inject as faults
from pretrain.faults.spikes import Rollbacks, Spikes
from pretrain.metrics import MetricLogger, attention_logit_maxima, memory_stats, peak_flops
from pretrain.model.moe import RoutingStats
from pretrain.optim.optimizer import set_lr
from pretrain.parallel import distributed, ulysses
from pretrain.parallel.parallelize import grad_norm, tensor_parallel_dim, trainer_clips
from pretrain.parallel.traffic import Traffic

log = logging.getLogger(__name__)


class StopRequested(Exception):
    """A rank received SIGTERM/SIGUSR1: raised on every rank after the checkpoint of the current
    step is saved."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by signal {signum} after step {step}")


class Trainer:
    def __init__(self, cfg, env: distributed.Dist, engine, loader, val_batches, schedule, ckpt, logger: MetricLogger,
                 flops_per_token: float, precision: str, stop, tasks=None):
        self.cfg, self.env, self.engine, self.loader = cfg, env, engine, loader
        self.tasks = tasks  # train.eval_tasks: a pretrain.eval.tasks.TaskSuite bound to the tokenizer, or None
        self.val_batches, self.schedule, self.ckpt, self.logger = val_batches, schedule, ckpt, logger
        self.flops_per_token, self.stop = flops_per_token, stop
        self.accum = cfg.grad_accum(env.dp_size)
        self.tokens_per_step = cfg.global_batch(env.dp_size) * cfg.data.seq_len
        self.peak = peak_flops(env.device, precision, cfg.distributed.peak_flops)
        self.step = 0  # optimizer steps done
        self.skipped = 0  # steps whose update was dropped (non-finite loss or gradient norm)
        self.skipped_in_a_row = 0
        self.dropped = False  # the latest step's update was dropped (a spike, or non-finite)
        self.loss_scale_skips = 0  # fp16: steps DeepSpeed dropped to lower the loss scale (not failures)
        self.spike_skips = 0  # steps dropped as loss or gradient-norm spikes (resilience.spike_sigma)
        self.fp16 = precision == "fp16"
        self.saved_step = -1  # step of the newest checkpoint of this run (no second save of a step)
        self.saved_at = time.monotonic()  # when the newest save started (checkpoint.every_minutes)
        self.data_iter = None  # made in fit(), after a resume has positioned the loader
        self.timers = dict.fromkeys(("data", "compute"), 0.0)
        self.optimizer = engine.optimizer
        self.lr = schedule(0)  # the rate of the latest step
        self.decay_end = None  # in a WSD-S decay branch: the step it ends at (the schedule decays to it)
        self.branches: dict[str, dict] = {}  # finished decay branches: str(end step) -> their results
        self.source_names = dp.source_names(cfg.data.sources)  # data/tokens/NAME
        self.clip = cfg.optimizer.grad_clip if trainer_clips(cfg, precision) else 0.0  # else DeepSpeed clips
        # (stage 0 under tensor parallelism: the parameters that are this rank's slices, for the norm)
        self._tp_split = {id(p) for name, p in engine.module.named_parameters()
                          if env.tp > 1 and tensor_parallel_dim(name) is not None}
        self.grad_norm = None  # the latest global gradient norm, when the trainer computed it
        self._drop_update = False  # this step's update was dropped for a non-finite loss
        self._grad_nonfinite = False  # the update was dropped for a non-finite gradient norm
        self._stats = self._host_stats = None  # this step's reduced losses: on the device, and once read
        self.faults = faults.Injector(faults.from_env(), env.rank, ckpt.run.path)  # PRETRAIN_FAULT (docs/reliability.md)
        self.watchdog = self.stragglers = self.compute_clock = None  # pretrain/faults/, while fit() runs
        self.traffic = None  # the last step's collectives, counted when it is logged (pretrain/parallel/traffic.py)
        r = cfg.resilience
        self.spikes = Spikes(r.spike_sigma, r.spike_window, r.spike_warmup)
        self.rollbacks = Rollbacks(r, ckpt.run.path, ckpt.run.run_id, env.is_main, self.accum)
        ckpt.after_write = self.faults.at_save_written
        ckpt.progress = self._progress
        ckpt.pinned = lambda: self.rollbacks.pinned(self.step)
        inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # torch AdamW inside ZeRO
        inner.step = self._guarded(inner.step, inner)
        args = engine.module.args  # an MoE model's routing: the bias updates and the moe/ metrics
        self.routing = RoutingStats(engine.module, args.moe_bias_rate) if args.moe_experts else None
        self.z_loss = args.z_loss  # the output z-loss's coefficient: train/loss leaves it out, train/z_loss shows it
        self._z_losses: list[torch.Tensor] = []  # this rank's per-micro-batch z-losses since the last log (device)
        self.last_batch = None  # the latest step's last micro-batch (inputs, labels, extra): logging.attn_logits

    # -- state that survives a restart
    def state_dict(self) -> dict:
        return {"step": self.step, "skipped": self.skipped, "branches": self.branches,
                "loss_scale_skips": self.loss_scale_skips, "spike_skips": self.spike_skips,
                "spikes": self.spikes.state_dict(), **self.rollbacks.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.skipped = state["step"], state.get("skipped", 0)
        self.loss_scale_skips = state.get("loss_scale_skips", 0)
        self.spike_skips = state.get("spike_skips", 0)
        self.spikes.load_state_dict(state.get("spikes", {}))
        self.rollbacks.load_state_dict(state)
        self.branches = dict(state.get("branches", {}))
        self.saved_step = self.step

    @property
    def tokens_seen(self) -> int:
        return self.step * self.tokens_per_step

    # -- one step
    def _guarded(self, step, inner):
        """DeepSpeed has no "drop this update" outside fp16 loss scaling, and only some of its
        optimizers check the gradient norm (ZeRO-3 always, ZeRO-1/2 in fp32, stage 0 never), so the
        inner torch optimizer's step is wrapped: it runs only if the loss was finite on every rank
        and the global gradient norm is finite. DeepSpeed clears the gradients either way. The
        step's one host sync happens here: the reduced losses and the norm are read together."""
        @functools.wraps(step)
        def guarded(*args, **kwargs):
            norm = getattr(self.optimizer, "_global_grad_norm", None)  # ZeRO's, before clipping
            params = None
            if norm is None:  # stage 0: the full (already averaged) gradients are here, the same on every rank
                params = [p for g in inner.param_groups for p in g["params"] if p.grad is not None]
                norm = self.grad_norm = grad_norm(params, self._tp_split) if params else torch.zeros(())
            loss_sum, bad, norm_value = self._read_stats(norm)
            if bad:
                self._nonfinite(f"loss is {self._mean(loss_sum)}")  # stop: raises
                return None
            if not math.isfinite(norm_value) or norm_value < 0:  # DeepSpeed masks a NaN/Inf group norm to -1
                self._grad_nonfinite = True
                return None
            self._spike = self.spikes.check(self._mean(loss_sum), norm_value)
            if self._spike:  # (the same on every rank: the loss and the norm are global)
                return None
            if self.clip and params:  # (it takes the parameters, and scales their .grad)
                torch.nn.utils.clip_grads_with_norm_(params, self.clip, norm)
            return step(*args, **kwargs)
        return guarded

    def _read_stats(self, norm=None) -> list[float]:
        """[sum of the step's losses over micro-batches and ranks, how many were not finite, (the
        gradient norm)]: read on the host once per step, by the guard with the norm, or after the
        step where DeepSpeed skipped the update itself and the guard never ran."""
        if self._host_stats is None:
            parts = [self._stats] if norm is None else [self._stats, torch.as_tensor(norm).reshape(1).to(self._stats)]
            self._mark("collective")  # on a GPU, the wait for the step's reductions is here
            self._host_stats = torch.cat(parts).tolist()
            self._mark("optimizer")
        return self._host_stats

    def _mark(self, phase: str) -> None:
        """This rank enters `phase` of the step being trained (the watchdog names it if it hangs)."""
        if self.watchdog is not None:
            self.watchdog.mark(phase, self.step + 1)

    def _progress(self) -> None:
        """This rank made progress in its current phase (a long one: eval, a data skip, a conversion)."""
        if self.watchdog is not None:
            self.watchdog.progress()

    def _mean(self, loss_sum: float) -> float:
        """The step's mean loss from the sum of every rank's micro-batch losses (the losses of a
        sequence-parallel group's ranks average to the group's mean, as data-parallel ranks' do)."""
        return loss_sum / (self.accum * self.env.world_size)

    def _next_batch(self):
        self._mark("data")
        t0 = time.perf_counter()
        batch = next(self.data_iter)
        self.timers["data"] += time.perf_counter() - t0
        return self._inputs(batch)

    def _inputs(self, batch: dict):
        """(input ids, labels, the model's other arguments) on the device: under sequence parallelism
        this rank's slice of the sequences, with its positions, the documents and the label count of
        the whole sequences (data_pipeline.sequence_shard)."""
        a = self.engine.module.args
        if self.env.sp > 1:
            batch = dp.sequence_shard(batch, self.env.sp_rank, self.env.sp, a.document_eot, a.document_positions)
        else:
            batch = {**batch, **dp.document_inputs(batch["input_ids"], a.document_eot, a.document_positions)}
        extra = {k: v.to(self.env.device, non_blocking=True) if torch.is_tensor(v) else v
                 for k, v in batch.items() if k not in ("input_ids", "labels")}
        return (batch["input_ids"].to(self.env.device, non_blocking=True),
                batch["labels"].to(self.env.device, non_blocking=True), extra)

    def train_step(self) -> float:
        """One optimizer step over `accum` micro-batches; returns the global mean loss. One device
        all-reduce and one host sync per step: the losses and their finiteness are reduced together
        after the last forward, and read on the host with the gradient norm, before the update."""
        lr = self.schedule(self.step, self.decay_end)  # the rate of this step; DeepSpeed has no scheduler
        set_lr(self.optimizer, lr)  # x each group's muP multiplier (pretrain/optim/optimizer.py)
        self.lr = lr
        self._drop_update = self._grad_nonfinite = False
        self._spike = ""
        self._host_stats = None
        losses = torch.zeros(self.accum, device=self.env.device)
        for i in range(self.accum):
            inputs, labels, extra = self._next_batch()
            self._mark("forward/backward")
            self.faults.at_forward(self.step + 1, i == 0)
            t0 = time.perf_counter()
            loss = self.engine(inputs, labels, loss_chunk=self.cfg.train.loss_chunk_tokens, **extra)  # mean over tokens
            loss = self.faults.loss(loss, self.step + 1)
            # (the loss includes an MoE model's balancing and z losses and the output z-loss; train/loss
            # is the cross-entropy)
            ce = loss.detach() - self.routing.micro_batch() if self.routing else loss.detach()
            if self.z_loss:
                z = self.engine.module.output.last_z_loss
                self._z_losses.append(z)
                ce = ce - self.z_loss * z
            losses[i] = ce
            if i == self.accum - 1:  # queued on the device; read by _read_stats
                self._stats = torch.stack([losses.sum(), (~torch.isfinite(losses)).sum().float()])
                self._mark("collective")
                distributed.all_reduce(self._stats)
                self._mark("forward/backward")
            # Backward runs even for a bad micro-batch: ZeRO's backward and step are collective and
            # expect gradients; the update itself is dropped by _guarded.
            self.engine.backward(loss)
            self._mark("optimizer")
            self.engine.step()
            self.timers["compute"] += time.perf_counter() - t0
        if self.cfg.logging.attn_logits:
            self.last_batch = inputs, labels, extra
        loss_sum, bad = self._read_stats()[:2]
        if bad and not self._drop_update:  # DeepSpeed dropped the update itself; the guard never ran
            self._nonfinite(f"loss is {self._mean(loss_sum)}")
        # The gradient norm was not finite: our guard or DeepSpeed's own overflow check dropped the update.
        grad_bad = self._grad_nonfinite or not self.engine.was_step_applied()
        if grad_bad and self.fp16 and not self._grad_nonfinite and not bad:
            # fp16's dynamic loss scaling: an overflow of the scaled gradients drops the update and halves
            # the scale, as designed (every run starts too high, at 2^16). DeepSpeed checks before the
            # update, so our guard never saw the step; it is not a non-finite step.
            self.loss_scale_skips += 1
            grad_bad = False
        if grad_bad and not self._drop_update:
            self._nonfinite(f"gradient norm is {self._norm()}", after_step=True)
        self.step += 1
        self.dropped = bool(self._spike or self._drop_update or grad_bad)
        if self._spike:
            self.spike_skips += 1
            self.skipped_in_a_row += 1
            log.warning("warning: step %d is a spike (%s): its update was dropped (%d in all)", self.step,
                        self._spike, self.spike_skips)
            self._stop_if_diverging()
        elif self._drop_update or grad_bad:
            self.skipped += 1
            self.skipped_in_a_row += 1
            log.warning("warning: step %d is not finite: its update was dropped (%d in a row, %d in all)",
                        self.step, self.skipped_in_a_row, self.skipped)
            self._stop_if_diverging()
        else:
            self.skipped_in_a_row = 0
            if len(self._host_stats) == 3:  # (the guard read the norm: the update was applied)
                self.spikes.accept(self._mean(loss_sum), self._host_stats[2])
        if self.routing:
            self.routing.step_done(applied=not self.dropped)
        return self._mean(loss_sum)

    def _stop_if_diverging(self) -> None:
        limit = self.cfg.train.max_consecutive_skips
        if limit and self.skipped_in_a_row >= limit:
            raise NonFiniteStep(
                f"{self.skipped_in_a_row} dropped steps in a row (non-finite or spikes; train.max_consecutive_skips="
                f"{limit}), the last at step {self.step}: the run is diverging; the last checkpoint is "
                "intact: lower optimizer.lr, then resume with checkpoint.resume=auto")

    def _loss_scale(self) -> float:
        opt = self.engine.optimizer
        return float(getattr(opt, "cur_scale", None) or getattr(opt, "loss_scale", 0.0))

    def _norm(self) -> float:
        """The latest step's global gradient norm before clipping (a host sync: read when logging)."""
        norm = self.grad_norm if self.grad_norm is not None else self.engine.get_global_grad_norm()
        return float(norm if norm is not None else 0.0)

    def _nonfinite(self, what: str, after_step: bool = False) -> None:
        """A non-finite step: stop (before any update) or drop this step's update."""
        if self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteStep(
                f"{what} at step {self.step + 1}: stopped before the update, so the weights and the last "
                "checkpoint are intact; lower optimizer.lr or set train.on_nonfinite=skip, then resume with "
                "checkpoint.resume=auto")
        if not after_step:
            self._drop_update = True

    @property
    def evaluates(self) -> bool:
        return bool(self.val_batches) or self.tasks is not None

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss and perplexity over the fixed validation batches (the same in every run), and
        each downstream task's means (train.eval_tasks) as eval/TASK/METRIC."""
        self._mark("eval")
        self.engine.eval()
        out = {}
        if self.val_batches:
            sums = torch.zeros(2, device=self.env.device, dtype=torch.float64)
            for batch in self.val_batches:
                self._progress()
                inputs, labels, extra = self._inputs(batch)
                scored = (labels != -100).sum()
                loss = self.engine(inputs, labels, loss_chunk=self.cfg.train.loss_chunk_tokens, **extra)
                sums[0] += loss * extra.get("label_count", scored)  # this rank's summed loss
                sums[1] += scored
            distributed.all_reduce(sums)
            loss = (sums[0] / sums[1]).item()
            out = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0))}
        if self.tasks is not None:  # the engine's forward without labels gives logits
            t0 = time.perf_counter()

            def logits(tokens):
                self._progress()
                a = self.engine.module.args
                return self.engine(tokens, **dp.document_inputs(tokens, a.document_eot, a.document_positions))

            # Task requests are short: each rank scores its own, whole, without the sequence exchange.
            # A tensor-parallel group runs each forward together: its ranks score the same requests,
            # and one rank's results per group count.
            env, gather = self.env, distributed.all_gather_objects
            rank, world = (env.dp_rank, env.dp_size) if env.tp > 1 else (env.rank, env.world_size)
            if env.tp > 1:
                gather = lambda obj: distributed.all_gather_objects(obj)[::env.tp]  # noqa: E731
            with ulysses.local_attention(self.engine.module):
                results = self.tasks(logits, env.device, rank, world, gather, self._progress)
            out.update({f"eval/{task}/{k}": v for task, r in results.items() for k, v in r["metrics"].items()})
            out["eval/tasks_s"] = time.perf_counter() - t0
        self.engine.train()
        return out

    def save(self, wait: bool = False) -> None:
        """Start a checkpoint of this step (written in the background); with `wait`, also finish it."""
        self._mark("save")
        if self.saved_step != self.step:
            self.saved_at = time.monotonic()
            # A previous save still being written is waited for here, not inside ckpt.save, so that
            # it is logged (a busy machine once lost step 2's record of a 4-step run); the wait counts
            # as blocking, as it did there.
            t0 = time.perf_counter()
            previous = self.ckpt.wait()
            blocking = time.perf_counter() - t0 + self.ckpt.save(self.step)
            self._log_save(previous)
            self.logger.log({"checkpoint/blocking_s": blocking}, self.step)
            self.saved_step = self.step
        if wait:
            self._log_save(self.ckpt.wait())

    def _log_save(self, job) -> None:
        """A finished save: its whole duration and size, logged at the current step."""
        if job is not None:
            self.logger.log({"checkpoint/write_s": job.write_s, "checkpoint/size_mb": job.size / 1e6,
                             "checkpoint/step": job.step}, self.step)

    # -- the loop
    def fit(self) -> dict:
        self.watchdog = self._start_watchdog()
        try:
            return self._fit()
        finally:
            self.watchdog.close()
            self.compute_clock.close()
            self.watchdog = None

    def _start_watchdog(self):
        """The watchdog and the straggler report: every rank's host, and one name for this start's
        hang reports (collective)."""
        import socket

        from pretrain.config import STORE_TIMEOUT_S
        from pretrain.faults.stragglers import ComputeClock, Stragglers
        from pretrain.faults.watchdog import Channel, Watchdog

        # Slurm's name for the node where there is one: the name slurm/pretrain.sbatch leaves out.
        host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        names = distributed.all_gather_objects((host, time.strftime("%Y%m%d-%H%M%S")))
        hosts, r = [h for h, _ in names], self.cfg.resilience
        self.stragglers = Stragglers(hosts, r.straggler_warn)
        self.compute_clock = ComputeClock(self.engine.module, self.env.device, self.engine.zero_optimization_stage())
        self.faults.attach(self.engine.module)  # (after the clock: a slowcompute fault sleeps inside its marks)
        start = names[0][1]  # this start's name: its hang reports' folder and store keys
        store = distributed.side_store(f"pretrain/hangs/{start}/", STORE_TIMEOUT_S)
        return Watchdog(self.ckpt.run.path / "hangs" / start, self.env.rank, hosts, r.hang_timeout_s,
                        self.cfg.distributed.timeout_s, Channel(store) if store is not None else None,
                        self.env.device, first_step_compiles=self.cfg.train.compile)

    def _fit(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self.data_iter = iter(self.loader)
        progress = _progress(self.env.is_main and cfg.logging.progress, self.step, t.max_steps)
        first_loss = last_loss = None
        window_start, window_steps, losses = time.perf_counter(), 0, []
        branches = {self.schedule.decay_start(end): end for end in cfg.schedule.decay_points
                    if str(end) not in self.branches and self.schedule.decay_start(end) >= self.step}
        try:
            while self.step < t.max_steps:
                if self.step in branches:
                    # the branch's steps are undone: its time is left out of this window's throughput
                    branch_start, timers = time.perf_counter(), dict(self.timers)
                    self._branch(branches.pop(self.step))
                    window_start += time.perf_counter() - branch_start
                    self.timers = timers
                self.rollbacks.skip(self.data_iter, self.step + 1, self._progress)
                step_start = time.perf_counter()
                logs = (self.step + 1) % cfg.logging.log_every == 0 or self.step + 1 == t.max_steps
                # The bytes of a logged step's collectives: a Python call per op of the step, so only then.
                self.traffic = Traffic(self.env.local_size) if logs and cfg.logging.comm_bytes else None
                with self.traffic or contextlib.nullcontext():
                    loss = self.train_step()
                self.watchdog.step_took(time.perf_counter() - step_start)
                if self._rolled_back():
                    window_start, window_steps, losses = time.perf_counter(), 0, []
                    continue
                if self.cfg.train.compile and first_loss is None:
                    from torch._dynamo.utils import counters

                    log.info("train.compile: the first step (compiling) took %.1f s: %d graphs compiled, %d graph "
                             "breaks", time.perf_counter() - step_start, counters["stats"]["unique_graphs"],
                             sum(counters["graph_break"].values()))
                losses.append(loss)
                window_steps += 1
                first_loss = loss if first_loss is None else first_loss
                last_loss = loss
                progress.update(1)
                progress.set_postfix(loss=f"{loss:.3f}", refresh=False,
                                     tok_s=f"{self.tokens_per_step / (time.perf_counter() - step_start):,.0f}")
                if self.step % cfg.logging.log_every == 0 or self.step == t.max_steps:
                    self._log_train(losses, window_steps, time.perf_counter() - window_start)
                    losses, window_start, window_steps = [], time.perf_counter(), 0
                if t.eval_every and self.step % t.eval_every == 0 and self.step < t.max_steps and self.evaluates:
                    self._log_eval(self.evaluate())
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.step < t.max_steps:
                    self.save()
                # Right after the step, so a signal costs at most the rest of one step before the
                # save starts (srun answers scancel's SIGTERM with SIGKILL within a second); with it,
                # whether a background save failed on any rank, and whether a timed save is due on
                # any (clocks differ), so that all stop and save at the same step.
                minutes = cfg.checkpoint.every_minutes
                due = bool(minutes) and time.monotonic() - self.saved_at >= 60 * minutes
                self._mark("collective")
                signum, save_failed, due = distributed.agree_max([self.stop.received or 0, self.ckpt.save_failed(),
                                                                  int(due)])
                if save_failed:
                    self.ckpt.wait()  # raises the failure
                self._log_save(self.ckpt.finished())
                if signum:
                    self.save(wait=True)
                    raise StopRequested(signum, self.step)
                if due and self.step < t.max_steps:
                    self.save()
        finally:
            progress.close()
            self.data_iter = None  # stop the data workers now, before the process is torn down
        summary = {"final_step": self.step, "first_loss": first_loss, "final_loss": last_loss}
        self._log_mixture(self.data_metrics())
        if self.evaluates:
            summary.update(self.evaluate())
            self._log_eval(summary)
        self.save(wait=True)
        return summary

    def _rolled_back(self, newest: int | None = None) -> bool:
        """After a step: whether it was a spike that brought the run back to a checkpoint (the newest
        before the spikes, and not after step `newest`: a decay branch's start) with their data skipped."""
        if not self._spike:
            return False
        target = self.rollbacks.spiked(self.step, self.ckpt, newest)
        if target is None:
            return False
        spike_skips = self.spike_skips  # (a count of the run, not of the checkpoint)
        self._go_back_to(target)
        self.logger.rewind(self.step)  # metrics.jsonl: the abandoned timeline's records go
        self.spike_skips, self.rollbacks.recent_spikes = spike_skips, []
        self.logger.log({"train/rollbacks": self.rollbacks.rollbacks}, self.step)
        return True

    def _go_back_to(self, path) -> None:
        """Restore the run to the checkpoint `path` (a decay branch's start, a rollback's target);
        the data restarts from its restored position."""
        from pretrain.checkpoint.layout import read_meta
        from pretrain.checkpoint.manager import Start

        self.data_iter = None  # its workers stop; the restored position gets a fresh iterator
        self._mark("branch")
        meta = read_meta(path)
        self.ckpt.restore(Start("resume", self.ckpt.run.run_id, path, meta, meta["step"]))
        self.data_iter = iter(self.loader)
        if self.routing:  # (the routers' biases came back with the weights)
            self.routing.reset()

    def _branch(self, end: int) -> None:
        """WSD-S: from this step of the stable phase, decay to `end` on a branch, evaluate, then bring
        the run back to this step (a checkpoint saved first) and go on with the stable phase. The
        branch is what a run of `end` steps with a WSD schedule would be: its eval loss is a point at
        end x tokens-per-step tokens. A stop signal during a branch stops the run; the resume from
        this step's checkpoint runs the branch again. Spikes are dropped as in the stable phase, and a
        rollback goes back to this step's checkpoint, so the branch applies `end` - this step updates
        unless single spikes were dropped (branch/dropped_steps: `pretrain scaling fit` refuses it)."""
        from pretrain.checkpoint.layout import step_dir_name

        start = self.step
        self.save(wait=True)
        path = self.ckpt.root / step_dir_name(start)
        log.info("step %6d | decay branch to step %d (schedule.decay_points), then back here", start, end)
        self.decay_end, losses, dropped = end, [], 0
        self.rollbacks.recent_spikes = []  # the stable phase's: they would roll back to before the branch
        try:
            while self.step < end:
                self.rollbacks.skip(self.data_iter, self.step + 1, self._progress)
                loss = self.train_step()
                if self._rolled_back(newest=start):  # (to this step: the branch starts over)
                    losses, dropped = [], 0
                    continue
                if self.dropped:
                    dropped += 1
                else:
                    losses.append(loss)
                signum = self.stop.agreed()
                if signum:
                    raise StopRequested(signum, start)
            last = losses[-10:]  # (of the applied steps: a dropped one's loss may be a spike's)
            result = {"branch/end_step": end, "branch/tokens": end * self.tokens_per_step,
                      "branch/flops": end * self.tokens_per_step * self.flops_per_token,
                      "branch/train_loss": sum(last) / len(last) if last else math.nan,
                      "branch/dropped_steps": dropped}
            if self.evaluates:
                ev = self.evaluate()
                if "eval/loss" in ev:
                    result["branch/eval_loss"] = ev["eval/loss"]
                # every branch gives task points too: branch/TASK/METRIC
                result.update({"branch/" + k.removeprefix("eval/"): v for k, v in ev.items() if k.count("/") == 2})
        finally:
            self.decay_end = None
        self._go_back_to(path)
        self.branches[str(end)] = result
        self.logger.log(result, start)
        log.info("step %6d | decay branch to step %d: train loss %.4f%s", start, end, result["branch/train_loss"],
                 f", eval loss {result['branch/eval_loss']:.4f}" if "branch/eval_loss" in result else "")

    def data_metrics(self) -> dict:
        """Since the start of the run, over all ranks (collective): the tokens drawn from each source,
        their shares of the total (the mixture actually trained on) when there are several, and the
        read amplification of the text sources (rows parsed by all readers / documents used)."""
        stats = self.loader.stats()
        names = self.source_names
        mine = [stats["parsed_docs"], stats["docs"] + stats["empty_docs"], *stats["sequences"]]
        if self.env.rank % self.env.group_size:  # the ranks of a sequence- or tensor-parallel group read one batch
            mine = [0] * len(mine)
        parsed, used, *sequences = distributed.sum_over_ranks(mine)
        out = {}
        if used:
            out["data/read_amplification"] = parsed / used
        total = sum(sequences)
        for name, n in zip(names, sequences):
            out[f"data/tokens/{name}"] = n * self.cfg.data.seq_len
            if len(sequences) > 1 and total:
                out[f"data/share/{name}"] = n / total
        return out

    def _log_mixture(self, metrics: dict) -> None:
        """One line: the tokens drawn from each source against the configured weights."""
        sources = self.cfg.data.sources
        total_weight = sum(s.weight for s in sources)
        parts = [f"{name} {metrics[f'data/tokens/{name}']:,}"
                 + (f" ({metrics[f'data/share/{name}']:.1%}, weight {src.weight / total_weight:.1%})"
                    if f"data/share/{name}" in metrics else "")
                 for name, src in zip(self.source_names, sources)]
        amplification = metrics.get("data/read_amplification")
        log.info("data: tokens drawn since the start of the run: %s%s", ", ".join(parts),
                 f"; read amplification {amplification:.2f}" if amplification else "")

    def _axes(self) -> dict:
        return {"tokens_seen": self.tokens_seen, "flops": self.tokens_seen * self.flops_per_token}

    def _log_eval(self, result: dict) -> None:
        record = {k: v for k, v in result.items() if k.startswith("eval/")}
        self.logger.log({**record, **self._axes()}, self.step)
        if "eval/loss" in record:
            log.info("step %6d | eval loss %.4f | perplexity %.2f", self.step, record["eval/loss"],
                     record["eval/perplexity"])
        tasks = {k.split("/")[1] for k in record if k.count("/") == 2}  # (eval/TASK/METRIC)
        for task in sorted(tasks):
            log.info("step %6d | eval %s: %s", self.step, task, " | ".join(
                f"{k.rsplit('/', 1)[1]} {v:.4f}" for k, v in record.items() if k.startswith(f"eval/{task}/")))

    def _max_attn_logit(self) -> float:
        """logging.attn_logits: the largest attention logit of the step's last micro-batch (after the
        update), max over ranks: a no-grad forward on every rank (_log_train runs on all, and ZeRO-3
        gathers collectively), left out of the window's throughput; in eval mode as evaluate's."""
        inputs, labels, extra = self.last_batch
        self.engine.eval()
        try:
            maxima = attention_logit_maxima(self.engine.module, lambda: self.engine(
                inputs, labels, loss_chunk=self.cfg.train.loss_chunk_tokens, **extra))  # (n_layers,)
        finally:
            self.engine.train()
        return distributed.all_reduce(maxima, op="max").max().item()

    def _log_train(self, losses, steps, elapsed) -> None:
        tokens_per_s = steps * self.tokens_per_step / elapsed
        per_device = tokens_per_s / self.env.world_size
        record = {
            "train/loss": sum(losses) / len(losses),
            "train/lr": self.lr,
            "train/grad_norm": self._norm(),
            "train/skipped_steps": self.skipped,
            "train/spike_skips": self.spike_skips,
            **({"train/loss_scale_skips": self.loss_scale_skips, "train/loss_scale": self._loss_scale()}
               if self.fp16 else {}),
            "perf/step_time_s": elapsed / steps,
            "perf/tokens_per_s": tokens_per_s,
            "perf/tokens_per_s_per_device": per_device,
            "perf/data_wait_share": self.timers["data"] / elapsed,
            "perf/outside_compute_share": max(0.0, 1 - self.timers["compute"] / elapsed),
            **memory_stats(self.env.device), **self._axes(),
        }
        if self.traffic is not None:
            record.update(self.traffic.metrics())
        if self.routing:
            record.update(self.routing.metrics())
        if self._z_losses:  # (mean logsumexp^2 over every rank's micro-batches, the coefficient not applied; a
            # sequence-parallel group's ranks' values average to its mean, as their losses do)
            z = distributed.all_reduce(torch.stack(self._z_losses).mean()) / self.env.world_size
            record["train/z_loss"] = z.item()
            self._z_losses = []
        if self.peak:
            record["perf/mfu"] = per_device * self.flops_per_token / self.peak
        if self.cfg.logging.attn_logits:
            record["train/max_attn_logit"] = self._max_attn_logit()
        record.update(self.data_metrics())
        record.update(self.stragglers(distributed.all_gather_objects(
            (elapsed * self.watchdog.busy_share(), self.compute_clock.take()))))
        self.timers = dict.fromkeys(self.timers, 0.0)
        self.logger.log(record, self.step)
        mfu = f" mfu {record['perf/mfu']:.1%}" if "perf/mfu" in record else ""
        log.info("step %6d | loss %.4f | lr %.2e | grad %.3f | %s tok/s%s", self.step, record["train/loss"],
                 record["train/lr"], record["train/grad_norm"], f"{tokens_per_s:,.0f}", mfu)


class _NoProgress:
    def update(self, n): pass
    def set_postfix(self, **kw): pass
    def close(self): pass


def _progress(enabled: bool, initial: int, total: int):
    """A tqdm bar on rank 0 (log lines are written above it through logging, see train.py)."""
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                file=sys.stdout, mininterval=1.0)
