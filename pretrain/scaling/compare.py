"""`pretrain scaling compare A B [--budget C] [--out DIR] [--json FILE]`: what B (another optimizer,
say) buys over A, measured on one ladder trained twice (docs/optimizers.md, "What it buys").

A and B are what `scaling fit` reads (sweep dirs, run dirs, CSVs of points), typically two sweep
dirs planned alike, each trained at its own tuned rate. Reported:

- per point of both (the same N and D, which the same plan gives), each one's final eval loss and
  B - A;
- per B point, the compute multiplier at the same model size: the tokens A needs to go from its
  measured loss at (N, D) down (or up) to B's loss, along its fitted law's D-term
  (L_A(N, D) = E + A / N^alpha + B / D^beta: at a fixed N, L_A(N, D') - L_A(N, D) =
  B / D'^beta - B / D^beta), over D: k = D' / D = (t / (t + L_B - L_A))^(1/beta), t = B / D^beta,
  which at a fixed N is the ratio of compute too (k > 1: B is worth k times A's compute; infinite
  when the gap is larger than all that A's D-term has left, t). Anchored at A's measured point,
  not at its law's value there: the law's misfit at the point (a few percent on a small ladder)
  would otherwise enter k (a B point below A's measured loss could come out k < 1). The same N, not
  A's compute-optimal allocation: a B point trained off its optimum would otherwise count against B;
- the geometric mean of the multipliers over the points;
- at `--budget` C (default: the largest budget), the compute-optimal multiplier: the compute A
  needs at its own optimal allocation to reach B's optimal loss at C, over C. Both frontiers are
  L*(C) = E + K C^-gamma, gamma = alpha beta / (alpha + beta) (fit.optimum, C = 6 N D), so
  C_A = C ((L_B*(C) - E_A) / (L_A*(C) - E_A))^(-1/gamma_A): an extrapolation of both laws.

`--by-law`: ladders whose points are not of the same N and D (a Mixture-of-Experts family, whose
active N carries its routers, against a dense family planned alike: docs/moe.md): each B point is
set against A's law at its N and D instead of a measured A point (the row's A loss is the law's,
marked), and the multiplier is anchored there; A's misfit at the point then enters it, so the
table says so.

95% intervals: the points resampled and refitted (fit.parametric's bootstrap): A's for each
point's multiplier (the law's D-term; the two measured losses are taken as they are: their noise
is not in it), A's and the table's rows for the geometric mean (the rows' scatter carries the
points' noise), A's and B's paired for the compute-optimal multiplier.
`--out` draws compare.png: loss against compute for both, each size's law and both frontiers, and
the multipliers.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

from pretrain.scaling import fit as F

log = logging.getLogger(__name__)


def multiplier(law: dict, tokens: float, loss_a: float, loss_b: float) -> float:
    """D' / D: at a fixed N, the tokens that take A from loss_a (measured at `tokens`) to loss_b along
    the law's D-term B / D^beta, over `tokens`; inf when loss_b is below all that the term has left."""
    term = law["B"] / tokens ** law["beta"]
    gap = term + loss_b - loss_a
    return (term / gap) ** (1 / law["beta"]) if gap > 0 and law["beta"] > 0 else math.inf


def optimal_multiplier(law_a: dict, law_b: dict, budget: float) -> float:
    """C_A / C: the compute A needs at its optimal allocation to reach B's optimal loss at C (nan
    when a law has no optimum: a resample's exponent at 0)."""
    try:
        loss_a, loss_b = F.optimum(law_a, budget)["loss"], F.optimum(law_b, budget)["loss"]
    except F.FitError:
        return math.nan
    gamma = law_a["alpha"] * law_a["beta"] / (law_a["alpha"] + law_a["beta"])
    if loss_b <= law_a["E"]:
        return math.inf
    return ((loss_b - law_a["E"]) / (loss_a - law_a["E"])) ** (-1 / gamma)


def _interval(values) -> list[float] | None:
    v = np.array([x for x in values if not math.isnan(x)])  # (inf kept: a resample that never reaches it)
    if not len(v):
        return None
    return [float(np.percentile(v, 2.5, method="nearest")), float(np.percentile(v, 97.5, method="nearest"))]


