"""`pretrain train CONFIG [overrides]`: the process entry point under any launcher.

One path: load the config, create the process group from it, open the run dir (lock, ownership),
decide the start point, build data, model and engine, restore, train; loggers, the run dir lock and
the process group are closed on every way out. The Trainer (trainer.py) does the steps; this module
owns signals, exit codes and the Slurm requeue.

Exit codes: 0 done; 2 a user error (config, data, checkpoint, run dir, a failed save); 3 a
non-finite step with train.on_nonfinite=stop (or too many in a row with skip); 4 a rank hung
(pretrain/faults/watchdog.py: its watchdog named it and wrote the stacks); 75 stopped by
SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) (after saving a checkpoint when a step had been trained;
resume with checkpoint.resume=auto).

Only this module's top-level imports run before the signal handler is installed, so they are light.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import subprocess
import sys
import time

from pretrain.errors import UserError

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again" - the job is resumable from its checkpoint


class StopSignal:
    """Remembers SIGTERM, SIGUSR1 and SIGINT (Ctrl-C, handled like SIGTERM). Installed before
    anything heavy is imported, so a signal during start-up is never lost: start-up checks it
    between phases, the trainer once per step (all ranks agree)."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def agreed(self) -> int:
        """The signal any rank received, 0 for none (collective). The maximum of the signal numbers:
        SIGTERM (15: scancel, the hard limit) wins over SIGUSR1 (10: the warning that requeues)."""
        from pretrain.parallel import distributed

        return distributed.agree_max([self.received or 0])[0]


class StoppedAtStartup(Exception):
    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"received {signal.Signals(signum).name} during start-up: stopped before training, "
                         "nothing to save")


def setup_logging(rank: int) -> None:
    """Rank 0 prints info lines (above the progress bar); other ranks only errors."""
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("pretrain", "data_pipeline"):
        lg = logging.getLogger(name)
        lg.handlers = [handler]
        lg.setLevel(logging.INFO if rank == 0 else logging.ERROR)
        lg.propagate = False


class _TqdmHandler(logging.Handler):
    def emit(self, record):
        try:
            msg = self.format(record)
            if "tqdm" in sys.modules:  # a bar may be on screen: print above it
                from tqdm import tqdm

                tqdm.write(msg, file=sys.stdout)
            else:
                sys.stdout.write(msg + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must never kill the run
            self.handleError(record)


def run(config_path: str, overrides: list[str], stop: StopSignal) -> int:
    """Train; returns the exit code for a stop by signal (75) or success (0), raises UserError
    subclasses for user mistakes (the CLI prints them). Rank 0 records how the start ended for
    slurm/pretrain.sbatch, from the first line on: a bad PRETRAIN_FAULT is a user error, not a crash
    to restart."""
    is_main = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0))) == 0
    setup_logging(0 if is_main else 1)
    code, why = 1, "an error"
    try:
        from pretrain.config import load_config

        cfg = load_config(config_path, overrides)
        from pretrain.faults import inject as faults

        faults.from_env()  # a bad PRETRAIN_FAULT is one line before anything starts
        if stop.received:  # before the process group: each rank alone (Slurm signals every one)
            _requeue_if_slurm(is_main, stop.received)
            raise StoppedAtStartup(stop.received)
        import warnings

        from pretrain.parallel import distributed

        # torch.distributed warns at every ZeRO-3 collective that DeepSpeed still calls by its old name.
        warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
        env = distributed.init(cfg.distributed.backend, cfg.distributed.timeout_s)
        setup_logging(env.rank)
        try:
            from pretrain import build

            # Every check runs on the model that will be trained (a Hugging Face model's config.json read)
            tokenizer, cfg = distributed.agree(build.resolve_model, cfg)
            cfg.validate(env.world_size)
            faults.from_env(env.world_size)
            d = cfg.distributed
            env = distributed.init_layout(env, d.sequence_parallel, d.tensor_parallel, d.hpz, d.expert_parallel)
            summary = _train(cfg, tokenizer, env, stop)
        except StoppedAtStartup as e:  # every rank alike: the start-up checks are collective
            distributed.barrier()
            _requeue_if_slurm(env.is_main, e.signum)
            distributed.barrier()  # (no rank exits before the requeue: an early exit makes torchrun kill rank 0)
            raise
        finally:
            distributed.shutdown()
        code, why = (EXIT_PREEMPTED, "stopped by a signal") if summary is None else (0, "done")
    except StoppedAtStartup as e:
        log.info("pretrain: %s; exiting with %d", e, EXIT_PREEMPTED)
        code, why = EXIT_PREEMPTED, str(e)
        return EXIT_PREEMPTED
    except UserError as e:
        code, why = e.exit_code, str(e)
        raise
    finally:
        if is_main:
            from pretrain.faults.watchdog import record_exit

            record_exit(code, why)
    if summary is None:  # stopped by a signal after saving
        return EXIT_PREEMPTED
    trained = (f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
               if summary["first_loss"] is not None else "nothing left to train")
    log.info("done: %d steps, %s%s, run dir %s", summary["final_step"], trained,
             f", eval loss {summary['eval/loss']:.3f}" if "eval/loss" in summary else "", cfg.train.run_dir)
    return 0


