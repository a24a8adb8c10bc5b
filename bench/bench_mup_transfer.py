"""Does the best learning rate transfer? A sweep of optimizer.lr (factors of 2) at widths 64-512
under sp and muP, and at depths 2-8 under CompleteP and muP, on the built-in corpus, with AdamW
and (`--optimizers adamw,muon`) Muon: each sweep again as SWEEP/muon.

Each run trains the model of configs/tiny.yaml (grown by heads at its head_dim, as the planner
grows models; `mup_base_dim` 64, `mup_base_layers` 2) for `--steps` steps with the run config's
AdamW (or Muon: DeepSpeed's MuonWithAuxAdam as build_optimizer builds it, which runs Newton-Schulz
itself without ZeRO), its parameter groups (pretrain/optim/optimizer.py), warmup and cosine decay and gradient clipping, in
one process without DeepSpeed (the arithmetic the trainer does, without its start-up cost), and
scores it by its loss on the held-out split. Under a parametrization that transfers, the best rate
moves at most one grid step across widths (depths); under sp it moves with width.

    python bench/bench_mup_transfer.py --out docs/mup [--steps 300] [--workers 2]
    python bench/bench_mup_transfer.py --quick            # 2 widths, 3 rates, 20 steps: a smoke run
    python bench/bench_mup_transfer.py --sweeps width/mup --optimizers adamw,muon --widths 64,128,256 --out DIR
    python bench/bench_mup_transfer.py --sweeps width/mup --widths 64,512 --set model.init_std=0.0625 --out DIR

Writes OUT/mup_transfer.json, OUT/mup_transfer.png, and prints a table for docs/mup.md. Runs
already in OUT/mup_transfer.json with the same steps, batch and sequence length are reused, so a
grid can be widened (`--lrs`) without training again what it has.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "tiny.yaml"
BASE_DIM, BASE_LAYERS = 64, 2
BASE_HEAD_DIM = 32  # configs/tiny.yaml's: models grow by heads at it


def run_one(job: dict) -> dict:
    """Train one (parametrization, dim, n_layers, lr) and return its held-out loss."""
    import torch

    import data_pipeline as dp
    from pretrain.build import tokenizer_and_model_args
    from pretrain.config import load_config
    from pretrain.model.model import Transformer
    from pretrain.mup import sized
    from pretrain.optim.optimizer import build_optimizer, set_lr
    from pretrain.optim.schedule import Schedule

    torch.set_num_threads(1)
    cfg = load_config(CONFIG, [f"model.parametrization={job['parametrization']}", f"model.mup_base_dim={BASE_DIM}",
                               f"model.mup_base_head_dim={BASE_HEAD_DIM}", f"model.mup_base_layers={BASE_LAYERS}",
                               f"optimizer.lr={job['lr']}", f"optimizer.name={job.get('optimizer', 'adamw')}",
                               f"train.max_steps={job['steps']}", f"schedule.warmup_steps={job['steps'] // 10}",
                               f"schedule.min_lr={job['lr'] / 10}", f"data.seq_len={job['seq_len']}",
                               "data.num_workers=0", *job["set"]])
    tokenizer, args = tokenizer_and_model_args(cfg)
    args = sized(sized(args, "dim", job["dim"]), "n_layers", job["n_layers"])
    torch.manual_seed(cfg.train.seed)
    model = Transformer(args)
    model.init_weights()
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    schedule = Schedule(cfg)
    loader = iter(dp.build_loader(cfg.data, tokenizer, micro_batch_size=job["batch"]))
    val = dp.build_validation_batches(cfg.data, tokenizer, rank=0, world_size=1, micro_batch_size=job["batch"],
                                      n_batches=job["val_batches"])
    t0, loss = time.perf_counter(), None
    for step in range(job["steps"]):
        set_lr(optimizer, schedule(step))
        batch = next(loader)
        loss = model(batch["input_ids"], batch["labels"])
        if not torch.isfinite(loss):
            return {**job, "eval_loss": math.inf, "diverged_at": step, "seconds": time.perf_counter() - t0}
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        ev = sum(model(b["input_ids"], b["labels"]).item() for b in val) / len(val)
    return {**job, "eval_loss": ev if math.isfinite(ev) else math.inf, "train_loss": loss.item(),
            "seconds": time.perf_counter() - t0}


def best_index(rows: list[dict], lrs: list[float]) -> int:
    losses = {r["lr"]: r["eval_loss"] for r in rows}
    return min(range(len(lrs)), key=lambda i: losses[lrs[i]])


def summarise(results: list[dict], sweeps: dict, lrs: list[float]) -> dict:
    out = {}
    for name, (param, axis, sizes, *_) in sweeps.items():
        best = {}
        for size in sizes:
            rows = [r for r in results if r["parametrization"] == param and r[axis] == size and r["sweep"] == name]
            best[size] = best_index(rows, lrs)
        out[name] = {"parametrization": param, "axis": axis, "best_lr": {s: lrs[i] for s, i in best.items()},
                     "shift_in_grid_steps": max(best.values()) - min(best.values())}
    return out


def plot(results: list[dict], sweeps: dict, lrs: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(sweeps), figsize=(4.6 * len(sweeps), 4.2), squeeze=False)
    for ax, (name, (param, axis, sizes, *_)) in zip(axes[0], sweeps.items()):
        cmap = plt.get_cmap("viridis")
        finite = [r["eval_loss"] for r in results if r["sweep"] == name and math.isfinite(r["eval_loss"])]
        for i, size in enumerate(sizes):
            rows = sorted((r for r in results if r["sweep"] == name and r[axis] == size), key=lambda r: r["lr"])
            xs, ys = [r["lr"] for r in rows], [r["eval_loss"] for r in rows]
            color = cmap(i / max(1, len(sizes) - 1))
            ax.plot(xs, ys, marker="o", color=color, label=f"{'dim' if axis == 'dim' else 'layers'} {size}")
            b = best_index(rows, lrs)
            ax.plot([lrs[b]], [min(ys)], marker="*", markersize=14, color=color, markeredgecolor="black")
        ax.set_xscale("log", base=2)
        ax.set_ylim(min(finite) - 0.1, min(max(finite), min(finite) + 2.5) + 0.1)
        ax.set_xlabel("optimizer.lr (base)")
        ax.set_title(f"{param}{' + muon' if name.endswith('/muon') else ''}, across {'width' if axis == 'dim' else 'depth'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("held-out loss")
    fig.suptitle("best learning rate (star) by width and depth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: list[dict], sweeps: dict, lrs: list[float]) -> str:
    lines = ["| sweep | size | " + " | ".join(f"2^{round(math.log2(lr))}" for lr in lrs) + " | best |",
             "|---|---|" + "---|" * (len(lrs) + 1)]
    for name, (param, axis, sizes, *_) in sweeps.items():
        for size in sizes:
            rows = {r["lr"]: r for r in results if r["sweep"] == name and r[axis] == size}
            b = best_index(list(rows.values()), lrs)
            cells = [("**%.3f**" if i == b else "%.3f") % rows[lr]["eval_loss"] if math.isfinite(rows[lr]["eval_loss"])
                     else "diverged" for i, lr in enumerate(lrs)]
            lines.append(f"| {name} | {axis}={size} | " + " | ".join(cells) + f" | 2^{round(math.log2(lrs[b]))} |")
    return "\n".join(lines)


def best_table(summary: dict, sweeps: dict) -> str:
    """The best rate by size, AdamW's and Muon's side by side (a sweep and its /muon twin)."""
    pairs = [(n, f"{n}/muon") for n in sweeps if not n.endswith("/muon")]
    pairs += [(None, n) for n in sweeps if n.endswith("/muon") and n[:-5] not in sweeps]
    lines = ["| sweep | size | best lr, adamw | best lr, muon |", "|---|---|---|---|"]
    log2 = lambda v: f"2^{round(math.log2(v))}"  # noqa: E731
    for adamw, muon in pairs:
        name = adamw or muon[:-5]
        _, axis, sizes, _ = sweeps[adamw or muon]
        for size in sizes:
            cells = [log2(summary[n]["best_lr"][size]) if n in summary else "-" for n in (adamw, muon)]
            lines.append(f"| {name} | {axis}={size} | {cells[0]} | {cells[1]} |")
        cells = [f"moves {summary[n]['shift_in_grid_steps']}" if n in summary else "-" for n in (adamw, muon)]
        lines.append(f"| {name} | | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="", help="directory for mup_transfer.json and mup_transfer.png")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lrs", default="-12,-11,-10,-9,-8,-7,-6,-5", help="log2 of the rates")
    p.add_argument("--widths", default="64,128,256,512")
    p.add_argument("--depths", default="2,4,8")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sweeps", default="width/sp,width/mup,depth/mup,depth/completep", help="which of the four")
    p.add_argument("--optimizers", default="adamw", help="adamw, muon or adamw,muon (Muon's sweeps are SWEEP/muon)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, e.g. model.init_std=0.05")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.steps, a.lrs, a.widths, a.depths = 20, "-9,-7,-5", "64,128", "2,4"
    lrs = [2.0 ** int(x) for x in a.lrs.split(",")]
    widths, depths = [int(x) for x in a.widths.split(",")], [int(x) for x in a.depths.split(",")]
    sweeps = {"width/sp": ("sp", "dim", widths), "width/mup": ("mup", "dim", widths),
              "depth/mup": ("mup", "n_layers", depths), "depth/completep": ("completep", "n_layers", depths)}
    optimizers = a.optimizers.split(",")
    if not optimizers or set(optimizers) - {"adamw", "muon"}:
        p.error(f"--optimizers {a.optimizers}: give adamw, muon or both")
    sweeps = {(k if o == "adamw" else f"{k}/muon"): (*v, o) for o in optimizers for k, v in sweeps.items()
              if k in a.sweeps.split(",")}
    common = dict(steps=a.steps, batch=a.batch, seq_len=a.seq_len, val_batches=8, set=a.set)
    jobs = []
    for name, (param, axis, sizes, optimizer) in sweeps.items():
        for size in sizes:
            for lr in lrs:
                dim, layers = (size, 4) if axis == "dim" else (128, size)
                jobs.append(dict(sweep=name, parametrization=param, dim=dim, n_layers=layers, lr=lr, **common))
                if optimizer != "adamw":  # (AdamW's jobs keep their old keys: cached runs are reused)
                    jobs[-1]["optimizer"] = optimizer
    jobs.sort(key=lambda j: -j["dim"] * j["n_layers"])  # the longest first, for an even finish
    key = lambda j: tuple(str(j.get(k, [])) for k in ("sweep", "dim", "n_layers", "lr", "steps", "batch", "seq_len",  # noqa: E731
                                                      "set"))
    cached = Path(a.out) / "mup_transfer.json" if a.out else None
    done = {key(r): r for r in json.loads(cached.read_text())["results"]} if cached and cached.is_file() else {}
    results = [done[key(j)] for j in jobs if key(j) in done]
    jobs = [j for j in jobs if key(j) not in done]
    if results:
        print(f"{len(results)} runs reused from {cached}")
    t0 = time.time()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with multiprocessing.get_context("spawn").Pool(a.workers) as pool:
        for n, r in enumerate(pool.imap_unordered(run_one, jobs), start=1):
            results.append(r)
            print(f"[{n}/{len(jobs)} {time.time() - t0:6.0f}s] {r['sweep']:16s} dim {r['dim']:4d} "
                  f"layers {r['n_layers']} lr 2^{round(math.log2(r['lr']))}: {r['eval_loss']:.4f}", flush=True)
    summary = summarise(results, sweeps, lrs)
    print()
    print(table(results, sweeps, lrs))
    print()
    for name, s in summary.items():
        print(f"{name}: best lr moves {s['shift_in_grid_steps']} grid steps "
              f"({', '.join(f'{k}: 2^{round(math.log2(v))}' for k, v in s['best_lr'].items())})")
    if any(n.endswith("/muon") for n in sweeps):
        print()
        print(best_table(summary, sweeps))
    print(f"{len(jobs)} runs trained in {time.time() - t0:.0f} s with {a.workers} workers on {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "mup_transfer.json").write_text(json.dumps(
            {"args": vars(a), "lrs": lrs, "summary": summary, "results": results}, indent=1) + "\n")
        plot(results, sweeps, lrs, out / "mup_transfer.png")
        print(f"wrote {out / 'mup_transfer.json'} and {out / 'mup_transfer.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
