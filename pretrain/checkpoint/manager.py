"""Sharded checkpoints: atomic, durable, verified, rotated, resumable at another world size; and the
choice of where a run starts (fresh, resume, fine-tune), made in one place.

A save writes into `.partial_step_...`. Every rank fsyncs and checksums its share of the files;
only when all ranks have written without error is the manifest written, the folder fsynced and
renamed to `step_...`, and the parent fsynced (as databases do): after a crash or a power loss a
`step_...` folder is complete. A failed save (a full disk) removes its partial folder, leaves the
previous checkpoints untouched and stops the run with one line. Rotation deletes only complete
checkpoints of this run (its run id), and only after the new one is complete.

Everything that survives a restart is a tracked state (`track(trainer=..., data=..., rng=...)`:
objects with state_dict()/load_state_dict(), whose state_dict() every rank calls, so it may gather
across ranks) plus the DeepSpeed engine (its own shards). `restore(start)` brings them all back.

The layout on disk: pretrain/checkpoint/layout.py; whole weights read back: weights.py.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pretrain.checkpoint import reshard
from pretrain.checkpoint.layout import (FORMAT, FUNCTION_FIELDS, SHAPE_FIELDS, check_files, complete_checkpoints,
                                       model_shape, read_meta, resolve_checkpoint, step_dir_name, step_folders)
from pretrain.checkpoint.reshard import partitioned
from pretrain.checkpoint.rundir import RunDir, fsync_dir, new_run_id, write_atomic
from pretrain.config import is_hf_model
from pretrain.errors import CheckpointError, RunDirError, collective
from pretrain.parallel import distributed, expert_parallel

log = logging.getLogger(__name__)


@dataclass
class Start:
    """Where a run starts: kind "fresh", "resume" (everything from `path`) or "finetune" (weights,
    optionally optimizer and step, from `path`). `step` is the first step's predecessor."""

    kind: str
    run_id: str
    path: Path | None = None
    meta: dict | None = None
    step: int = 0

    def universal(self, env: distributed.Dist) -> bool:
        """The optimizer state is partitioned over another layout (world size, tensor-parallel or
        expert-parallel size): it loads through a universal conversion (pretrain/checkpoint/reshard.py).
        ZeRO stage 0 in fp32 saves it whole per tensor-parallel rank: any data-parallel size loads it
        directly."""
        return self.meta is not None and partitioned(self.path) and (
            self.meta["world_size"] != env.world_size or self.meta.get("tensor_parallel", 1) != env.tp
            or self.meta.get("expert_parallel", 1) != env.ep)

    def read_state(self, name: str) -> dict | None:
        f = self.path / f"{name}_state.json"
        return json.loads(f.read_text()) if f.is_file() else None


