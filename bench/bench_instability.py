"""The small-scale instability proxy of Wortsman et al. 2023 (arXiv 2309.14322): final loss against
learning rate for the Llama block, with q/k norms (model.qk_norm=head), and with q/k norms and the
output z-loss (model.z_loss=1e-4), at two widths, with the largest attention logit of each run.

Each run is `pretrain train configs/tiny.yaml` (a subprocess, the trainer as users run it, fp32 on
CPU, train.seed 42 unless --seed, the data order fixed) at model.dim W (heads of 32, GQA group 2),
4 layers, 128-token sequences, 8 per step, the 512-token built-in BPE (the output head would
otherwise be most of the compute), `--steps` steps of AdamW with 10% warmup and cosine decay to 1e-5, gradient clipping at 1 (the repo's
default), and the paper's independent weight decay 1e-4 (optimizer.weight_decay = 1e-4 / lr: AdamW
multiplies it by the rate). The loss-spike guard is off (resilience.spike_sigma=0): a dropped update
would hide the instability measured. logging.attn_logits=true logs train/max_attn_logit at every
log step (10).

Per run: the final loss (mean of the last 3 logged train/loss, i.e. of the last 30 steps), the step
it diverged at if the loss went non-finite (the trainer stops there), the largest train/max_attn_logit
over training and its last value. Per width and variant, the paper's LR sensitivity: the mean over
the rates of min(final loss, initial loss) minus the best final loss (a diverged run counts as the
initial loss: the loss of step 1, the same at every rate).

    python bench/bench_instability.py --out docs/model [--steps 300] [--workers 2]
    python bench/bench_instability.py --widths 64 --seed 43 --out /tmp/seed43   # another initialisation
    python bench/bench_instability.py --quick --out /tmp/instab   # 2 rates, 20 steps: a smoke run

Writes OUT/instability.json and OUT/instability.png, and prints the table for docs/model.md. Runs
already in OUT/instability.json with the same settings are reused.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny.yaml"
HEAD_DIM = 32
VARIANTS = {  # name -> overrides
    "llama": ["model.qk_norm=none", "model.z_loss=0"],
    "qk_norm": ["model.qk_norm=head", "model.z_loss=0"],
    "qk_norm+z_loss": ["model.qk_norm=head", "model.z_loss=1e-4"],
}
LAST_LOGS = 3  # the final loss: the mean of this many last logged train/loss
LOG_EVERY = 10


def overrides(job: dict, run_dir: Path) -> list[str]:
    dim, lr, steps = job["dim"], job["lr"], job["steps"]
    return [f"model.dim={dim}", "model.n_layers=4", f"model.n_heads={dim // HEAD_DIM}",
            f"model.n_kv_heads={dim // HEAD_DIM // 2}", "model.max_seq_len=128", f"data.seq_len={job['seq_len']}",
            "data.tokenizer=builtin:python-bpe-512", "data.num_workers=0", f"train.micro_batch_size={job['batch']}",
            f"train.global_batch_size={job['batch']}", f"train.max_steps={steps}", "train.eval_every=0",
            "train.eval_batches=4", f"train.run_dir={run_dir}", "train.overwrite=true", f"train.seed={job['seed']}",
            f"optimizer.lr={lr}", f"optimizer.weight_decay={1e-4 / lr}", "optimizer.grad_clip=1.0",
            f"schedule.warmup_steps={max(1, steps // 10)}", "schedule.kind=cosine", "schedule.min_lr=1e-5",
            "resilience.spike_sigma=0", "checkpoint.every=0", "logging.wandb=disabled", "logging.progress=false",
            f"logging.log_every={LOG_EVERY}", "logging.attn_logits=true", *VARIANTS[job["variant"]]]


def run_one(job: dict, work: Path) -> dict:
    """Train one (variant, dim, lr) through the CLI and read its metrics.jsonl."""
    run_dir = work / f"{job['variant']}_d{job['dim']}_lr{job['lr']:g}_s{job['seed']}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pretrain", "train", str(CONFIG), *overrides(job, run_dir)],
                          cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    train = [r for r in records if "train/loss" in r]
    losses = [r["train/loss"] for r in train]
    logits = [r["train/max_attn_logit"] for r in train if "train/max_attn_logit" in r]
    first = re.search(r"done: \d+ steps, loss ([-+\w.]+) ->", out)
    diverged = re.search(r"(?:loss|gradient norm) is \S+ at step (\d+)", out)
    if proc.returncode != 0 and not diverged:
        raise RuntimeError(f"run {run_dir.name} failed (exit {proc.returncode}):\n{out[-3000:]}")
    final = sum(losses[-LAST_LOGS:]) / len(losses[-LAST_LOGS:]) if losses and not diverged else math.nan
    eval_loss = next((r["eval/loss"] for r in reversed(records) if "eval/loss" in r), math.nan)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {**job, "final_loss": final, "first_loss": float(first.group(1)) if first else math.nan,
            "eval_loss": eval_loss, "diverged_at": int(diverged.group(1)) if diverged else None,
            "max_attn_logit": max(logits) if logits else math.nan,
            "last_attn_logit": logits[-1] if logits else math.nan,
            "attn_logits": logits, "losses": losses, "seconds": seconds}


def sensitivity(rows: list[dict]) -> dict:
    """The paper's LR sensitivity of one (width, variant): mean over rates of min(final, initial)
    minus the best final loss; a diverged run (NaN) counts as the initial loss."""
    initial = next(r["first_loss"] for r in rows if math.isfinite(r["first_loss"]))
    finals = [r["final_loss"] if math.isfinite(r["final_loss"]) else math.inf for r in rows]
    best = min(finals)
    return {"initial_loss": initial, "best_loss": best, "best_lr": rows[finals.index(best)]["lr"],
            "lr_sensitivity": sum(min(f, initial) for f in finals) / len(finals) - best}


def summarise(results: list[dict], widths: list[int], lrs: list[float]) -> dict:
    out = {}
    for dim in widths:
        for variant in VARIANTS:
            rows = sorted((r for r in results if r["dim"] == dim and r["variant"] == variant), key=lambda r: r["lr"])
            if [r["lr"] for r in rows] == lrs:
                out[f"{dim}/{variant}"] = {"dim": dim, "variant": variant, **sensitivity(rows)}
    return out


def _fmt(x: float, spec: str = ".3f") -> str:
    return format(x, spec) if math.isfinite(x) else "-"


def table(results: list[dict], summary: dict, widths: list[int], lrs: list[float]) -> str:
    """Per width and variant: the LR sensitivity, the best final loss, and at each rate the final
    loss (the largest attention logit over training); `div@N`: the loss went non-finite at step N."""
    lines = ["| width | variant | LR sensitivity | best loss (lr) | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
             "|---|---|---|---|" + "---|" * len(lrs)]
    for dim in widths:
        for variant in VARIANTS:
            s = summary.get(f"{dim}/{variant}")
            if s is None:
                continue
            rows = {r["lr"]: r for r in results if r["dim"] == dim and r["variant"] == variant}
            cells = [(f"div@{rows[lr]['diverged_at']}" if rows[lr]["diverged_at"] else _fmt(rows[lr]["final_loss"]))
                     + f" ({_fmt(rows[lr]['max_attn_logit'], '.3g')})" for lr in lrs]
            lines.append(f"| {dim} | {variant} | {s['lr_sensitivity']:.3f} | {s['best_loss']:.3f} ({s['best_lr']:g}) | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines)


COLORS = {"llama": "tab:red", "qk_norm": "tab:blue", "qk_norm+z_loss": "tab:green"}


def plot(results: list[dict], summary: dict, widths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(widths), figsize=(5.2 * len(widths), 8.0), squeeze=False)
    for col, dim in enumerate(widths):
        top, bottom = axes[0][col], axes[1][col]
        initial = None
        for variant in VARIANTS:
            rows = sorted((r for r in results if r["dim"] == dim and r["variant"] == variant), key=lambda r: r["lr"])
            if not rows:
                continue
            s = summary.get(f"{dim}/{variant}", {})
            initial = s.get("initial_loss", initial)
            lrs = [r["lr"] for r in rows]
            # the sensitivity's view: a diverged run (x) at the initial loss
            ys = [r["final_loss"] if math.isfinite(r["final_loss"]) else s.get("initial_loss", math.nan) for r in rows]
            label = f"{variant} (sensitivity {s['lr_sensitivity']:.3f})" if s else variant
            capped = [min(y, s.get("initial_loss", y)) for y in ys]
            top.plot(lrs, capped, marker="o", color=COLORS[variant], label=label)
            bad = [(x, y) for x, y, r in zip(lrs, ys, rows) if not math.isfinite(r["final_loss"])]
            if bad:
                top.plot(*zip(*bad), linestyle="none", marker="x", markersize=11, mew=2.5, color=COLORS[variant])
            worse = [(x, s["initial_loss"]) for x, y, r in zip(lrs, ys, rows)
                     if s and math.isfinite(r["final_loss"]) and y > s["initial_loss"]]
            if worse:
                top.plot(*zip(*worse), linestyle="none", marker="o", markersize=12, markerfacecolor="none",
                         mew=1.5, color=COLORS[variant])
            bottom.plot(lrs, [r["max_attn_logit"] for r in rows], marker="o", color=COLORS[variant], label=variant)
        if initial is not None:
            top.axhline(initial, color="gray", linestyle=":", linewidth=1)
            top.text(0.02, initial, " initial loss", color="gray", fontsize=8, va="bottom",
                     transform=top.get_yaxis_transform())
        top.set_xscale("log")
        top.set_title(f"dim {dim}, 4 layers: final train loss")
        top.set_ylabel("final loss (mean of the last 30 steps)")
        top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.93))
        top.grid(alpha=0.3, which="both")
        bottom.set_xscale("log")
        bottom.set_yscale("log")
        bottom.set_title(f"dim {dim}: largest attention logit over training")
        bottom.set_ylabel("max train/max_attn_logit")
        bottom.set_xlabel("learning rate (peak)")
        bottom.legend(fontsize=8)
        bottom.grid(alpha=0.3, which="both")
    fig.suptitle("Small-scale instability proxy (Wortsman et al. 2023)\nfinal loss capped at the initial loss, as "
                 "the LR sensitivity counts it: x = diverged (non-finite), ring = ended above the initial loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="", help="directory for instability.json and instability.png")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1")
    p.add_argument("--widths", default="64,128")
    p.add_argument("--seed", type=int, default=42, help="train.seed: the initialisation (the data order is fixed)")
    p.add_argument("--workers", type=int, default=2, help="runs at once (each one thread)")
    p.add_argument("--work", default="", help="where the runs' directories go while they train (default: a temp dir)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.steps, a.lrs, a.widths = 20, "1e-2,1", "64"
    lrs = sorted(float(x) for x in a.lrs.split(","))
    widths = [int(x) for x in a.widths.split(",")]
    common = dict(steps=a.steps, batch=a.batch, seq_len=a.seq_len, seed=a.seed)
    jobs = [dict(variant=v, dim=d, lr=lr, **common)
            for d in sorted(widths, reverse=True) for v in VARIANTS for lr in lrs]
    fields = ("variant", "dim", "lr", "steps", "batch", "seq_len", "seed")
    key = lambda j: tuple(str(j[k]) for k in fields)  # noqa: E731
    cached = Path(a.out) / "instability.json" if a.out else None
    done = {key(r): r for r in json.loads(cached.read_text())["results"]} if cached and cached.is_file() else {}
    results = [done[key(j)] for j in jobs if key(j) in done]
    jobs = [j for j in jobs if key(j) not in done]
    if results:
        print(f"{len(results)} runs reused from {cached}")
    work = Path(a.work or tempfile.mkdtemp(prefix="instability-"))
    import torch

    meta = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cores": os.cpu_count(),
            "command": " ".join(["python", "bench/bench_instability.py", *sys.argv[1:]])}
    out = Path(a.out) if a.out else None

    def save() -> dict:  # (after every run: an interrupted grid resumes from what it finished)
        summary = summarise(results, widths, lrs)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "instability.json").write_text(json.dumps(
                {"args": vars(a), "meta": meta, "lrs": lrs, "summary": summary, "results": results}, indent=1) + "\n")
        return summary

    t0 = time.time()
    with ThreadPoolExecutor(a.workers) as pool:
        for n, r in enumerate(pool.map(lambda j: run_one(j, work), jobs), start=1):
            results.append(r)
            save()
            end = f"diverged at step {r['diverged_at']}" if r["diverged_at"] else f"final loss {r['final_loss']:.4f}"
            print(f"[{n}/{len(jobs)} {time.time() - t0:6.0f}s] dim {r['dim']:4d} {r['variant']:15s} lr {r['lr']:<6g}: "
                  f"{end}, max attention logit {r['max_attn_logit']:.3g} ({r['seconds']:.0f} s)", flush=True)
    summary = save()
    print()
    print(table(results, summary, widths, lrs))
    print(f"\n{len(jobs)} runs trained in {time.time() - t0:.0f} s with {a.workers} workers on "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores "
          f"({sum(r['seconds'] for r in results):.0f} s of runs in the grid, wall time each)")
    if out is not None:
        plot(results, summary, widths, out / "instability.png")
        print(f"wrote {out / 'instability.json'} and {out / 'instability.png'}")
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