def _train(cfg, tokenizer, env, stop: StopSignal):
    """The run's summary, or None after a stop by signal (checkpoint saved, requeued). Loggers and
    the run dir are closed on every way out."""
    from pretrain import build
    from pretrain.checkpoint.manager import CheckpointManager
    from pretrain.checkpoint.rundir import RunDir
    from pretrain.checkpoint.states import DataPosition, RNGState
    from pretrain.metrics import MetricLogger
    from pretrain.model.model import flops_per_token, matmul_params, num_params
    from pretrain.optim.schedule import Schedule
    from pretrain.parallel import distributed
    from pretrain.parallel.parallelize import resolve_precision
    from pretrain.trainer import StopRequested, Trainer

    def check_stop():
        signum = stop.agreed()
        if signum:
            raise StoppedAtStartup(signum)

    check_stop()
    run_dir = RunDir(cfg.train.run_dir, env)
    run_dir.open()
    logger, trainer, start, ckpt = MetricLogger(), None, None, None
    try:
        model_args = cfg.model  # (resolved: the vocabulary from the tokenizer, an HF model's config.json)
        resolved = cfg.to_dict()
        import data_pipeline as dp

        provenance = _provenance()
        ckpt = CheckpointManager(
            run_dir, cfg.checkpoint, env, model_args=model_args, zero_stage=cfg.distributed.zero_stage,
            run_config=resolved, tokenizer_json=tokenizer.to_str(),
            tokenizer_fingerprint=dp.tokenizer_fingerprint(tokenizer), overwrite=cfg.train.overwrite,
            provenance=provenance)
        start = ckpt.plan_start()  # (reads the run dir; changes it only at ckpt.begin)
        check_stop()
        # The data comes before the model: a wrong source, tokenizer or resume position fails in
        # seconds, not after a large model has been built.
        loader, val_batches = distributed.agree(build.data, cfg, tokenizer, env)
        suite = None
        if cfg.train.eval_tasks:  # read once, here: a bad task is one line before the model is built
            from pretrain.eval import tasks

            loaded = distributed.agree(tasks.TaskSuite, cfg.train.eval_tasks, cfg.train.eval_task_limit,
                                       cfg.train.eval_task_fewshot)
            suite = functools.partial(loaded, tokenizer=tokenizer, eot=dp.eot_id(tokenizer, cfg.data.eot_token),
                                      max_len=model_args.max_seq_len)
        distributed.agree(ckpt.check_data, start, loader)
        check_stop()
        precision = resolve_precision(cfg, env.device)
        weights_only = start.path if start.kind == "finetune" and not cfg.checkpoint.init_load_optimizer else None
        engine, ds_config = build.engine(cfg, model_args, env, precision, init_weights_from=weights_only)
        ckpt.check_precision(start, engine.bfloat16_enabled())
        check_stop()
        # Every start check passed: only now does the start change the run dir (an earlier run
        # replaced, newer checkpoints set aside, run.json, the config files, metrics.jsonl rewound).
        ckpt.begin(start)
        n_total, n_non_emb = num_params(model_args), num_params(model_args, non_embedding=True)
        fpt = flops_per_token(model_args, cfg.data.seq_len)
        scaling = {"n_params": n_total, "n_params_non_embedding": n_non_emb, "n_params_matmul": matmul_params(model_args),
                   "flops_per_token": fpt, "world_size": env.world_size, "precision": precision,
                   "sequence_parallel": env.sp, "tensor_parallel": env.tp, "data_parallel": env.dp_size,
                   "tokens_per_step": cfg.global_batch(env.dp_size) * cfg.data.seq_len}
        if env.is_main:
            import json

            import yaml

            # the resolved config, as every checkpoint holds it (the model as built: the vocabulary
            # from the tokenizer, an HF model's shape, the end-of-text id)
            (run_dir.path / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
            (run_dir.path / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=2))
        logger = build.loggers(cfg, env, run_dir.path, run_dir.run_id, start.step,
                               {**resolved, "scaling": {**resolved["scaling"], **scaling}, "provenance": provenance})
        active = (f", {num_params(model_args, active=True) / 1e6:.2f}M active: {model_args.moe_top_k} of "
                  f"{model_args.moe_experts} experts" if model_args.moe_experts else "")
        log.info("model: %.2fM parameters (%.2fM non-embedding%s), %.1f MFLOPs/token | world size %d%s | %s | "
                 "ZeRO-%d | global batch %d x %d tokens", n_total / 1e6, n_non_emb / 1e6, active, fpt / 1e6,
                 env.world_size, f" (sequence parallel {env.sp} x data parallel {env.dp_size})" if env.sp > 1 else "",
                 "fp8 (bf16, float8 matmuls; MFU of bf16's peak)" if cfg.train.precision == "fp8" else precision,
                 cfg.distributed.zero_stage, cfg.global_batch(env.dp_size), cfg.data.seq_len)
        trainer = Trainer(cfg, env, engine, loader, val_batches, Schedule(cfg), ckpt, logger, fpt, precision, stop,
                          tasks=suite)
        ckpt.track(engine=engine, trainer=trainer, data=DataPosition(loader), rng=RNGState(env))
        ckpt.restore(start)
        if start.kind == "resume":
            logger.log({f"checkpoint/{k}": v for k, v in ckpt.timings.items()}, start.step)
        check_stop()
        try:
            return trainer.fit()
        except StopRequested as e:
            log.info("pretrain: received %s: saved step %d; exiting with %d (resume with checkpoint.resume=auto)",
                     signal.Signals(e.signum).name, e.step, EXIT_PREEMPTED)
            # The requeue makes Slurm signal every process of the job: flush W&B before it, and let
            # no rank exit before it is done (an early exit makes srun/torchrun kill rank 0).
            logger.close()
            logger = MetricLogger()
            distributed.barrier()
            _requeue_if_slurm(env.is_main, e.signum)
            distributed.barrier()
            return None
    finally:
        if ckpt is not None:
            ckpt.wait(quiet=True)  # a save in progress completes: it is of a good step
        logger.close()
        run_dir.close(trained=trainer is not None and trainer.step > start.step)