class CheckpointManager:
    """Owns run_dir/checkpoints: picks the start point, saves, verifies, rotates this run's own
    checkpoints and restores the tracked states. Collective: every rank calls every method."""

    def __init__(self, run: RunDir, cfg, env: distributed.Dist, *, model_args, zero_stage: int,
                 run_config: dict, tokenizer_json: str, tokenizer_fingerprint: str, overwrite: bool,
                 provenance: dict):
        self.run, self.cfg, self.env = run, cfg, env
        self.root = run.checkpoints
        self.model_args, self.zero_stage, self.run_config = model_args, zero_stage, run_config
        self.tokenizer_json, self.tokenizer_fingerprint = tokenizer_json, tokenizer_fingerprint
        self.overwrite, self.provenance = overwrite, provenance
        self.states: dict = {}
        self.engine = None
        self._writer = None  # saving.ShardWriter, DeepSpeed's checkpoint engine once track(engine=) ran
        self._job = None  # the save in progress (saving.SaveJob)
        self.after_write = None  # f(step), in each rank's save thread once its files are written (PRETRAIN_FAULT)
        self.progress = lambda: None  # f(), called as a long conversion goes on (the watchdog's progress mark)
        self.pinned = lambda: None  # f() -> a step: rotation keeps the newest checkpoint before it (a rollback's)
        self.last_size = 0  # bytes of the newest checkpoint, for the free-space warning
        self.timings: dict[str, float] = {}  # verify_s, load_s of the start point (seconds)
        # What `begin` changes in the run dir, decided by plan_start: the owner train.overwrite replaces,
        # and the checkpoints set aside (folder, reason in its new name, why in the warning).
        self._replacing: dict | None = None
        self._aside: list[tuple[Path, str, str]] = []

    # ------------------------------------------------------------------ start point
    def plan_start(self) -> Start:
        """Decide, verify and announce where this run starts. Reads the run dir only: what the start
        will change there (an earlier run replaced, newer or corrupt checkpoints set aside, run.json)
        waits for `begin`, called once every other start check has passed too. Raises
        CheckpointError/RunDirError on every rank when it cannot start without losing data."""
        c = self.cfg
        self._replacing, self._aside = None, []
        owner = distributed.on_main(self.run.owner)
        if c.resume == "auto":
            start = self._latest_good()
        elif c.resume != "none":
            start = self._resume_from(distributed.on_main(resolve_checkpoint, c.resume))
        else:
            start = None
        if start is not None:
            if owner and owner.get("run_id") != start.run_id:
                self._refuse_or_replace(owner, f"checkpoint {start.path} belongs to run {start.run_id}")
            corrupt = {ckpt for ckpt, _, _ in self._aside}  # (already set aside for that)
            self._aside += [a for a in self._newer(start) if a[0] not in corrupt]
        else:  # a fresh start (or fine-tuning): this run must own the dir
            same_run_restart = c.resume == "auto" and owner is not None  # crashed before its first checkpoint
            traces = distributed.on_main(self.run.traces)
            if owner and not same_run_restart or traces and not owner:
                self._refuse_or_replace(owner or {}, "this run starts fresh", traces)
                owner = None
            run_id = owner["run_id"] if same_run_restart and owner else new_run_id()
            start = self._finetune_start(run_id) if c.init_from else Start("fresh", run_id)
        start.run_id = distributed.broadcast_object(start.run_id)
        return start

    def begin(self, start: Start) -> None:
        """The start's checks all passed: make the run dir this run's (collective). train.overwrite
        moves the earlier run's files to replaced/, the checkpoints the start leaves behind (corrupt
        ones, and those newer than a resume's, another history) move to set_aside/, and run.json
        names this run."""
        if self._replacing is not None:
            owner = self._replacing
            dest = distributed.on_main(self.run.replace, owner.get("run_id", ""))
            log.info("train.overwrite: moved the files of %s to %s (delete them when you no longer need them)",
                     f"run {owner['run_id']}" if owner.get("run_id") else "another run", dest)
        for ckpt, reason, why in self._aside:
            self._set_aside(ckpt, reason)
            log.warning("warning: %s %s: set aside in %s", ckpt.name, why, self.root / "set_aside")
        self.run.claim(start.run_id, self.provenance)
        distributed.barrier()

    def _refuse_or_replace(self, owner: dict, why: str, traces: list[str] | None = None) -> None:
        """Refuse a start into a dir another run owns, unless train.overwrite (then `begin` replaces it)."""
        traces = traces if traces is not None else distributed.on_main(self.run.traces)
        what = f"run {owner['run_id']}" if owner.get("run_id") else "another run"
        held = f" ({', '.join(traces)})" if traces else ""
        if not self.overwrite:
            raise collective(RunDirError(
                f"run dir {self.run.path} holds {what}{held}, and {why}: continue that run with "
                f"checkpoint.resume=auto, set train.run_dir to another directory, or set train.overwrite=true "
                f"to start over (its files are moved to {self.run.path / 'replaced'}/, not deleted)"))
        self._replacing = owner

    def _corruption(self, ckpt: Path) -> str | None:
        """Collective check of every file against the manifest (sha256 spread over ranks): None if
        the files are intact, else the first problem found."""
        t0 = time.perf_counter()
        problems = [p for p in distributed.all_gather_objects(
            check_files(ckpt, self.env.rank, self.env.world_size)) if p]
        self.timings["verify_s"] = self.timings.get("verify_s", 0.0) + time.perf_counter() - t0
        return problems[0] if problems else None

    def _usable_meta(self, ckpt: Path, optimizer: bool, resume: bool = False) -> dict:
        """meta.json of an intact checkpoint, if this run can load it (raises on every rank if not):
        the same model shape; to load the optimizer shards also this format and the same ZeRO
        stage; to resume, the same RoPE and norm settings too (checkpoints written before they were
        recorded are not checked). Other data or another tokenizer is caught by the data position's
        own check."""
        meta = read_meta(ckpt)
        saved = {**meta["model_shape"], **(meta.get("model_function", {}) if resume else {})}
        ours = {**model_shape(self.model_args), **(model_shape(self.model_args, FUNCTION_FIELDS) if resume else {})}
        diff = [f"{k}: checkpoint {saved.get(k)} vs config {v}" for k, v in ours.items()
                if k in saved and saved[k] != v or k in SHAPE_FIELDS and k not in saved]
        saved_p = meta.get("model_parametrization", {"parametrization": "sp"})  # not recorded: sp
        ours_p = self.model_args.parametrization_spec()
        if saved_p != ours_p:
            raise collective(CheckpointError(
                f"checkpoint {ckpt} was trained with " + ", ".join(f"model.{k}={v}" for k, v in saved_p.items())
                + ", this run has " + ", ".join(f"model.{k}={v}" for k, v in ours_p.items())
                + ": its weights mean another model under these multipliers; set the checkpoint's values "
                  "(or export it and fine-tune from the export, which is sp)"))
        if diff:
            what = "model shape" if any(d.split(":")[0] in SHAPE_FIELDS for d in diff) \
                else "model (RoPE, norm, document masking, MoE routing, layer kinds)"
            raise collective(CheckpointError(f"checkpoint {ckpt} has another {what} ({'; '.join(diff)}): "
                                              "use the model config it was saved with"
                                              + ("" if what == "model shape" else " (to change it, fine-tune from "
                                                 "it with checkpoint.init_from)")))
        if not optimizer:
            return meta
        if meta.get("format", 1) != FORMAT:
            raise collective(CheckpointError(
                f"checkpoint {ckpt} has format {meta.get('format', 1)}, written by an older pretrain: this "
                "version cannot resume it, but checkpoint.init_from and `pretrain export` read its weights"))
        saved_opt = meta.get("optimizer", "adamw")  # (not recorded: written before Muon, AdamW)
        if saved_opt != self._optimizer_name():
            raise collective(CheckpointError(
                f"checkpoint {ckpt} was trained with optimizer.name={saved_opt}, this run has "
                f"optimizer.name={self._optimizer_name()}: a resume continues the optimizer's state; set "
                f"optimizer.name={saved_opt}, or fine-tune from it with checkpoint.init_from (fresh optimizer state)"))
        if meta.get("zero_stage", self.zero_stage) != self.zero_stage:
            raise collective(CheckpointError(
                f"checkpoint {ckpt} was saved with ZeRO stage {meta['zero_stage']}, this run uses "
                f"{self.zero_stage}: set distributed.zero_stage={meta['zero_stage']} to resume "
                "(checkpoint.init_from loads its weights at any stage)"))
        saved_tp = meta.get("tensor_parallel", 1)
        if saved_tp != self.env.tp and not partitioned(ckpt):
            raise collective(CheckpointError(
                f"checkpoint {ckpt} was saved at ZeRO stage 0 in fp32 with tensor_parallel={saved_tp}, this run has "
                f"tensor_parallel={self.env.tp}: the optimizer state of stage 0 is each tensor-parallel rank's own, "
                f"not convertible; resume with distributed.tensor_parallel={saved_tp}, or fine-tune from it with "
                "checkpoint.init_from (its weights load at any layout)"))
        return meta

    def _optimizer_name(self) -> str:
        return self.run_config.get("optimizer", {}).get("name", "adamw")

    def _resume_from(self, ckpt: Path) -> Start:
        problem = self._corruption(ckpt)
        if problem:
            raise collective(CheckpointError(problem))
        meta = self._usable_meta(ckpt, optimizer=True, resume=True)
        log.info("resuming from %s (step %d)", ckpt, meta["step"])
        return Start("resume", meta["run_id"], ckpt, meta, meta["step"])

    def _latest_good(self) -> Start | None:
        """checkpoint.resume=auto: the newest intact checkpoint. Newer broken ones are named and set
        aside; step folders but none intact is an error, never a silent fresh start."""
        folders = distributed.on_main(step_folders, self.root)
        bad = []
        for ckpt in reversed(folders):
            problem = self._corruption(ckpt)
            if problem is not None:
                bad.append((ckpt, problem))
                continue
            meta = self._usable_meta(ckpt, optimizer=True, resume=True)
            for old, why in bad:
                log.warning("warning: not resuming from %s: %s", old.name, why)
                self._aside.append((old, "corrupt", "is corrupt"))
            log.info("resuming from %s (step %d)%s", ckpt, meta["step"],
                     f", the newest intact checkpoint of {len(folders)}" if bad else "")
            return Start("resume", meta["run_id"], ckpt, meta, meta["step"])
        if bad:
            raise collective(CheckpointError(
                f"no usable checkpoint in {self.root}: " + "; ".join(p for _, p in bad)
                + ": restore them, or move them away to start fresh"))
        return None

    def _finetune_start(self, run_id: str) -> Start:
        from pretrain.hf import hub

        c = self.cfg
        if is_hf_model(c.init_from):
            if c.init_load_optimizer or c.init_keep_step:
                raise collective(CheckpointError(
                    f"checkpoint.init_from={c.init_from} is a Hugging Face model, which has weights only: "
                    "unset checkpoint.init_load_optimizer and checkpoint.init_keep_step"))
            path = hub.resolve(c.init_from)
            log.info("continuing pretraining from the Hugging Face model %s", path)
            return Start("finetune", run_id, path, None, 0)
        ckpt = distributed.on_main(resolve_checkpoint, c.init_from)
        problem = self._corruption(ckpt)
        if problem:
            raise collective(CheckpointError(problem))
        meta = self._usable_meta(ckpt, optimizer=c.init_load_optimizer)
        log.info("fine-tuning from %s (step %d)", ckpt, meta["step"])
        return Start("finetune", run_id, ckpt, meta, meta["step"] if c.init_keep_step else 0)

    def _newer(self, start: Start) -> list[tuple[Path, str, str]]:
        """Resuming from an older checkpoint of this run dir: the newer ones are another history.
        `begin` moves them to set_aside/ (kept), so that rotation and later resumes never mix the two."""
        if start.path.parent.resolve() != self.root.resolve():
            return []
        return [(p, f"after_{start.path.name}", "is newer than the checkpoint resumed from")
                for p in distributed.on_main(step_folders, self.root) if p.name > start.path.name]

    def _set_aside(self, ckpt: Path, reason: str) -> None:
        if self.env.is_main:
            dest = self.root / "set_aside" / f"{ckpt.name}.{reason}.{time.strftime('%Y%m%d-%H%M%S')}"
            dest.parent.mkdir(exist_ok=True)
            ckpt.rename(dest)
            fsync_dir(self.root)
            latest = self._newest_complete()
            if latest is not None:
                write_atomic(self.root / "latest", latest.name)
            else:
                (self.root / "latest").unlink(missing_ok=True)
        distributed.barrier()

    def _newest_complete(self) -> Path | None:
        done = complete_checkpoints(self.root)
        return done[-1] if done else None

    def check_data(self, start: Start, loader) -> None:
        """Before the model is built: does the saved data position fit this run's data?"""
        if start.kind == "resume":
            loader.check_state(start.read_state("data"))

    # ------------------------------------------------------------------ tracked state
    def track(self, engine=None, **states) -> None:
        """Register what a checkpoint holds: the DeepSpeed engine and named stateful objects."""
        if engine is not None:
            from pretrain.checkpoint.saving import ShardWriter

            self.engine = engine
            self._writer = ShardWriter(engine)
        self.states.update(states)

    def restore(self, start: Start) -> None:
        """Bring everything tracked back to `start` in one call: for a resume the engine (weights,
        optimizer) and every state; for fine-tuning the optimizer (init_load_optimizer) and the
        step (init_keep_step); the weights of a fine-tune are loaded when the model is built."""
        if start.kind == "fresh":
            return
        t0 = time.perf_counter()
        if start.kind == "finetune":
            if self.cfg.init_load_optimizer:
                self._load_engine(start)
            self.states["trainer"].load_state_dict({"step": start.step})
            return
        self._load_engine(start)
        for name, obj in self.states.items():
            state = start.read_state(name)
            if state is None:
                raise collective(CheckpointError(f"checkpoint {start.path} has no {name}_state.json"))
            obj.load_state_dict(state)
        self.timings["load_s"] = time.perf_counter() - t0
        log.info("resumed from %s at step %d%s", start.path, start.step,
                 f" (saved at world size {start.meta['world_size']})" if start.meta["world_size"] != self.env.world_size
                 else "")

    def _load_engine(self, start: Start) -> None:
        """Weights, optimizer state (and their hyperparameters) from DeepSpeed's shards; at another
        world size or tensor-parallel size through a universal conversion (pretrain/checkpoint/reshard.py)."""
        engine, ckpt = self.engine, start.path
        universal = start.universal(self.env)
        self.check_precision(start, engine.bfloat16_enabled())
        if _saved_bf16(ckpt) != engine.bfloat16_enabled():
            universal = True  # (stages 1-3: the fp32 master weights and moments, re-cut for this engine)
        groups = engine.optimizer.param_groups
        hyper = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in groups]
        # Decided per checkpoint, not once per engine (DeepSpeed reads its config's load_universal
        # at each load): after a resume at another world size, a decay branch or a rollback goes
        # back to a checkpoint of this world size, or to one of the old size.
        engine._config.load_universal_checkpoint = universal
        folder = self._universal_dir(ckpt) if universal else None
        with expert_parallel.dense_checkpoints(engine):
            if universal:
                reshard.load_universal(engine, folder)
            else:
                path, _ = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name, load_optimizer_states=True,
                                                 load_lr_scheduler_states=False)
                if path is None:
                    raise CheckpointError(f"DeepSpeed could not load {ckpt}")
        if not universal:
            if expert_parallel.marked(engine.module):  # (the model states file holds rank 0's experts)
                expert_parallel.from_master_weights(engine)
            return
        # Two flaws of DeepSpeed's ZeRO-3 universal loader with several param groups: it copies
        # the first group's hyperparameters into every group (weight decay on norms and
        # embeddings), and it gives every group the SAME `step` tensor, which torch's AdamW then
        # increments once per group per step (wrong bias correction). Undo both.
        # A third: it leaves `step` on the host, where fused AdamW on a GPU refuses it (capturable
        # and fused AdamW keep it on the parameter's device).
        for group, saved in zip(groups, hyper):
            group.update(saved)
        inner = engine.optimizer.optimizer
        on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
        for param, state in inner.state.items():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone().to(param.device if on_device else "cpu")

    def check_precision(self, start: Start, bf16: bool) -> None:
        """Can the engine, bf16 or not, load `start`'s optimizer state? Raises CheckpointError if not:
        a start checks it before `begin`."""
        loads = start.kind == "resume" or start.kind == "finetune" and self.cfg.init_load_optimizer
        if loads and self.zero_stage == 0 and _saved_bf16(start.path) != bf16:
            # (stage 0's optimizer state is a different object in bf16 and fp32)
            raise collective(CheckpointError(
                f"checkpoint {start.path} was saved at ZeRO stage 0 in {'fp32' if bf16 else 'bf16'}, this run is "
                f"{'bf16' if bf16 else 'fp32'}: resume at the saved precision (at ZeRO stage 0 the optimizer state "
                "differs between them; checkpoint.init_from loads the weights at any precision)"))

    def _universal_dir(self, ckpt: Path) -> Path:
        """Convert `ckpt` to DeepSpeed's universal format (rank 0; cached), for another layout."""
        out = self.root / ".universal" / ckpt.name
        problem, proc = None, None
        done = out / "done"
        # (under expert parallelism the experts' files say so, for DeepSpeed's loader to take each
        # rank's experts from them: a conversion is for one or the other)
        version = reshard.VERSION + (" experts split" if self.env.ep > 1 else "")
        if self.env.is_main and not (done.is_file() and done.read_text() == version):
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pretrain.checkpoint.reshard", str(ckpt), str(out)] + ["--split-experts"] * (
                self.env.ep > 1)
            output = tempfile.TemporaryFile("w+")  # not a pipe: a full one would stall the converter
            proc = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, text=True)
        # A 7B conversion can take longer than a collective timeout: the other ranks do not wait in
        # one collective for it, they meet rank 0 every few seconds until it is done.
        while distributed.agree_max([int(proc is not None and proc.poll() is None)])[0]:
            self.progress()  # (a conversion inside the loop, for a rollback, is not a hang)
            time.sleep(2)
        if proc is not None:
            proc.wait()
            output.seek(0)
            tail = output.read().strip().splitlines()[-1:]
            output.close()
            if proc.returncode != 0:
                problem = (f"could not convert {ckpt} for world size {self.env.world_size} (tensor_parallel="
                           f"{self.env.tp}, expert_parallel={self.env.ep}): {tail}")
        problem = distributed.broadcast_object(problem)
        if problem:
            raise collective(CheckpointError(problem))
        log.info("converted %s to DeepSpeed's universal format for %d rank(s), tensor_parallel=%d, expert_parallel=%d (%s)",
                 ckpt.name, self.env.world_size, self.env.tp, self.env.ep, out)
        return out

    # ------------------------------------------------------------------ save
    def save(self, step: int) -> float:
        """Start saving every tracked state as step_XXXXXXXX (collective); returns the seconds the
        caller was held up: waiting for the previous save, then the copy of the state to host memory
        (pretrain/checkpoint/saving.py). The rest is written in the background; `wait()` collects the outcome,
        and a failure raises CheckpointError on every rank, the partial folder removed."""
        from pretrain.checkpoint import saving

        t0 = time.perf_counter()
        self.wait()
        partial = self.root / f".partial_{step_dir_name(step)}"
        self._warn_if_low_on_space()
        errors = []
        if self.env.is_main:
            try:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
            except OSError as e:
                errors.append((str(partial), e))
        if not any(distributed.all_gather_objects(bool(errors))):
            with expert_parallel.dense_checkpoints(self.engine):
                self.engine.save_checkpoint(str(self.root), tag=partial.name, save_latest=False)
        shards, recorded = self._writer.take()
        states = {name: obj.state_dict() for name, obj in self.states.items()}  # collective gathers
        own = self._own_files(step, states) if self.env.is_main else {}
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()  # the host copies are complete
        job = saving.SaveJob(step, partial, shards, own, errors + recorded, t0)
        job.thread = threading.Thread(target=saving.timed(self._finish), args=(job,), name=f"save-{step}",
                                      daemon=True)
        job.thread.start()
        self._job = job
        job.blocking_s = time.perf_counter() - t0
        return job.blocking_s

    def _finish(self, job) -> None:
        """Background thread of every rank: write, checksum, agree; rank 0 publishes."""
        from pretrain.checkpoint import saving

        group = distributed.checkpoint_group()
        sums = saving.write_rank_files(job, self._writer.inner)
        if self.after_write is not None:
            self.after_write(job.step)
        mine = (sums, saving.describe_failure(job.errors) if job.errors else None)
        reports = distributed.all_gather_objects(mine, group)
        failures = [(r, f) for r, (_, f) in enumerate(reports) if f]
        manifest = {k: v for part, _ in reports for k, v in part.items()}
        outcome = None
        if not failures and self.env.is_main:
            try:
                self._publish(job.partial, self.root / step_dir_name(job.step), manifest)
            except OSError as e:
                outcome = saving.describe_failure([(str(job.partial), e)])
        outcome = distributed.broadcast_object(outcome, group=group)
        if outcome:
            failures = [(0, outcome)]
        if failures:
            if self.env.is_main:
                shutil.rmtree(job.partial, ignore_errors=True)
            job.error = self._failure_message(job.step, failures)
        else:
            job.size = sum(v["size"] for v in manifest.values())

    def wait(self, quiet: bool = False):
        """Wait for the save in progress, if any; return it (once) so that the caller can log it.
        Raises its failure (CheckpointError, on every rank) unless `quiet`."""
        job, self._job = self._job, None
        if job is None:
            return None
        job.thread.join()
        if job.error and not quiet:
            raise collective(CheckpointError(job.error))
        if not job.error:
            self.last_size = job.size
        return job

    def save_failed(self) -> bool:
        """The save in progress ended with an error (a cheap local check, for the per-step agreement)."""
        return self._job is not None and self._job.done and self._job.error is not None

    def finished(self):
        """The save in progress if it has finished successfully (then it is collected), else None."""
        if self._job is not None and self._job.done and self._job.error is None:
            return self.wait()
        return None

    def _publish(self, partial: Path, final: Path, manifest: dict) -> None:
        """Rank 0: the manifest, then the rename that makes the checkpoint visible (durably), then
        `latest` and rotation."""
        write_atomic(partial / "manifest.json", json.dumps({"files": manifest}, indent=1))
        fsync_dir(partial)
        if final.exists():  # the same step saved before (it can only be this run's: see plan_start)
            shutil.rmtree(self.root / ".universal" / final.name, ignore_errors=True)  # (its conversion is stale)
            trash = self.root / f".trash_{final.name}"
            shutil.rmtree(trash, ignore_errors=True)
            final.rename(trash)
            partial.rename(final)
            shutil.rmtree(trash)
        else:
            partial.rename(final)
        fsync_dir(self.root)
        try:  # the checkpoint is complete and visible: what follows is housekeeping
            write_atomic(self.root / "latest", final.name)
            self._rotate()
        except OSError as e:
            log.warning("warning: saved %s, but could not update %s or remove old checkpoints (%s)",
                        final.name, self.root / "latest", e)

    def _own_files(self, step: int, states: dict) -> dict[str, str]:
        """Rank 0's files of a checkpoint besides DeepSpeed's shards: name -> text."""
        import yaml

        files = {f"{name}_state.json": json.dumps(state) for name, state in states.items()}
        files["config.yaml"] = yaml.safe_dump(self.run_config, sort_keys=False)
        files["tokenizer.json"] = self.tokenizer_json
        meta = {"format": FORMAT, "step": step, "run_id": self.run.run_id, "world_size": self.env.world_size,
                "model_shape": model_shape(self.model_args),
                "model_function": model_shape(self.model_args, FUNCTION_FIELDS),
                "model_parametrization": self.model_args.parametrization_spec(),
                "zero_stage": self.zero_stage, "optimizer": self._optimizer_name(), "tensor_parallel": self.env.tp,
                "sequence_parallel": self.env.sp, "expert_parallel": self.env.ep, "data_parallel": self.env.dp_size,
                "fingerprint": {"tokenizer": self.tokenizer_fingerprint},
                **self.provenance}
        files["meta.json"] = json.dumps(meta, indent=2)
        return files

    def _failure_message(self, step: int, failures: list) -> str:
        rank, (what, full) = failures[0]
        previous = self._newest_complete()
        kept = f"the previous checkpoint {previous.name} is intact" if previous else "no earlier checkpoint exists"
        where = f" (rank {rank})" if self.env.world_size > 1 else ""
        if full:
            free = shutil.disk_usage(self.root).free / 2**30
            need = f", it needs about {self.last_size / 2**30:.2f} GiB" if self.last_size else ""
            return (f"no space left on the device of {self.root} while saving step {step}{where} "
                    f"({free:.2f} GiB free{need}): {kept}; the partial save was removed. Free space, then "
                    "resume with checkpoint.resume=auto")
        return f"could not save the checkpoint of step {step}{where}: {what}: {kept}; the partial save was removed"

    def _warn_if_low_on_space(self) -> None:
        if self.env.is_main and self.last_size:
            free = shutil.disk_usage(self.root).free
            if free < self.last_size:
                log.warning("warning: %.2f GiB free on the device of %s, less than the last checkpoint's "
                            "%.2f GiB: this save will probably fail", free / 2**30, self.root,
                            self.last_size / 2**30)

    def _rotate(self) -> None:
        """Keep the newest keep_last complete checkpoints of this run plus every keep_every-th step,
        and, while spikes are recent, the newest one before the first of them (a rollback's target);
        remove leftovers of interrupted saves, and universal conversions of checkpoints that are gone.
        Checkpoints of another run id are never touched."""
        done = [p for p in complete_checkpoints(self.root) if self._run_of(p) == self.run.run_id]
        keep = set(done[-self.cfg.keep_last:])
        if self.cfg.keep_every:
            keep |= {p for p in done if int(p.name[5:]) % self.cfg.keep_every == 0}
        first_spike = self.pinned()
        if first_spike is not None:
            keep |= set([p for p in done if int(p.name[5:]) < first_spike][-1:])
        for p in done:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.root.iterdir():
            if p.name.startswith((".partial_", ".trash_")):
                shutil.rmtree(p, ignore_errors=True)
        for p in (self.root / ".universal").glob("*"):
            if not (self.root / p.name).is_dir():
                shutil.rmtree(p, ignore_errors=True)

    def set_aside_after(self, ckpt: Path, tag: int) -> None:
        """Make `ckpt` the latest checkpoint again (a rollback; collective): the later ones, of the
        abandoned timeline, move to RUN/rolled_back/NAME.TAG (kept, never resumed from)."""
        distributed.barrier()  # every rank has read the checkpoints before rank 0 moves the later ones
        if self.env.is_main:
            step = read_meta(ckpt)["step"]
            aside = self.run.path / "rolled_back"
            for later in complete_checkpoints(self.root):
                if read_meta(later)["step"] > step:
                    aside.mkdir(exist_ok=True)
                    later.rename(aside / f"{later.name}.{tag}")
            write_atomic(self.root / "latest", ckpt.name)
        distributed.barrier()

    @staticmethod
    def _run_of(ckpt: Path) -> str | None:
        try:
            return json.loads((ckpt / "meta.json").read_text()).get("run_id")
        except (OSError, ValueError):
            return None


def _saved_bf16(ckpt: Path) -> bool:
    """Whether `ckpt`'s optimizer state is DeepSpeed's bf16 optimizer's (it names its files so)."""
    return any(ckpt.glob("bf16_*optim_states.pt"))