def _label(path: str) -> str:
    """The optimizer a sweep dir was planned with (and its experts, for a Mixture-of-Experts), else
    the input's name."""
    plan = Path(path) / "plan.json"
    try:
        config = json.loads(plan.read_text())["inputs"]["config"]
        name, model = config["optimizer"]["name"], config.get("model", {})
    except (OSError, ValueError, KeyError, TypeError):
        return Path(path).stem
    if model.get("moe_experts"):
        name = f"MoE {model['moe_experts']}x top-{model.get('moe_top_k', 2)} ({name})"
    return name


def _key(p: F.Point) -> tuple[float, float]:
    return float(f"{p.params:.6g}"), float(f"{p.tokens:.6g}")


def compare(a: str, b: str, budget: float = 0.0, bootstrap: int = 200, by_law: bool = False) -> dict:
    from pretrain.scaling.results import collect

    # (sorted: the resamples, so the intervals, do not depend on the order of a sweep's or a CSV's rows)
    sides = {s: {"input": path, "label": _label(path), "points": sorted(collect([path]), key=_key)}
             for s, path in (("a", a), ("b", b))}
    if sides["a"]["label"] == sides["b"]["label"]:
        sides["a"]["label"], sides["b"]["label"] = f"A ({sides['a']['label']})", f"B ({sides['b']['label']})"
    by_key = {_key(p): p for p in sides["a"]["points"]}
    sizes_a, sizes_b = ({_key(p)[0] for p in sides[s]["points"]} for s in "ab")
    if by_law:
        return _by_law(sides, budget, bootstrap)
    if not sizes_a & sizes_b:
        raise F.FitError(f"{a} and {b} have no model size in common (A: {len(sizes_a)} sizes, B: {len(sizes_b)}): "
                         "plan both ladders alike (the same plan, one override apart)")
    pairs = [(by_key[_key(p)], p) for p in sides["b"]["points"] if _key(p) in by_key]
    if not pairs:
        raise F.FitError(f"{a} and {b} share model sizes but no point of the same N and D: plan both ladders alike "
                         "(the same budgets and schedule)")
    left = len(sides["a"]["points"]) + len(sides["b"]["points"]) - 2 * len(pairs)
    if left:
        log.warning("warning: %d point(s) without a partner of the same N and D: in the fits, not in the table", left)
    _fit(sides, bootstrap)
    law_a, samples_a = sides["a"]["law"], sides["a"]["samples"]
    rows = []
    for pa, pb in sorted(pairs, key=lambda ab: (ab[1].params, ab[1].tokens)):
        k = multiplier(law_a, pb.tokens, pa.loss, pb.loss)
        rows.append({"params": pb.params, "tokens": pb.tokens, "budget": pb.budget,
                     "compute": 6 * pb.params * pb.tokens, "loss_a": pa.loss, "loss_b": pb.loss, "difference": pb.loss - pa.loss, "multiplier": k,
                     "samples": [multiplier(s, pb.tokens, pa.loss, pb.loss) for s in samples_a]})
    return _summarise(sides, rows, budget, bootstrap)


def _fit(sides: dict, bootstrap: int) -> None:
    """Each side's parametric law and its bootstrap samples, with a warning where it does not hold."""
    for side in sides.values():
        side.update(F.parametric(side["points"], bootstrap=bootstrap))
        for w in F.problems(side):
            log.warning("warning: the law of %s does not hold: %s", side["input"], w)


