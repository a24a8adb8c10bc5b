"""The (N, D, loss) points of finished runs: from sweep dirs (their manifest), run dirs, or CSV files
with the columns params,tokens,loss (optional: budget, name), so runs from elsewhere, published
ones included, can be fitted too.

A run's loss is its final `eval/loss`; a WSD-S run gives one point per decay branch
(`branch/eval_loss`, logged at the branch's end) plus its own end. A run dir of a sweep keeps its
planned budgets (`scaling.budgets` in its config), so run dirs and their sweep dir give the same
points; other run dirs have no budget (grouped by 6 N D). A point given twice (a sweep dir and one
of its run dirs) is counted once.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from pathlib import Path

from pretrain.scaling.fit import FitError, Point

log = logging.getLogger(__name__)


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_losses(run_dir: Path) -> dict[int, float]:
    """end step -> eval loss: the run's final evaluation and each decay branch's."""
    out = {}
    for r in _records(run_dir):
        if "branch/eval_loss" in r:
            out[int(r["branch/end_step"])] = float(r["branch/eval_loss"])
        elif "eval/loss" in r:
            out[int(r["step"])] = float(r["eval/loss"])
    return out


def from_sweep(sweep_dir: Path) -> list[Point]:
    from pretrain.config import load_config
    from pretrain.scaling.plan import check_runs, read_manifest
    from pretrain.scaling.run import finished

    rows = read_manifest(sweep_dir)
    check_runs(sweep_dir, rows)
    points, missing = [], []
    for row in rows:
        losses = run_losses(sweep_dir / "runs" / row["run"])
        if row["end_step"] not in losses:
            if finished(sweep_dir / "runs" / row["run"], row["steps"]) and not load_config(row["config"]).data.validation:
                raise FitError(f"{sweep_dir}: {row['run']} ran to its end but has no eval loss: its config has no "
                               "data.validation (plan the sweep again from a config with held-out data)")
            missing.append(f"{row['name']} (no eval loss at step {row['end_step']})")
            continue
        points.append(Point(row["params"], row["tokens"], losses[row["end_step"]], row["budget"], row["name"]))
    if missing:
        raise FitError(f"{sweep_dir}: {len(missing)} run(s) unfinished, e.g. {missing[0]}: finish them with "
                       f"`pretrain scaling run {sweep_dir}`")
    return points


def from_run(run_dir: Path) -> list[Point]:
    import yaml

    from pretrain.config import config_from_dict
    from pretrain.model.model import matmul_params

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    if not cfg.model.vocab_size:
        raise FitError(f"{run_dir}/config.yaml has no model.vocab_size: is it a run dir of this version?")
    tokens_per_step = cfg.global_batch(1) * cfg.data.seq_len
    losses = run_losses(run_dir)
    if cfg.train.max_steps not in losses:
        raise FitError(f"{run_dir} is unfinished: no eval loss at its last step {cfg.train.max_steps} "
                       "(resume it with checkpoint.resume=auto; runs without data.validation cannot be fitted)")
    ends = sorted({cfg.train.max_steps, *cfg.schedule.decay_points})
    # A sweep's run: its planned budgets, in the order of its ends (a larger budget trains longer).
    # Else no budget: its spent FLOPs would be a budget of its own, one size each.
    budgets = sorted(cfg.scaling.budgets) if len(cfg.scaling.budgets) == len(ends) else [0.0] * len(ends)
    n = matmul_params(cfg.model)
    return [Point(n, s * tokens_per_step, losses[s], c, f"{run_dir.name}@{s}")
            for s, c in zip(ends, budgets) if s in losses]


def from_csv(path: Path) -> list[Point]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("params", "tokens", "loss") if c not in (reader.fieldnames or [])]
        if missing:
            raise FitError(f"{path} lacks the column(s) {', '.join(missing)}: a CSV of points needs "
                           "params,tokens,loss (and optionally budget, name)")
        points = []
        for i, row in enumerate(reader, start=2):
            try:
                points.append(Point(float(row["params"]), float(row["tokens"]), float(row["loss"]),
                                    float(row.get("budget") or 0), row.get("name") or f"{path.name}:{i}"))
            except ValueError as e:
                raise FitError(f"{path} line {i}: {e}") from None
    return points


def collect(inputs: list[str]) -> list[Point]:
    points = []
    for spec in inputs:
        p = Path(spec)
        if p.is_file() and p.suffix == ".csv":
            points += from_csv(p)
        elif (p / "manifest.csv").is_file():
            points += from_sweep(p)
        elif (p / "config.yaml").is_file():
            points += from_run(p)
        else:
            raise FitError(f"{spec}: not a sweep dir (manifest.csv), a run dir (config.yaml) or a .csv of points")
    if not points:
        raise FitError("no points to fit")
    unique = {(p.params, p.tokens, p.loss): p for p in points}
    if len(unique) < len(points):
        log.warning("warning: %d point(s) given twice (a sweep dir and its run dirs?): counted once",
                    len(points) - len(unique))
        points = list(unique.values())
    bad = [p for p in points if not math.isfinite(p.loss)]
    if bad:
        raise FitError(f"{bad[0].name} has loss {bad[0].loss}: a diverged run cannot be fitted; rerun it with a lower "
                       "learning rate or leave it out")
    return points
