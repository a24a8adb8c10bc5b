"""`pretrain plot RUN_DIR... [--metrics M,...] [--x step|tokens|flops] --out DIR`: a run's curves
without W&B, from its metrics.jsonl (matplotlib, no display needed).

One PNG per metric (`train/loss` -> train_loss.png), every run overlaid. A resumed run is one line:
a step logged twice (by a start that was killed after logging it, then by the resume) keeps its
later record, as the resumed run's curve does. WSD-S decay branches log `branch/*` metrics at their
own end steps; they are metrics like any other here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pretrain.errors import UserError

DEFAULT_METRICS = ("train/loss", "eval/loss", "train/lr", "train/grad_norm")
X_KEYS = {"step": "step", "tokens": "tokens_seen", "flops": "flops"}  # --x -> the record's field
X_LABELS = {"step": "optimizer step", "tokens": "tokens seen (D)", "flops": "training FLOPs (C)"}


def read_run(path: str) -> tuple[str, list[dict]]:
    """(name, records) of a run dir (or its metrics.jsonl)."""
    p = Path(path)
    metrics = p if p.is_file() else p / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"{path}: no metrics.jsonl here: give a run dir (train.run_dir) or its metrics.jsonl")
    records, lines = [], metrics.read_text(errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if n == len(lines):  # a last line cut short by a killed run: keep what came before
                break
            raise UserError(f"{metrics}:{n}: not a JSON line: is this a metrics.jsonl?") from None
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return (metrics.parent.name if metrics.name == "metrics.jsonl" else metrics.stem), records


def series(records: list[dict], metric: str, x: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of `metric` against `x` (step|tokens|flops), in step order, one point per step:
    the later record of a step logged twice."""
    key = X_KEYS[x]
    by_step = {}
    for r in records:
        if metric in r and key in r and r[metric] is not None:
            by_step[r["step"]] = (r[key], r[metric])
    points = [by_step[s] for s in sorted(by_step)]
    return [p[0] for p in points], [p[1] for p in points]


def png_dir(out: str) -> Path:
    """The directory for PNGs (`--out`), made; one line if it cannot be."""
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # (an existing file included)
        raise UserError(f"--out {out}: {e.strerror}: give a directory for the PNGs") from None
    if not os.access(out_dir, os.W_OK):
        raise UserError(f"--out {out}: not writable")
    return out_dir


def plot(runs: list[str], out: str, metrics: list[str] | None = None, x: str = "step") -> list[Path]:
    """Write one PNG per metric into `out`; returns their paths."""
    if x not in X_KEYS:
        raise UserError(f"--x {x}: give one of {', '.join(X_KEYS)}")
    loaded = [read_run(r) for r in runs]
    names = [name for name, _ in loaded]
    if len(set(names)) < len(names):  # two runs named alike (a/run, b/run): name them by their paths
        names = [str(Path(r)) for r in runs]
    present = sorted({k for _, recs in loaded for r in recs for k, v in r.items() if isinstance(v, (int, float))}
                     - {"step", *X_KEYS.values()})
    wanted = list(metrics) if metrics else [m for m in DEFAULT_METRICS if m in present]
    missing = [m for m in wanted if m not in present]
    if missing or not wanted:
        raise UserError(f"--metrics: {', '.join(missing) or 'none of the default ones'} in no run's metrics.jsonl; "
                        f"they have: {', '.join(present) or 'no metrics'}")
    out_dir = png_dir(out)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric in wanted:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, (_, records) in zip(names, loaded):
            xs, ys = series(records, metric, x)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=f"{name} ({len(xs)} points)")
        ax.set_xlabel(X_LABELS[x])
        ax.set_ylabel(metric)
        ax.set_title(metric)
        if x != "step":
            ax.set_xscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / (metric.replace("/", "_") + ".png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_cli(args) -> None:
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    for path in plot(args.runs, args.out, metrics, args.x):
        print(f"wrote {path}")
