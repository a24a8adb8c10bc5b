"""A task ladder (OLMo, arXiv 2412.04403): predict a downstream task's accuracy at a target size
from a sweep of small runs, in two steps.

1. (N, D) -> the task's bits per byte of the gold answer (`TASK/bpb`, smooth in scale), with the
   parametric law bpb(N, D) = E + A / N^alpha + B / D^beta, fitted as the loss law is (fit.py).
2. bpb -> the task metric (`TASK/acc`, `TASK/acc_norm`, ...) with a sigmoid,
   metric = a / (1 + exp(-k (bpb - x0))) + b: flat at chance for a model that knows nothing (b, its
   floor, at high bpb), rising as bpb falls, flat again near its ceiling (a + b). k < 0.

The prediction at a target (N, D) is step 2 at step 1's bpb; its 95% interval comes from
bootstrap resamples of the points, both steps refitted on each. Step 2 gives no prediction when
the metric does not move with bpb beyond its sampling noise (`moves`): a sigmoid through noise
at chance is as tight as one through a rise, and says nothing.

Points: only annealed ends, each run's final evaluation and each WSD-S branch end
(`eval/TASK/METRIC`, `branch/TASK/METRIC`: train.eval_tasks, docs/evaluation.md; mid-run
evaluations are left out: results.run_values), from sweep dirs or run dirs, or a CSV with the
columns params,tokens,bpb,<metric> (the metric's own name, e.g. acc_norm) and optionally n (the
instances scored, for the metric's binomial noise).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pretrain.scaling import fit as F
from pretrain.scaling.fit import FitError


@dataclass
class TaskPoint:
    params: float
    tokens: float
    bpb: float
    value: float  # the task metric (accuracy)
    name: str = ""
    items: int = 0  # instances the metric is the mean of (0: unknown)


def parse_target(target: str) -> tuple[str, str]:
    task, _, metric = target.rpartition("/")
    if not task or not metric or metric == "bpb":
        raise FitError(f"--target {target}: give TASK/METRIC, e.g. hellaswag/acc_norm (the metric bpb is "
                       "predicted from is the task's own bpb)")
    return task, metric


def collect(inputs: list[str], target: str) -> list[TaskPoint]:
    from pretrain.scaling import results

    task, metric = parse_target(target)
    points = []
    for spec in inputs:
        p = Path(spec)
        if p.is_file() and p.suffix == ".csv":
            points += _from_csv(p, metric)
            continue
        for n, d, values, name, items in results.task_points(p, task, (metric, "bpb")):
            points.append(TaskPoint(n, d, values["bpb"], values[metric], name, items))
    if not points:
        raise FitError(f"no points of {target}: the runs logged no eval/{task}/{metric} (train.eval_tasks, "
                       "docs/evaluation.md)")
    bad = [q for q in points if not (math.isfinite(q.bpb) and q.bpb > 0 and math.isfinite(q.value))]
    if bad:
        raise FitError(f"{bad[0].name}: bpb {bad[0].bpb}, {metric} {bad[0].value}: not a point to fit")
    return points


def _from_csv(path: Path, metric: str) -> list[TaskPoint]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("params", "tokens", "bpb", metric) if c not in (reader.fieldnames or [])]
        if missing:
            raise FitError(f"{path} lacks the column(s) {', '.join(missing)}: a CSV of task points needs "
                           f"params,tokens,bpb,{metric}")
        try:
            return [TaskPoint(float(r["params"]), float(r["tokens"]), float(r["bpb"]), float(r[metric]),
                              r.get("name") or f"{path.name}:{i}", int(r.get("n") or 0))
                    for i, r in enumerate(reader, start=2)]
        except ValueError as e:
            raise FitError(f"{path}: {e}") from None


def sigmoid(x, a, k, x0, b):
    """a / (1 + exp(-k (x - x0))) + b, without overflow."""
    from scipy.special import expit

    return a * expit(k * (np.asarray(x, dtype=float) - x0)) + b


def fit_sigmoid(bpb, value) -> dict:
    """The sigmoid through (bpb, value) by least squares (scipy), from a start read off the points.
    The metric is a share (accuracy): the floor b and the ceiling a + b are kept within [0, 1]
    (fitted as a = f (1 - b), f and b in [0, 1]), so a sweep that sees only the foot of the curve
    cannot extrapolate it past 1."""
    from scipy.optimize import least_squares

    x, y = np.asarray(bpb, dtype=float), np.asarray(value, dtype=float)
    spread = float(np.ptp(x)) or 1.0
    b0 = min(max(float(y.min()), 0.0), 0.99)
    start = [min(max(float(np.ptp(y)) / (1 - b0), 1e-3), 1.0), -4.0 / spread, float(np.median(x)), b0]
    res = least_squares(lambda t: sigmoid(x, t[0] * (1 - t[3]), t[1], t[2], t[3]) - y, start, method="trf",
                        max_nfev=20000, bounds=([0.0, -np.inf, -np.inf, 0.0], [1.0, 0.0, np.inf, 1.0]))
    f, k, x0, b = (float(v) for v in res.x)
    return {"a": f * (1 - b), "k": k, "x0": x0, "b": b, "rms": float(np.sqrt(np.mean(res.fun ** 2)))}


def moves(points: list[TaskPoint]) -> dict:
    """Does the metric move with bpb beyond its sampling noise? The slope of a least-squares line
    of the metric against bpb, in standard errors ("z"): each point's variance is the larger of
    the binomial one of its instance count, p (1 - p) / n at the points' mean p (when known), and
    the points' scatter about the line. Below the t distribution's two-sided 95% quantile
    ("needed") it does not move: the points are as flat as their noise."""
    from scipy.stats import t as student

    x, y = np.array([p.bpb for p in points]), np.array([p.value for p in points])
    dx = x - x.mean()
    sxx = float(dx @ dx)
    slope = float(dx @ (y - y.mean())) / sxx if sxx else 0.0
    scatter = float(np.sum((y - y.mean() - slope * dx) ** 2)) / max(len(points) - 2, 1)
    mean = min(max(float(y.mean()), 0.0), 1.0)
    binomial = np.array([mean * (1 - mean) / p.items if p.items else 0.0 for p in points])
    var = np.maximum(binomial, scatter)
    se = float(np.sqrt(np.sum(dx ** 2 * var))) / sxx if sxx else float("inf")
    z = abs(slope) / se if se > 0 else (float("inf") if slope else 0.0)
    items = sorted({p.items for p in points if p.items})
    return {"slope": slope, "z": z, "needed": float(student.ppf(0.975, max(len(points) - 2, 1))),
            "binomial_se": float(np.sqrt(mean * (1 - mean) / items[0])) if items else None,
            "items": items[0] if len(items) == 1 else items}


def step2_problems(points: list[TaskPoint], sig: dict, target_bpb: float, move: dict) -> list[str]:
    """Why step 2 may not carry the prediction (empty: it does)."""
    out = []
    bpbs = [p.bpb for p in points]
    if move["z"] < move["needed"]:
        noise = (f"binomial SE {move['binomial_se']:.3g} of {move['items']} instances a point, or their scatter"
                 if move["binomial_se"] is not None else "their scatter about a line; give the instance count "
                 "(a CSV's n column) for the binomial noise")
        out.append(f"the metric does not move with bpb beyond its sampling noise (slope {move['slope']:.3g} per "
                   f"bpb, {move['z']:.2f} standard errors from flat, {move['needed']:.2f} needed; noise: {noise}): "
                   "no prediction; the sweep does not reach the task's rise (larger runs, or an easier task)")
    if target_bpb < min(bpbs) - (max(bpbs) - min(bpbs)):
        out.append(f"the target's bpb {target_bpb:.3g} is further below the points' lowest ({min(bpbs):.3g}) than "
                   "they span: the sigmoid is extrapolated past its data")
    return out


def ladder(points: list[TaskPoint], params: float, tokens: float, bootstrap: int = 200, seed: int = 0) -> dict:
    """Both steps, and the prediction at (params, tokens) with 95% bootstrap intervals; the
    metric's prediction is None (no interval) when it does not move with bpb (`moves`)."""
    if len(points) < 5:
        raise FitError(f"{len(points)} points: step 1's law has 5 parameters and needs more points")
    if not (math.isfinite(params) and params > 0 and math.isfinite(tokens) and tokens > 0):
        raise FitError(f"--params {params} --tokens {tokens}: give the target's size and tokens, both > 0")

    def then(law, pts):  # step 2 and the prediction, given step 1's law
        sig = fit_sigmoid([p.bpb for p in pts], [p.value for p in pts])
        bpb = F.predict(law, params, tokens)
        return sig, bpb, float(sigmoid(bpb, sig["a"], sig["k"], sig["x0"], sig["b"]))

    law = F.parametric([F.Point(p.params, p.tokens, p.bpb, name=p.name) for p in points], bootstrap=0)
    sig, bpb, value = then(law["law"], points)
    # Resamples refit step 1 from the full fit (as fit.py's bootstrap does: it is near each optimum).
    theta = np.array([math.log(law["law"][k]) for k in ("A", "B", "E")] + [law["law"]["alpha"], law["law"]["beta"]])
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(bootstrap):
        pick = [points[i] for i in rng.integers(0, len(points), len(points))]
        if len({(p.params, p.tokens) for p in pick}) < 5:
            continue  # (too few distinct points for the law)
        logs = [np.log([getattr(p, k) for p in pick]) for k in ("params", "tokens", "bpb")]
        refit = F._law(F._minimise(theta, *logs)[1])
        draws.append(then(refit, pick)[1:])
    interval = lambda i: [float(np.percentile([d[i] for d in draws], q)) for q in (2.5, 97.5)] if draws else []  # noqa: E731
    move = moves(points)
    flat = move["z"] < move["needed"]
    return {"step1": {"law": law["law"], "residuals": law["residuals"], "problems": F.problems(law)},
            "step2": {**sig, "moves": move, "problems": step2_problems(points, sig, bpb, move)},
            "target": {"params": params, "tokens": tokens, "bpb": bpb, "value": None if flat else value,
                       "bpb_interval": interval(0), "value_interval": [] if flat else interval(1),
                       "bootstrap": len(draws)}}


