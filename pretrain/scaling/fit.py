"""Fitting scaling laws to (N, D, loss) points.

Two approaches (Hoffmann et al. 2022, "Chinchilla", approaches 2 and 3):

- IsoFLOP: for each compute budget, a parabola of the loss in log N; its minimum is N_opt(C), and
  D_opt(C) = C / (6 N_opt). Power laws N_opt = k_N C^a and D_opt = k_D C^b through those minima
  (least squares in log-log).
- Parametric: L(N, D) = E + A / N^alpha + B / D^beta, fitted by minimising the Huber loss
  (delta 1e-3) of log L against log of the prediction, written as LSE(a - alpha log N, b - beta
  log D, e) with A = e^a, B = e^b, E = e^e; L-BFGS from every point of a grid of starting points,
  the best kept (the objective has poor local minima). Bootstrap (resampling the points) gives
  intervals for the exponents. For a budget C the optimum under C = 6 N D is closed form:
  N* = G (C/6)^(beta/(alpha+beta)), D* = (C/6)^(alpha/(alpha+beta)) / G, G = (alpha A / (beta B))^(1/(alpha+beta)).

C = 6 N D is the convention of both fits (and of the published laws they are compared with); the
sweep's own budgets use the trainer's FLOPs per token, which adds attention (docs/scaling.md).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from pretrain.errors import UserError


class FitError(UserError):
    """The points cannot support the fit asked for (one line, exit 2)."""


@dataclass
class Point:
    params: float
    tokens: float
    loss: float
    budget: float = 0.0  # the compute budget of the run (0 = unknown: 6 N D is used to group)
    name: str = ""


def check_points(points: list[Point]) -> None:
    for p in points:
        if not (math.isfinite(p.loss) and p.loss > 0):
            raise FitError(f"{p.name or 'a point'} has loss {p.loss}: a diverged or unfinished run cannot be fitted; "
                           "rerun it or leave it out")
        if not all(math.isfinite(v) and v > 0 for v in (p.params, p.tokens)):
            raise FitError(f"{p.name or 'a point'} has params={p.params}, tokens={p.tokens}: both must be finite "
                           "and > 0")
        if not (math.isfinite(p.budget) and p.budget >= 0):
            raise FitError(f"{p.name or 'a point'} has budget={p.budget}: a budget must be finite and > 0 "
                           "(or left out)")


def check_budget(budget: float) -> None:
    if not (math.isfinite(budget) and budget > 0):
        raise FitError(f"--budget={budget}: give a positive, finite number of FLOPs, e.g. 1e21")


# Past these, a fit is reported as not holding. Exponents of language-model losses lie in (0, 1)
# (Kaplan ~0.07-0.1, Chinchilla 0.28-0.34, DeepSeek/Llama 3 fits in between); a 10% RMS error in
# log loss is far above the run-to-run noise of a sweep (~1%).
EXPONENT_RANGE = (0.0, 1.0)
MAX_RESIDUAL_RMS = 0.1


def problems(par: dict) -> list[str]:
    """Why the fitted parametric law does not describe the points (empty: it does). (An IsoFLOP
    curve without a minimum says the sizes miss that budget's optimum, not that the law fails: the
    IsoFLOP fit warns of it.)"""
    out = []
    law = par["law"]
    for k in ("alpha", "beta"):
        if not EXPONENT_RANGE[0] < law[k] < EXPONENT_RANGE[1]:
            out.append(f"{k} = {law[k]:.3g} lies outside (0, 1)")
    rms = float(np.sqrt(np.mean(np.square(par["residuals"]))))
    if rms > MAX_RESIDUAL_RMS:
        out.append(f"the RMS error in log loss is {rms:.3g}, far above the noise of a sweep (~0.01)")
    return out


# ---------------------------------------------------------------------------------- IsoFLOP
def budget_groups(points: list[Point]) -> dict[float, list[Point]]:
    """Points by budget: the runs' own budgets, or 6 N D rounded to a 5% log bin."""
    groups: dict[float, list[Point]] = {}
    for p in points:
        c = p.budget or 6 * p.params * p.tokens
        key = p.budget or float(f"{10 ** (round(math.log10(c) * 40) / 40):.3g}")
        groups.setdefault(key, []).append(p)
    return dict(sorted(groups.items()))


