"""Collective bytes of one optimizer step of real training, counted (pretrain/parallel/traffic.py), against the
volume worked out by hand and against `pretrain estimate` (pretrain/estimate/comm.py comm_volume).

Each case trains the tiny preset (vocabulary 4096: 1,836,160 parameters, 1,152 of them norms under
the persistence threshold) for 3 steps under torchrun on CPU ranks (gloo), bf16 with fp32
gradients unless it says otherwise, one sequence of 64 tokens per micro-batch, and reads the
`comm/*` metrics of step 3 (step 1 traces ZeRO-3's module order and gathers more). Bytes are per
rank per step (all-gather, reduce-scatter: (n-1)/n of the data; all-reduce 2 (n-1)/n). The hand
count, per micro-batch (k per step) and psi = (n-1)/n:
  ZeRO-3: all-gather psi p (N - P) in forward; in backward nothing while the model is within
  stage3_max_reuse_distance (DeepSpeed's default 1e9 keeps every parameter gathered from forward to
  backward), else at most N - P again (a checkpointed block's recomputation gathers what its
  backward uses, nothing more); the P persistent parameters all-gathered once after the step;
  reduce-scatter psi g N. At max_reuse_distance=0 the backward part is a bound, not a count:
  DeepSpeed keeps what its prefetcher marked for later (pretrain/estimate/comm.py zero3_gathered).
  ZeRO-2: all-reduce 2 psi g N per micro-batch; ZeRO-1: once per step; both all-gather psi p N after
  the step. ZeRO-0 (fp32): all-reduce 2 psi g N per step.
  Tensor parallelism over t = 2 ranks (distributed.tensor_parallel=2): DeepSpeed AutoTP all-reduces
  b T D activations (or their gradients) in p bytes, 2 (t-1)/t of them each, 2 per block in forward
  (wo, w2), 5 in backward (the input gradients of wq, wk, wv, w1, w3) and 1 in a checkpointed
  block's recomputation (wo); ZeRO-3 runs over the n/t data-parallel ranks (none on 2 ranks) with
  N the parameters a rank holds (1/t of each block matrix, the rest whole).
Not in the hand count: the trainer's loss all-reduce (8 bytes), DeepSpeed's norm or overflow
all-reduce (4 bytes), a one-off broadcast of 2 KB at step 2.

    PYTHONPATH=. python bench/bench_comm.py            # every case, 2 and 4 ranks
    PYTHONPATH=. python bench/bench_comm.py --quick    # 2 ranks, ZeRO-3 only
    PYTHONPATH=. python bench/bench_comm.py --tp       # 2 ranks, tensor parallelism only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BASE = ["model.vocab_size=4096", "data.seq_len=64", "train.micro_batch_size=1", "train.precision=bf16",
        "train.eval_every=0", "data.validation=[]", "logging.wandb=disabled", "logging.progress=false",
        "logging.log_every=1", "logging.comm_bytes=true", "train.max_steps=3"]
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def cases(quick: bool, tp: bool = False) -> list[tuple[int, int, list[str]]]:
    """(ranks, micro-batches per rank, overrides)."""
    if tp:
        tp2 = ["distributed.zero_stage=3", "distributed.tensor_parallel=2"]
        return [(2, k, tp2 + [f"train.activation_checkpointing={ac}"]) for k in (1, 2) for ac in (0, 1)] + [
            (4, 1, tp2 + ["train.activation_checkpointing=1"])]  # TP 2 x DP 2: ZeRO over 2 of a rank's slices
    out = []
    for n in (2,) if quick else (2, 4):
        for k in (1, 2):
            for ac in (0, 1):
                out.append((n, k, ["distributed.zero_stage=3", f"train.activation_checkpointing={ac}"]))
    out += [(2, 1, ["distributed.zero_stage=3", "distributed.max_reuse_distance=0", f"train.activation_checkpointing={ac}"])
            for ac in (0, 1)]
    if not quick:
        out += [(2, 2, ["distributed.zero_stage=2"]), (2, 2, ["distributed.zero_stage=1"]),
                (2, 2, ["distributed.zero_stage=1", "distributed.grad_dtype=bf16"]),
                (2, 2, ["distributed.zero_stage=0", "train.precision=fp32"])]
    return out


def _tp(overrides: list[str]) -> int:
    return next((int(o.split("=")[1]) for o in overrides if o.startswith("distributed.tensor_parallel=")), 1)


def measure(n: int, k: int, overrides: list[str]) -> dict:
    """Train and return step 3's comm/* metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port",
               str(_free_port()), "-m", "pretrain", "train", str(REPO / "configs" / "tiny.yaml"), *BASE,
               f"train.global_batch_size={n // _tp(overrides) * k}", f"train.run_dir={tmp}/run", *overrides]
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(overrides)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        records = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "comm/bytes_per_step" in r][-1]
    return {kind: last[f"comm/{kind}_intra_bytes"] + last[f"comm/{kind}_inter_bytes"] for kind in KINDS} | {
        "total": last["comm/bytes_per_step"], "step": last["step"]}


