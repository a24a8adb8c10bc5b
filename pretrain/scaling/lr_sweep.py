"""`pretrain scaling lr-sweep CONFIG [overrides] --lrs 1e-3,2e-3,4e-3 --out DIR`: tune the base
learning rate at the base model, for muP / CompleteP to carry to every size (docs/mup.md).

One run per rate: the config as given (its model, data, steps and schedule) with optimizer.lr set,
written as a sweep dir like `scaling plan`'s (configs/, manifest.csv, plan.json, runs/), so
`pretrain scaling run DIR` and `sbatch --array ... slurm/scaling_sweep.sbatch DIR` train it too.
Unless `--plan-only`, the runs are trained here (finished ones skipped, interrupted ones resumed),
then each is scored by its final eval/loss on the config's held-out data, and the best rate is
reported (DIR/lr_sweep.json), with a warning when it is at either end of the grid.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from pretrain.config import load_config
from pretrain.errors import ConfigError, UserError
from pretrain.scaling.plan import PLAN, _make_room, read_manifest, run_config, write_sweep

log = logging.getLogger(__name__)
RESULT = "lr_sweep.json"


def plan_lr_sweep(config: str, overrides: list[str], lrs: list[float], out: str, name: str = "",
                  replace: bool = False) -> list[dict]:
    import yaml

    from pretrain.build import model_args
    from pretrain.model.model import flops_per_token, matmul_params

    if len(lrs) < 3 or any(not (math.isfinite(x) and x > 0) for x in lrs) or len(set(lrs)) != len(lrs):
        raise ConfigError("--lrs: give 3 or more distinct positive rates, e.g. 1e-3,2e-3,4e-3,8e-3 (factors of 2)")
    base = load_config(config, overrides)
    if not base.data.validation:
        raise ConfigError("the config has no data.validation: the rates are compared by eval loss on held-out "
                          "data; name a validation source (data.validation)")
    args = model_args(base)
    lrs = sorted(lrs)
    out_dir = Path(out).resolve()
    sweep = name or out_dir.name
    steps = base.train.max_steps
    tokens = steps * base.global_batch(1) * base.data.seq_len
    flops = tokens * flops_per_token(args, base.data.seq_len)
    inputs = {"config": base.to_dict(), "lrs": lrs, "name": sweep, "kind": "lr-sweep"}
    _make_room(out_dir, inputs, replace)
    texts, manifest = {}, []
    for lr in lrs:
        run = f"lr{lr:.3g}".replace("+", "")
        d = run_config(base, args, sweep, run)
        d["optimizer"]["lr"] = lr
        texts[f"configs/{run}.yaml"] = yaml.safe_dump(d, sort_keys=False)
        manifest.append({"name": run, "budget": flops, "params": matmul_params(args), "tokens": tokens,
                         "flops": flops, "config": f"configs/{run}.yaml", "run": run, "steps": steps,
                         "end_step": steps, "dim": args.dim, "n_layers": args.n_layers})
    write_sweep(out_dir, texts, manifest, inputs)
    return manifest


def report(sweep_dir: str) -> dict:
    """The final eval loss of each rate, the best one, and whether it is inside the grid."""
    from pretrain.scaling.plan import check_runs
    from pretrain.scaling.results import run_losses

    sweep = Path(sweep_dir)
    plan = json.loads((sweep / PLAN).read_text()) if (sweep / PLAN).is_file() else {}
    if plan.get("inputs", {}).get("kind") != "lr-sweep":
        raise ConfigError(f"{sweep_dir} is not an lr-sweep dir (make one with `pretrain scaling lr-sweep`)")
    rows = read_manifest(sweep)
    check_runs(sweep, rows)
    lrs = plan["inputs"]["lrs"]
    losses = {lr: run_losses(sweep / "runs" / row["run"], row["steps"]).get(row["end_step"])
              for lr, row in zip(lrs, rows)}
    missing = [f"{lr:g}" for lr, v in losses.items() if v is None]
    if missing:
        raise UserError(f"{len(missing)} of {len(lrs)} runs have no final eval loss (lr {', '.join(missing)}): "
                        f"train them (pretrain scaling run {sweep_dir})")
    scored = {lr: v for lr, v in losses.items() if math.isfinite(v)}
    if not scored:
        raise UserError(f"every run of {sweep_dir} ended with a non-finite eval loss: lower the rates")
    best = min(scored, key=scored.get)
    edge = "lowest" if best == lrs[0] else "highest" if best == lrs[-1] else ""
    result = {"lrs": lrs, "eval_loss": [losses[lr] for lr in lrs], "best_lr": best, "best_eval_loss": scored[best],
              "at_edge": edge, "parametrization": plan["inputs"]["config"]["model"].get("parametrization", "sp")}
    (sweep / RESULT).write_text(json.dumps(result, indent=1) + "\n")
    return result


def lr_sweep_cli(args) -> None:
    from pretrain.scaling.plan import floats
    from pretrain.scaling.run import run_sweep

    lrs = floats(args.lrs, "--lrs")
    rows = plan_lr_sweep(args.config, args.overrides, lrs, args.out, name=args.name, replace=args.replace)
    print(f"{len(rows)} runs of {rows[0]['steps']} steps ({rows[0]['tokens']:,} tokens) in {args.out}")
    if args.plan_only:
        print(f"next: pretrain scaling run {args.out}   (or: sbatch --array=0-{len(rows) - 1} "
              f"slurm/scaling_sweep.sbatch {args.out}), then this command again to report")
        return
    run_sweep(args.out, nproc=args.nproc)
    r = report(args.out)
    print("| lr | eval loss |\n|---|---|")
    for lr, loss in zip(r["lrs"], r["eval_loss"]):
        print(f"| {lr:g} | {loss:.4f}{' (best)' if lr == r['best_lr'] else ''} |")
    if r["at_edge"]:
        log.warning("warning: the best rate is the %s one tried: the optimum may lie beyond it; extend --lrs",
                    r["at_edge"])
    print(f"best lr: {r['best_lr']:g} (eval loss {r['best_eval_loss']:.4f}); written to {Path(args.out) / RESULT}")
    print(f"next: pretrain scaling plan {args.config} --parametrization mup --lr {r['best_lr']:g} --budgets ... "
          "--out ...")