def isoflop(points: list[Point]) -> dict:
    """Per budget the parabola's minimum; then N_opt, D_opt power laws in C through the minima that
    lie inside the sizes trained (a minimum outside them is an extrapolation: kept, marked, and left
    out of the power laws, with a warning)."""
    check_points(points)
    groups = budget_groups(points)
    minima, warnings = [], []
    for c, group in groups.items():
        sizes = sorted({p.params for p in group})
        if len(sizes) < 3:  # (a point without a budget in a group of its own, a budget cut short)
            warnings.append(f"budget {c:.3g} has {len(sizes)} model size(s): an IsoFLOP parabola needs at least 3; "
                            "left out")
            continue
        x = np.log([p.params for p in group])
        y = np.array([p.loss for p in group])
        a, b, k = (float(v) for v in np.polyfit(x, y, 2))
        m = {"budget": c, "parabola": [a, b, k], "inside": False}
        if a <= 0:
            warnings.append(f"budget {c:.3g}: the loss over model size has no minimum (the parabola opens downwards)")
        else:
            log_n = -b / (2 * a)
            n_opt = math.exp(log_n)
            m.update(params=n_opt, tokens=c / (6 * n_opt), loss=k - b * b / (4 * a),
                     inside=bool(x.min() <= log_n <= x.max()))
            if not m["inside"]:
                warnings.append(f"budget {c:.3g}: the fitted minimum N={n_opt:.3g} lies outside the sizes trained "
                                f"({math.exp(x.min()):.3g}-{math.exp(x.max()):.3g}); add sizes towards it")
        minima.append(m)
    if not minima:
        raise FitError("no budget has 3 model sizes: an IsoFLOP parabola needs at least 3")
    out = {"minima": minima, "warnings": warnings}
    good = [m for m in minima if m["inside"]]
    if len(good) >= 2:
        log_c = np.log([m["budget"] for m in good])
        for key in ("params", "tokens"):
            slope, intercept = np.polyfit(log_c, np.log([m[key] for m in good]), 1)
            out[f"{key}_law"] = {"exponent": float(slope), "coefficient": float(math.exp(intercept))}
    return out


def isoflop_optimum(fit: dict, budget: float) -> dict:
    n = fit["params_law"]["coefficient"] * budget ** fit["params_law"]["exponent"]
    d = fit["tokens_law"]["coefficient"] * budget ** fit["tokens_law"]["exponent"]
    return {"budget": budget, "params": n, "tokens": d}


# ------------------------------------------------------------------------------- parametric
HUBER_DELTA = 1e-3
GRID = {"a": [0, 8, 16, 24], "b": [0, 8, 16, 24], "e": [-1, 0, 1], "alpha": [0.2, 0.6, 1.0, 1.5],
        "beta": [0.2, 0.6, 1.0, 1.5]}  # 768 points
STARTS = 32  # L-BFGS runs from the best of them