def by_hand(n: int, k: int, cfg) -> dict:
    """The volume of the module docstring, from the parameter counts of the built model's shape."""
    from pretrain.estimate.memory import tensor_parallel_params
    from pretrain.model.model import num_params

    args, d, t = cfg.model, cfg.distributed, cfg.train
    tp = d.tensor_parallel
    N = tensor_parallel_params(args, num_params(args), tp)  # (all of them without TP)
    P = (2 * args.n_layers + 1) * args.dim  # the norms: under the persistence threshold (10 D)
    psi = (n // tp - 1) / (n // tp)  # ZeRO over the data-parallel ranks (one in the 2-rank TP cases)
    p = 4 if t.precision == "fp32" else 2
    g = 4 if t.precision == "fp32" or d.grad_dtype == "fp32" else 2
    checkpointed = len(range(0, args.n_layers, t.activation_checkpointing)) if t.activation_checkpointing else 0
    tp_allreduce = k * (7 * args.n_layers + checkpointed) * 2 * (tp - 1) / tp * cfg.data.seq_len * args.dim * p
    if d.zero_stage == 3:
        backward = 0 if d.max_reuse_distance >= 2 * N else N - P  # (0 among the cases: every use gathers)
        return {"all_gather": psi * p * (k * (N - P + backward) + P), "reduce_scatter": k * psi * g * N,
                "all_reduce": tp_allreduce}
    reduces = k if d.zero_stage == 2 else 1
    return {"all_gather": psi * p * N if d.zero_stage else 0.0, "reduce_scatter": 0.0,
            "all_reduce": 2 * reduces * psi * g * N}


def estimated(n: int, cfg) -> dict:
    """`pretrain estimate`'s figures: its total (comm_gib_per_gpu, and tensor parallelism's
    all-reduces, tp_allreduce_gib_per_gpu) and comm_volume's kinds."""
    from pretrain.estimate.comm import comm_volume
    from pretrain.estimate.memory import GIB, tensor_parallel_params
    from pretrain.estimate.report import Assumptions, _zero3_gathers, estimate
    from pretrain.model.model import num_params

    precision, tp = cfg.train.precision, cfg.distributed.tensor_parallel
    e = estimate(cfg, cfg.model, Assumptions(gpus=n, precision=precision))
    p = 4 if precision == "fp32" else 2
    g = 4 if precision == "fp32" or cfg.distributed.grad_dtype == "fp32" else 2
    kinds = comm_volume(tensor_parallel_params(cfg.model, num_params(cfg.model), tp), cfg.distributed.zero_stage,
                        n // tp, e["grad_accum"], p, g, **_zero3_gathers(cfg, cfg.model, tp))
    tp_bytes = e["tp_allreduce_gib_per_gpu"] * GIB
    kinds["all_reduce"] = kinds.get("all_reduce", 0.0) + tp_bytes
    return {kind: kinds.get(kind, 0.0) for kind in KINDS} | {"total": e["comm_gib_per_gpu"] * GIB + tp_bytes}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, ZeRO-3 only")
    parser.add_argument("--tp", action="store_true", help="2 ranks, tensor parallelism over both (TP=2) only")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    from pretrain.config import load_config

    rows = []
    print("| ranks | k | setup | kind | measured bytes | by hand | estimate | measured / estimate |")
    print("|---|---|---|---|---|---|---|---|")
    for n, k, overrides in cases(args.quick, args.tp):
        cfg = load_config(REPO / "configs" / "tiny.yaml",
                          BASE + [f"train.global_batch_size={n // _tp(overrides) * k}", *overrides])
        got, hand, est = measure(n, k, overrides), by_hand(n, k, cfg), estimated(n, cfg)
        setup = " ".join(o.split(".", 1)[1] for o in overrides)
        for kind in KINDS + ("total",):
            if not (got[kind] or hand.get(kind) or est[kind]):
                continue
            h = sum(hand.values()) if kind == "total" else hand[kind]
            ratio = f"{got[kind] / est[kind]:.4f}" if est[kind] else "-"
            print(f"| {n} | {k} | {setup} | {kind} | {got[kind]:,.0f} | {h:,.0f} | {est[kind]:,.0f} | {ratio} |",
                  flush=True)
        rows.append({"ranks": n, "micro_batches": k, "overrides": overrides, "measured": got, "by_hand": hand,
                     "estimate": est})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