def _by_law(sides: dict, budget: float, bootstrap: int) -> dict:
    """compare's rows with every B point set against A's law at its N and D (`--by-law`)."""
    _fit(sides, bootstrap)
    law_a, samples_a = sides["a"]["law"], sides["a"]["samples"]
    rows = []
    for pb in sorted(sides["b"]["points"], key=lambda p: (p.params, p.tokens)):
        loss_a = float(F.predict(law_a, pb.params, pb.tokens))
        rows.append({"params": pb.params, "tokens": pb.tokens, "budget": pb.budget, "compute": 6 * pb.params * pb.tokens,
                     "loss_a": loss_a, "loss_b": pb.loss, "difference": pb.loss - loss_a, "a_from_law": True,
                     "multiplier": multiplier(law_a, pb.tokens, loss_a, pb.loss),
                     "samples": [multiplier(sa, pb.tokens, float(F.predict(sa, pb.params, pb.tokens)), pb.loss)
                                 for sa in samples_a]})
    return _summarise(sides, rows, budget, bootstrap)


def _summarise(sides: dict, rows: list[dict], budget: float, bootstrap: int) -> dict:
    law_a, samples_a = sides["a"]["law"], sides["a"]["samples"]
    # The mean's interval: A's resample i with a resample of the rows (so B's noise counts too).
    mean = lambda ks: math.exp(float(np.mean(np.log(ks))))  # noqa: E731 (inf stays inf)
    rng = np.random.default_rng(0)
    summary = {"multiplier": mean([r["multiplier"] for r in rows]),
               "interval": _interval(mean([rows[j]["samples"][i] for j in rng.integers(0, len(rows), len(rows))])
                                     for i in range(len(samples_a)))}
    for r in rows:
        r["interval"] = _interval(r.pop("samples"))
    budget = budget or max(p.budget or 6 * p.params * p.tokens for p in sides["b"]["points"])
    optimal = {"budget": budget, "multiplier": optimal_multiplier(law_a, sides["b"]["law"], budget),
               "interval": _interval(optimal_multiplier(sa, sb, budget)
                                     for sa, sb in zip(samples_a, sides["b"]["samples"]))}
    return {"a": sides["a"], "b": sides["b"], "rows": rows, "geometric_mean": summary, "optimal": optimal,
            "bootstrap": bootstrap}


def _k(value: float, interval) -> str:
    ci = f" ({interval[0]:.3g} - {interval[1]:.3g})" if interval else ""
    return f"{value:.3g}{ci}"