def _objective(theta, log_n, log_d, log_l):
    """Huber loss of log L against LSE(a - alpha log N, b - beta log D, e), and its gradient."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    top = terms.max(axis=0)
    w = np.exp(terms - top)
    lse = top + np.log(w.sum(axis=0))
    w /= w.sum(axis=0)
    r = lse - log_l
    small = np.abs(r) <= HUBER_DELTA
    loss = np.where(small, 0.5 * r * r, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)).sum()
    dr = np.where(small, r, HUBER_DELTA * np.sign(r))  # d loss / d r
    grad = np.array([(dr * w[0]).sum(), (dr * w[1]).sum(), (dr * w[2]).sum(),
                     -(dr * w[0] * log_n).sum(), -(dr * w[1] * log_d).sum()])
    return loss, grad


def _minimise(start, log_n, log_d, log_l):
    from scipy.optimize import minimize

    # The objective is of order delta x residuals (~1e-4): scipy's default tolerances are absolute
    # below 1 and stopped every descent a few steps from its start. Scaled to order one and with
    # tolerances at machine precision, each descent runs to the minimum.
    res = minimize(lambda t: tuple(v / HUBER_DELTA for v in _objective(t, log_n, log_d, log_l)), start, jac=True,
                   method="L-BFGS-B", bounds=[(None, None), (None, None), (None, None), (0, 5), (0, 5)],
                   options={"ftol": 1e-15, "gtol": 1e-10, "maxiter": 5000})
    return res.fun * HUBER_DELTA, res.x


def parametric(points: list[Point], bootstrap: int = 100, seed: int = 0) -> dict:
    """The law and, from `bootstrap` resamples, 95% intervals of alpha, beta (and E, A, B); `samples`:
    the resamples' laws (for intervals of what is derived from the law: compare.py)."""
    check_points(points)
    if len(points) < 5:
        raise FitError(f"{len(points)} points: the parametric law has 5 parameters and needs more points")
    log_n, log_d = np.log([p.params for p in points]), np.log([p.tokens for p in points])
    log_l = np.log([p.loss for p in points])
    # L-BFGS from the best grid points (the objective at all 768 is cheap; each descent is not).
    grid = sorted(itertools.product(*GRID.values()),
                  key=lambda s: _objective(np.array(s, dtype=float), log_n, log_d, log_l)[0])
    best = min((_minimise(np.array(s, dtype=float), log_n, log_d, log_l) for s in grid[:STARTS]),
               key=lambda r: r[0])
    theta = best[1]
    law = _law(theta)
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(bootstrap):
        i = rng.integers(0, len(points), len(points))
        # From the full fit, which is near every resample's optimum: a few steps. (Adding the 3 best grid
        # points as starts took 4.5x as long and gave the same intervals: coverage of alpha and beta 39
        # and 38 of 40 seeds either way, tests/test_scaling.py.)
        samples.append(_law(_minimise(theta, log_n[i], log_d[i], log_l[i])[1]))
    intervals = {k: [float(np.percentile([s[k] for s in samples], 2.5)),
                     float(np.percentile([s[k] for s in samples], 97.5))] for k in law} if samples else {}
    predicted = np.array([predict(law, p.params, p.tokens) for p in points])
    return {"law": law, "intervals": intervals, "samples": samples, "objective": float(best[0]),
            "residuals": (np.log([p.loss for p in points]) - np.log(predicted)).tolist()}


def _law(theta) -> dict:
    a, b, e, alpha, beta = (float(x) for x in theta)
    return {"E": math.exp(e), "A": math.exp(a), "B": math.exp(b), "alpha": alpha, "beta": beta}


def predict(law: dict, params: float, tokens: float) -> float:
    return law["E"] + law["A"] / params ** law["alpha"] + law["B"] / tokens ** law["beta"]


def optimum(law: dict, budget: float) -> dict:
    """N*, D* and the predicted loss for `budget` FLOPs under C = 6 N D."""
    alpha, beta = law["alpha"], law["beta"]
    if alpha <= 0 or beta <= 0:
        raise FitError(f"the fitted exponents alpha={alpha:.3g}, beta={beta:.3g} give no optimum: "
                       "the points do not constrain the law")
    g = (alpha * law["A"] / (beta * law["B"])) ** (1 / (alpha + beta))
    n = g * (budget / 6) ** (beta / (alpha + beta))
    d = (budget / 6) ** (alpha / (alpha + beta)) / g
    return {"budget": budget, "params": n, "tokens": d, "loss": predict(law, n, d)}
