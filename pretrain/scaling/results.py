"""The (N, D, loss) points of finished runs: from sweep dirs (their manifest), run dirs, or CSV files
with the columns params,tokens,loss (optional: budget, name), so runs from elsewhere, published
ones included, can be fitted too.

A run's loss is its final `eval/loss`; a WSD-S run gives one point per decay branch
(`branch/eval_loss`, logged at the branch's end) plus its own end. Only these ends are points: an
evaluation in the middle of a run (train.eval_every) is taken before the rate has decayed, so it is
not a point of the law (a decay branch's end step may even be a mid-run evaluation's step). A
branch that dropped updates (`branch/dropped_steps`: spikes not rolled back, non-finite steps) is
refused: its loss is of fewer updates than its tokens say. A
run dir of a sweep keeps its planned budgets (`scaling.budgets` in its config), so run dirs and
their sweep dir give the same points; other run dirs have no budget (grouped by 6 N D). A point
given twice (a sweep dir and one of its run dirs) is counted once.
"""

from __future__ import annotations

import csv
import functools
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


def run_losses(run_dir: Path, last_step: int) -> dict[int, float]:
    """end step -> eval loss: the run's final evaluation (at `last_step`) and each decay branch's."""
    return {s: v["loss"] for s, v in run_values(run_dir, {"loss": ("eval/loss", "branch/eval_loss")},
                                                 last_step).items()}


def run_values(run_dir: Path, keys: dict[str, tuple[str, str]], last_step: int) -> dict[int, dict[str, float]]:
    """end step -> {name: value} of the run's annealed ends that logged every one of `keys` (name ->
    (its eval record key, its branch record key)): its evaluation at `last_step`, the end of its
    final decay, and each decay branch's end. Mid-run evaluations are left out."""
    out = {}
    for r in _records(run_dir):
        branch = "branch/end_step" in r
        if not branch and r.get("step") != last_step:
            continue
        values = {name: r.get(b if branch else e) for name, (e, b) in keys.items()}
        if all(v is not None for v in values.values()):
            if r.get("branch/dropped_steps"):  # (its loss is of fewer updates than its tokens say)
                raise FitError(f"{run_dir}: its decay branch to step {r['branch/end_step']} dropped "
                               f"{r['branch/dropped_steps']} of its updates (spikes or non-finite steps), so it is "
                               "not a point of the law: leave the run out, or rerun it with a lower optimizer.lr "
                               "or resilience.rollback_after=1 (a spike then rolls back past its data)")
            out[int(r["branch/end_step"] if branch else r["step"])] = {k: float(v) for k, v in values.items()}
    return out


def task_points(path: Path, task: str, metrics: tuple[str, ...]):
    """(N, D, {metric: value}, name, instances) of a sweep dir's or a run dir's ends (final
    evaluations and decay branches) that scored `task` (eval/TASK/METRIC, branch/TASK/METRIC);
    instances: how many the run's config scores (0 if its task files cannot be read now)."""
    keys = {m: (f"eval/{task}/{m}", f"branch/{task}/{m}") for m in metrics}
    if (path / "manifest.csv").is_file():
        from pretrain.scaling.plan import check_runs, read_manifest

        rows = read_manifest(path)
        check_runs(path, rows)
        for row in rows:
            values = run_values(path / "runs" / row["run"], keys, row["steps"]).get(row["end_step"])
            if values:
                items = _items(_run_config(path / "runs" / row["run"]), task)
                yield row["params"], row["tokens"], values, row["name"], items
    elif (path / "config.yaml").is_file():
        cfg = _run_config(path)
        tokens_per_step = cfg.global_batch(1) * cfg.data.seq_len
        from pretrain.model.model import matmul_params

        for step, values in sorted(run_values(path, keys, cfg.train.max_steps).items()):
            yield matmul_params(cfg.model), step * tokens_per_step, values, f"{path.name}@{step}", _items(cfg, task)
    else:
        raise FitError(f"{path}: not a sweep dir (manifest.csv), a run dir (config.yaml) or a .csv of points")


def _items(cfg, task: str) -> int:
    """The instances `task` is scored on in a run of `cfg` (train.eval_tasks, eval_task_limit); 0 when
    its files cannot be read now (the ladder then takes the points' scatter as their noise)."""
    from pretrain.errors import UserError
    from pretrain.eval.tasks import task_name

    for spec in cfg.train.eval_tasks:
        if task_name(spec) == task:
            try:
                return _count(spec, cfg.train.eval_task_limit)
            except UserError:
                return 0
    return 0


@functools.cache  # (a sweep's runs share their task files: each is read once)
def _count(spec: str, limit: int) -> int:
    from pretrain.eval.tasks import load

    return len(load(spec, limit)[0])


def _run_config(run_dir: Path):
    import yaml

    from pretrain.config import config_from_dict

    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    if not cfg.model.vocab_size:  # (filled from the tokenizer: the checkpoints record the model built)
        saved = sorted((run_dir / "checkpoints").glob("step_*/config.yaml"))
        if saved:
            cfg = config_from_dict(yaml.safe_load(saved[-1].read_text()))
    if not cfg.model.vocab_size:
        raise FitError(f"{run_dir}/config.yaml has no model.vocab_size, nor has a checkpoint of it: is it a run "
                       "dir of this version?")
    return cfg


def from_sweep(sweep_dir: Path) -> list[Point]:
    from pretrain.config import load_config
    from pretrain.scaling.plan import check_runs, read_manifest
    from pretrain.scaling.run import finished

    rows = read_manifest(sweep_dir)
    check_runs(sweep_dir, rows)
    points, missing = [], []
    for row in rows:
        losses = run_losses(sweep_dir / "runs" / row["run"], row["steps"])
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
    from pretrain.model.model import matmul_params

    cfg = _run_config(run_dir)
    tokens_per_step = cfg.global_batch(1) * cfg.data.seq_len
    losses = run_losses(run_dir, cfg.train.max_steps)
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
