"""A stand-in for `python -m pretrain` that the Slurm tests launch through slurm/pretrain.sbatch
(PRETRAIN_MODULE=fake_train, with this directory on PYTHONPATH), keeping the trainer's contract:

- `config show CONFIG [overrides]` prints the config, or exits 2 with one line if CONFIG is missing;
- `train CONFIG [overrides]` joins a real gloo process group from torchrun's environment, then
  "trains": one all-reduce and a short sleep per step. SIGUSR1/SIGTERM finish the current step, save
  a "checkpoint" (one file per rank), rank 0 runs `scontrol requeue $SLURM_JOB_ID` when
  PRETRAIN_REQUEUE=1, and every rank exits 75. With checkpoint.resume=auto a run continues from its
  checkpoint.

Overrides (all `fake.*`): run_dir (where checkpoints go; required), steps (steps of a fresh run,
default 3), steps_after_resume (a resumed run finishes this many steps after its checkpoint,
default 5), step_seconds (default 0.2), fail_rank (this rank exits 3 after joining the group).
Every line it prints starts with "fake_train:".
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_started = time.monotonic()
_signals: list[int] = []
# Installed first, before the slow imports: an early USR1 must not go unnoticed. (Until here it is
# ignored, inherited from the torchrun agent's `trap "" USR1`.)
signal.signal(signal.SIGUSR1, lambda signum, frame: _signals.append(signum))
signal.signal(signal.SIGTERM, lambda signum, frame: _signals.append(signum))


def log(msg: str) -> None:
    print(f"fake_train: {msg}", flush=True)


def parse(argv: list[str]) -> tuple[str, dict[str, str]]:
    config, overrides = argv[0], {}
    for item in argv[1:]:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"fake_train: error: override {item!r} is not key=value", file=sys.stderr)
            sys.exit(2)
        overrides[key] = value
    if not Path(config).is_file():
        print(f"fake_train: error: config file {config!r} not found", file=sys.stderr)
        sys.exit(2)
    return config, overrides


def train(config: str, o: dict[str, str]) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)  # sum of 1..world: proves every rank joined the same group
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    log(f"rank={rank} world_size={world} local_rank={os.environ['LOCAL_RANK']} "
        f"host={socket.gethostname()} allreduce={total.item():g} restart={restarts} "
        f"master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
        f"omp={os.environ.get('OMP_NUM_THREADS')} config={config}")
    if int(o.get("fake.fail_rank", -1)) == rank:
        log(f"rank={rank} failing on purpose")
        return 3

    ckpt = Path(o["fake.run_dir"]) / f"ckpt-rank{rank}.txt"
    step, end = 0, int(o.get("fake.steps", 3))
    if o.get("checkpoint.resume") == "auto" and ckpt.exists():
        step = int(ckpt.read_text())
        end = step + int(o.get("fake.steps_after_resume", 5))
        log(f"rank={rank} resumed from step {step}")
    while step < end:
        time.sleep(float(o.get("fake.step_seconds", 0.2)))
        step += 1
        # Ranks see a signal at slightly different moments: agree on stopping, like a real step's
        # collectives would, so that every rank saves the same step.
        stop = torch.tensor([float(bool(_signals))])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            ckpt.write_text(str(step))
            log(f"rank={rank} signal={_signals[0] if _signals else None} saved step {step} "
                f"after {time.monotonic() - _started:.0f} s")
            dist.barrier()  # every rank has saved before anyone requeues
            if rank == 0 and os.environ.get("SLURM_JOB_ID") and os.environ.get("PRETRAIN_REQUEUE") == "1":
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
                log(f"requeued job {os.environ['SLURM_JOB_ID']}")
            dist.barrier()  # the requeue is issued before anyone exits (srun --kill-on-bad-exit)
            dist.destroy_process_group()
            return 75
    if rank == 0:
        log(f"finished at step {step}")
    dist.destroy_process_group()
    return 0


def main(argv: list[str]) -> int:
    if argv[:2] == ["config", "show"]:
        config, overrides = parse(argv[2:])
        log(f"config {config} overrides {' '.join(f'{k}={v}' for k, v in overrides.items())}")
        return 0
    if argv[:1] == ["train"]:
        return train(*parse(argv[1:]))
    print(f"fake_train: error: unknown command {argv!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