def _provenance() -> dict:
    """Which code wrote a run: the package version and, for a git checkout, the commit."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("pretrain")
    except PackageNotFoundError:
        ver = "unknown"
    commit = None
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if out.returncode == 0:
            commit = out.stdout.strip()
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            commit += "-dirty" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return {"pretrain_version": ver, "git_commit": commit, "created": time.strftime("%Y-%m-%d %H:%M:%S")}


def _requeue_if_slurm(is_main: bool, signum: int) -> None:
    """Under slurm/pretrain.sbatch (PRETRAIN_REQUEUE=1), SIGUSR1 (the time-limit/preemption warning
    asked for with --signal) puts the job back in the queue; the rerun resumes from the checkpoint
    just saved. SIGTERM (scancel, or the end of the time limit) only saves: a cancelled job stays
    cancelled."""
    job = os.environ.get("SLURM_JOB_ID")
    if os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID"):
        # An array task by its own name: the array's last task has the array's SLURM_JOB_ID, and
        # `scontrol requeue` of that id requeues every task of the array, killing the running ones.
        job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if is_main and job and signum == signal.SIGUSR1 and os.environ.get("PRETRAIN_REQUEUE") == "1":
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        # The requeue itself signals every process of the job, scontrol included: -SIGTERM is success.
        ok = result.returncode in (0, -signal.SIGTERM)
        log.info("pretrain: scontrol requeue %s: %s", job, "ok" if ok else result.stderr.strip())
