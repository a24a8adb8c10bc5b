"""Scaling laws end to end: `pretrain scaling plan | run | fit | plot` (docs/scaling.md).

plan.py writes a sweep (run configs + manifest.csv), lr_sweep.py one over learning rates at the
base model (muP's base rate, docs/mup.md), run.py trains it, results.py reads the finished
runs' (N, D, loss) points, fit.py fits the IsoFLOP and parametric laws, plot.py draws them;
ladder.py predicts a downstream task's accuracy (`fit --target TASK/METRIC`), compare.py what one
ladder trained two ways (AdamW, Muon) differs by.
"""

from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)


def plan_cli(args) -> None:
    from pretrain.scaling.plan import floats, plan, table

    rows = plan(args.config, args.overrides, floats(args.budgets), args.out, sizes=args.sizes, span=args.span,
                schedule=args.schedule, lr=args.lr, name=args.name, replace=args.replace,
                parametrization=args.parametrization)
    print(table(rows))
    runs = len({r["run"] for r in rows})
    print(f"\n{len(rows)} points from {runs} runs, {sum({r['run']: r['flops'] for r in rows}.values()):.3g} FLOPs "
          f"in all; manifest: {args.out}/manifest.csv\nnext: pretrain scaling run {args.out}   "
          f"(or: sbatch --array=0-{runs - 1}%4 slurm/scaling_sweep.sbatch {args.out})")


def lr_sweep_cli(args) -> None:
    from pretrain.scaling.lr_sweep import lr_sweep_cli as cli

    cli(args)


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


def _ladder(args):
    from pretrain.scaling import ladder as L

    if not (args.params and args.tokens):
        raise L.FitError(f"--target {args.target}: give the target's --params N and --tokens D to predict at")
    points = L.collect(args.inputs, args.target)
    return points, L.ladder(points, args.params, args.tokens, bootstrap=getattr(args, "bootstrap", 100))


def ladder_cli(args) -> None:
    from pretrain.errors import UserError
    from pretrain.scaling import ladder as L

    points, r = _ladder(args)
    law, sig, t = r["step1"]["law"], r["step2"], r["target"]
    task, metric = L.parse_target(args.target)
    print(f"{len(points)} points, {len({p.params for p in points})} model sizes: {args.target} from {task}/bpb")
    print(f"step 1: {task}/bpb(N, D) = {law['E']:.4g} + {law['A']:.4g} / N^{law['alpha']:.3f} + "
          f"{law['B']:.4g} / D^{law['beta']:.3f}")
    for w in r["step1"]["problems"]:
        log.warning("warning: step 1 does not hold: %s", w)
    print(f"step 2: {metric} = {sig['a']:.4g} / (1 + exp(-({sig['k']:.4g}) (bpb - {sig['x0']:.4g}))) + {sig['b']:.4g} "
          f"(RMS error {sig['rms']:.3g})")
    for w in sig["problems"]:
        log.warning("warning: step 2: %s", w)
    ci = lambda k: (f" (95% interval {t[k + '_interval'][0]:.4g} - {t[k + '_interval'][1]:.4g}, "  # noqa: E731
                    f"{t['bootstrap']} resamples)" if t[k + "_interval"] else "")
    shown = (f"{t['value']:.4f}{ci('value')}" if t["value"] is not None
             else "none (it does not move with bpb beyond its noise: step 2's warning)")
    print(f"at N = {t['params']:.4g}, D = {t['tokens']:.4g}: {task}/bpb {t['bpb']:.4f}{ci('bpb')}, "
          f"{args.target} {shown}")
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump({**r, "points": [vars(p) for p in points], "target_metric": args.target}, f, indent=1)
        except OSError as e:
            raise UserError(f"--json {args.json}: {e.strerror}") from None
    if t["value"] is None:
        raise L.FitError(f"no prediction of {args.target}: it does not move with bpb beyond its sampling noise "
                         "(step 2 above); the fits are what was found")


def fit_cli(args) -> None:
    from pretrain.errors import UserError
    from pretrain.scaling import fit as F

    if args.target:
        return ladder_cli(args)

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


def compare_cli(args) -> None:
    from pretrain.scaling.compare import compare_cli as cli

    cli(args)


def plot_cli(args) -> None:
    from pretrain.errors import UserError
    from pretrain.scaling.plot import plot

    if args.target:
        from pretrain.scaling import ladder as L

        points, r = _ladder(args)
        for path in L.plot(points, r, args.target, args.out):
            print(path)
        return

    points, iso, par = _fits(args.inputs, bootstrap=0)
    if iso is None:
        raise UserError("plot: the points have no budgets (IsoFLOP curves need them): give sweep dirs or a CSV "
                        "with a budget column")
    for path in plot(points, iso, par["law"], args.out, args.budget):
        print(path)