def plot(points: list[TaskPoint], result: dict, target: str, out: str) -> list[Path]:
    """ladder_bpb.png (step 1: bpb against compute, the law at each size and the target) and
    ladder_metric.png (step 2: the metric against bpb, the sigmoid and the prediction)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pretrain.plot import png_dir

    out_dir = png_dir(out)
    task, metric = parse_target(target)
    law, sig, t = result["step1"]["law"], result["step2"], result["target"]
    sizes = sorted({p.params for p in points})
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(sizes)))
    paths = []

    fig, ax = plt.subplots(figsize=(7, 5))
    for n, c in zip(sizes, colors):
        pts = sorted((p for p in points if p.params == n), key=lambda p: p.tokens)
        ax.scatter([6 * p.params * p.tokens for p in pts], [p.bpb for p in pts], color=c, s=18)
        d = np.geomspace(min(p.tokens for p in pts) / 2, max(p.tokens for p in pts) * 2, 50)
        ax.plot(6 * n * d, [F.predict(law, n, x) for x in d], color=c, lw=1, label=f"N = {n:.3g}")
    ax.errorbar([6 * t["params"] * t["tokens"]], [t["bpb"]], fmt="*", color="crimson", ms=12,
                yerr=[[t["bpb"] - t["bpb_interval"][0]], [t["bpb_interval"][1] - t["bpb"]]] if t["bpb_interval"] else None,
                label=f"target N = {t['params']:.3g}, D = {t['tokens']:.3g}: {t['bpb']:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("C = 6 N D (FLOPs)")
    ax.set_ylabel(f"{task} bits per byte of the gold answer")
    ax.set_title(f"step 1: bpb(N, D) = {law['E']:.3g} + {law['A']:.3g}/N^{law['alpha']:.2f} + "
                 f"{law['B']:.3g}/D^{law['beta']:.2f}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "ladder_bpb.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 5))
    for n, c in zip(sizes, colors):
        pts = [p for p in points if p.params == n]
        ax.scatter([p.bpb for p in pts], [p.value for p in pts], color=c, s=18, label=f"N = {n:.3g}")
    lo = min(min(p.bpb for p in points), t["bpb"]) * 0.9
    hi = max(p.bpb for p in points) * 1.1
    x = np.linspace(lo, hi, 200)
    ax.plot(x, sigmoid(x, sig["a"], sig["k"], sig["x0"], sig["b"]), color="black", lw=1,
            label=f"{sig['a']:.2f} / (1 + exp({-sig['k']:.2f} (bpb - {sig['x0']:.2f}))) + {sig['b']:.2f}")
    if t["value"] is not None:
        ax.errorbar([t["bpb"]], [t["value"]], fmt="*", color="crimson", ms=12,
                    yerr=[[t["value"] - t["value_interval"][0]], [t["value_interval"][1] - t["value"]]]
                    if t["value_interval"] else None, label=f"target: {t['value']:.3f}")
    else:  # (no prediction: the metric does not move with bpb beyond its noise)
        ax.axvline(t["bpb"], color="crimson", ls="--", lw=1, label=f"target bpb {t['bpb']:.3f}: no prediction")
    ax.invert_xaxis()
    ax.set_xlabel(f"{task} bits per byte of the gold answer (lower is better)")
    ax.set_ylabel(f"{task} {metric}")
    ax.set_title(f"step 2: {metric} from bpb", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")  # (high bpb, high metric: empty)
    fig.tight_layout()
    paths.append(out_dir / "ladder_metric.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