def table(r: dict) -> str:
    a, b = r["a"]["label"], r["b"]["label"]
    lines = [f"| N | D | C = 6ND | {a} loss | {b} loss | {b} - {a} | compute multiplier (95%) |",
             "|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        law = " (law)" if x.get("a_from_law") else ""
        lines.append(f"| {x['params']:.3g} | {x['tokens']:.3g} | {x['compute']:.3g} | {x['loss_a']:.4f}{law} | "
                     f"{x['loss_b']:.4f} | {x['difference']:+.4f} | {_k(x['multiplier'], x['interval'])} |")
    return "\n".join(lines)


def report(r: dict) -> str:
    a, b = r["a"]["label"], r["b"]["label"]
    out = [f"A = {a}: {r['a']['input']} ({len(r['a']['points'])} points); "
           f"B = {b}: {r['b']['input']} ({len(r['b']['points'])} points)"]
    for s in "ab":
        law = r[s]["law"]
        out.append(f"{r[s]['label']}: L(N, D) = {law['E']:.4g} + {law['A']:.4g} / N^{law['alpha']:.3f} + "
                   f"{law['B']:.4g} / D^{law['beta']:.3f}")
    pairs = (f"{len(r['rows'])} points of {b}, each against {a}'s law at its N and D (--by-law: {a}'s misfit there "
             "is in the multiplier)" if any(x.get("a_from_law") for x in r["rows"]) else
             f"{len(r['rows'])} points of the same N and D")
    out += ["", f"{pairs}; the compute multiplier: the compute {a} needs at "
            f"the same N to go from its loss to {b}'s, by its law's D-term, over {b}'s (95% intervals: "
            f"{r['bootstrap']} resamples of {a}'s points)", "", table(r), ""]
    g, o = r["geometric_mean"], r["optimal"]
    out.append(f"geometric mean of the multipliers: {_k(g['multiplier'], g['interval'])}")
    out.append(f"compute-optimal at C = {o['budget']:.3g} (both laws' frontiers, extrapolated): {a} needs "
               f"{_k(o['multiplier'], o['interval'])} x the compute to reach {b}'s loss")
    return "\n".join(out)


def plot(r: dict, out: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from pretrain.plot import png_dir
    from pretrain.scaling.plot import _save

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 5))
    cs = [6 * p.params * p.tokens for s in "ab" for p in r[s]["points"]]
    grid = np.geomspace(min(cs) / 2, max(max(cs) * 3, r["optimal"]["budget"]), 100)
    for s, color in (("a", "tab:blue"), ("b", "tab:orange")):
        side, law = r[s], r[s]["law"]
        ax.scatter([6 * p.params * p.tokens for p in side["points"]], [p.loss for p in side["points"]], color=color,
                   s=18, label=f"{side['label']} runs", zorder=3)
        for n in sorted({p.params for p in side["points"]}):  # each size's law over its tokens trained
            d = np.array([p.tokens for p in side["points"] if p.params == n])
            ds = np.geomspace(d.min(), d.max(), 20)
            ax.plot(6 * n * ds, F.predict(law, n, ds), color=color, lw=0.8, alpha=0.6)
        ax.plot(grid, [F.optimum(law, c)["loss"] for c in grid], color=color, ls="--",
                label=f"{side['label']} L*(C): E={law['E']:.2f} alpha={law['alpha']:.2f} beta={law['beta']:.2f}")
    ax.set(xscale="log", xlabel="compute C = 6 N D (FLOPs)", ylabel="eval loss",
           title="Loss against compute (lines: each size's law; dashed: compute-optimal)")
    ax.legend(fontsize=8)
    a, b = r["a"]["label"], r["b"]["label"]
    sizes = sorted({x["params"] for x in r["rows"]})
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(sizes)))
    for n, color in zip(sizes, colors):
        rows = [x for x in r["rows"] if x["params"] == n]
        ks = np.array([x["multiplier"] for x in rows])
        lo = [x["interval"][0] if x["interval"] else k for x, k in zip(rows, ks)]
        hi = [x["interval"][1] if x["interval"] else k for x, k in zip(rows, ks)]
        err = np.clip([ks - lo, np.array(hi) - ks], 0, None)  # (an infinite bound is drawn to the edge)
        bx.errorbar([x["compute"] for x in rows], ks, yerr=np.where(np.isfinite(err), err, 1e6), fmt="o",
                    color=color, capsize=3, label=f"N = {n:.3g}")
    bx.axhline(1, color="black", lw=0.8)
    g = r["geometric_mean"]
    bx.axhline(g["multiplier"], color="tab:red", ls="--", label=f"geometric mean {_k(g['multiplier'], g['interval'])}")
    finite = [v for x in r["rows"] for v in [x["multiplier"], *(x["interval"] or [])] if 0 < v < math.inf]
    bx.set(xscale="log", yscale="log", xlabel="compute C = 6 N D (FLOPs)",
           ylabel="A's compute to reach B's loss / B's", ylim=(min(finite + [1]) / 1.5, max(finite + [1]) * 1.5))
    bx.set_title(f"Compute multiplier at the same N (95% intervals)\nA = {a}, B = {b}", fontsize=10)
    for axis in (bx.yaxis.set_major_formatter, bx.yaxis.set_minor_formatter):
        axis(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    bx.legend(fontsize=8)
    return _save(fig, png_dir(out) / "compare.png")


def compare_cli(args) -> None:
    from pretrain.errors import UserError

    if args.budget:
        F.check_budget(args.budget)
    r = compare(args.a, args.b, budget=args.budget, bootstrap=args.bootstrap, by_law=args.by_law)
    print(report(r))
    if args.out:
        print(plot(r, args.out))
    if args.json:
        drop = ("points", "samples", "residuals", "objective")
        out = {**{s: {k: v for k, v in r[s].items() if k not in drop} for s in "ab"},
               **{k: r[k] for k in ("rows", "geometric_mean", "optimal", "bootstrap")},
               "points": {s: [vars(p) for p in r[s]["points"]] for s in "ab"}}
        try:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        except OSError as e:
            raise UserError(f"--json {args.json}: {e.strerror}") from None
