"""Scaling laws end to end: `pretrain scaling plan | run | fit | plot` (docs/scaling.md).

plan.py writes a sweep (run configs + manifest.csv), run.py trains it, results.py reads the finished
runs' (N, D, loss) points, fit.py fits the IsoFLOP and parametric laws, plot.py draws them.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)


def _floats(text: str) -> list[float]:
    from pretrain.errors import ConfigError

    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--budgets {text!r}: give comma-separated FLOP counts, e.g. 1e15,3e15,1e16") from None


def plan_cli(args) -> None:
    from pretrain.scaling.plan import plan, table

    rows = plan(args.config, args.overrides, _floats(args.budgets), args.out, sizes=args.sizes, span=args.span,
                schedule=args.schedule, lr=args.lr, name=args.name, replace=args.replace)
    print(table(rows))
    runs = len({r["run"] for r in rows})
    print(f"\n{len(rows)} points from {runs} runs, {sum({r['run']: r['flops'] for r in rows}.values()):.3g} FLOPs "
          f"in all; manifest: {args.out}/manifest.csv\nnext: pretrain scaling run {args.out}   "
          f"(or: sbatch --array=0-{runs - 1}%4 slurm/scaling_sweep.sbatch {args.out})")


def run_cli(args) -> None:
    from pretrain.scaling.run import config_of, run_sweep

    if args.config_of is not None:
        config = config_of(args.dir, args.config_of)
        if config:
            print(config)
        return
    run_sweep(args.dir, nproc=args.nproc, index=args.index)


def _fits(inputs: list[str], bootstrap: int):
    from pretrain.scaling import fit as F
    from pretrain.scaling.results import collect

    points = collect(inputs)
    F.check_points(points)
    try:  # points without a budget are grouped by 6 N D
        iso = F.isoflop(points)
    except F.FitError as e:  # the parametric law needs no budgets: it goes on without the parabolas
        log.warning("warning: no IsoFLOP fit: %s", e)
        iso = None
    par = F.parametric(points, bootstrap=bootstrap)
    return points, iso, par


def fit_cli(args) -> None:
    from pretrain.errors import UserError
    from pretrain.scaling import fit as F

    if args.budget:
        F.check_budget(args.budget)
    points, iso, par = _fits(args.inputs, args.bootstrap)
    law, ci = par["law"], par["intervals"]
    budget = args.budget or max(p.budget or 6 * p.params * p.tokens for p in points)
    wrong = F.problems(par)
    if wrong:  # what was found is still shown, marked; N* and D* need a law that holds
        log.warning("warning: the law does not hold for these points: %s", "; ".join(wrong))
    print(f"{len(points)} points, {len({p.params for p in points})} model sizes")
    print("\nparametric law L(N, D) = E + A / N^alpha + B / D^beta (Huber on log L, L-BFGS from a grid; "
          f"95% bootstrap intervals over {args.bootstrap} resamples):")
    print("| | fit | 95% interval |\n|---|---|---|")
    for k in ("E", "A", "B", "alpha", "beta"):
        interval = f"{ci[k][0]:.4g} - {ci[k][1]:.4g}" if ci else "-"
        print(f"| {k} | {law[k]:.4g} | {interval} |")
    if iso:
        print("\nIsoFLOP minima (parabola in log N per budget):")
        print("| budget | N_opt | D_opt | loss |\n|---|---|---|---|")
        for m in iso["minima"]:
            if "params" in m:
                note = "" if m["inside"] else " (outside the sizes trained)"
                print(f"| {m['budget']:.3g} | {m['params']:.4g}{note} | {m['tokens']:.4g} | {m['loss']:.4f} |")
            else:
                print(f"| {m['budget']:.3g} | no minimum | | |")
        for w in iso["warnings"]:
            log.warning("warning: %s", w)
        if "params_law" in iso:
            print(f"N_opt ~ C^{iso['params_law']['exponent']:.3f}, D_opt ~ C^{iso['tokens_law']['exponent']:.3f}")
        else:
            log.warning("warning: fewer than 2 budgets have a minimum inside their sizes: no N_opt(C), D_opt(C) laws")
    opt = None if wrong else F.optimum(law, budget)
    if opt:
        print(f"\nfor C = {budget:.3g} FLOPs (C = 6 N D): N* = {opt['params']:.4g}, D* = {opt['tokens']:.4g} "
              f"(D/N = {opt['tokens'] / opt['params']:.1f}), predicted loss {opt['loss']:.4f}")
        if iso and "params_law" in iso:
            io = F.isoflop_optimum(iso, budget)
            print(f"IsoFLOP power laws at the same C: N_opt = {io['params']:.4g}, D_opt = {io['tokens']:.4g}")
    if args.json:
        out = {"holds": not wrong, "problems": wrong, "law": law, "intervals": ci, "optimum": opt, "isoflop": iso,
               "residuals": par["residuals"], "points": [vars(p) for p in points]}
        try:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        except OSError as e:
            raise UserError(f"--json {args.json}: {e.strerror}") from None
    if wrong:
        raise F.FitError(f"the law does not hold for these points ({'; '.join(wrong)}): no N*, D* recommended; "
                         "the fit above is what was found")


def plot_cli(args) -> None:
    from pretrain.errors import UserError
    from pretrain.scaling.plot import plot

    points, iso, par = _fits(args.inputs, bootstrap=0)
    if iso is None:
        raise UserError("plot: the points have no budgets (IsoFLOP curves need them): give sweep dirs or a CSV "
                        "with a budget column")
    for path in plot(points, iso, par["law"], args.out, args.budget):
        print(path)
