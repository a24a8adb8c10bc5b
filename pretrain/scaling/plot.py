"""`pretrain scaling plot INPUTS... --out DIR`: the fits as PNGs (matplotlib, no display needed).

- isoflop.png: loss against N for each budget, the fitted parabolas and their minima;
- loss_vs_compute.png: every run's loss against its compute, the parametric law's optimal loss
  L(N*(C), D*(C)) extrapolated past the sweep, and the IsoFLOP minima;
- optimal_n_d.png: N_opt(C) and D_opt(C) from the IsoFLOP minima with their power laws, and the
  parametric law's N*(C), D*(C);
- residuals.png: log L measured minus log L predicted by the parametric law, against N and D.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pretrain.plot import png_dir
from pretrain.scaling import fit as F


def plot(points: list[F.Point], iso: dict, law: dict, out: str, budget: float = 0.0) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = png_dir(out)
    groups = F.budget_groups(points)
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(groups)))
    paths = []

    fig, ax = plt.subplots(figsize=(7, 5))
    minima = {m["budget"]: m for m in iso["minima"]}
    for (c, group), color in zip(groups.items(), colors):
        n = np.array([p.params for p in group])
        ax.scatter(n, [p.loss for p in group], color=color, label=f"C = {c:.2g}")
        m = minima.get(c)
        if m is None:  # (fewer than 3 sizes: no parabola)
            continue
        xs = np.geomspace(n.min() / 1.3, n.max() * 1.3, 100)
        a, b, k = m["parabola"]
        ax.plot(xs, a * np.log(xs) ** 2 + b * np.log(xs) + k, color=color, lw=1)
        if m["inside"]:
            ax.scatter([m["params"]], [m["loss"]], color=color, marker="*", s=180, edgecolor="black", zorder=3)
    ax.set(xscale="log", xlabel="parameters N", ylabel="eval loss", title="IsoFLOP curves (stars: minima)")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "isoflop.png"))

    fig, ax = plt.subplots(figsize=(7, 5))
    c_points = np.array([p.budget or 6 * p.params * p.tokens for p in points])
    ax.scatter(c_points, [p.loss for p in points], c="gray", s=15, label="runs")
    ax.scatter([m["budget"] for m in iso["minima"] if m["inside"]],
               [m["loss"] for m in iso["minima"] if m["inside"]], marker="*", s=150,
               color="tab:orange", edgecolor="black", label="IsoFLOP minima", zorder=3)
    top = max(budget, c_points.max() * 30)
    cs = np.geomspace(c_points.min() / 2, top, 100)
    ax.plot(cs, [F.optimum(law, c)["loss"] for c in cs], color="tab:blue",
            label=f"L(N*, D*), E={law['E']:.2f} alpha={law['alpha']:.2f} beta={law['beta']:.2f}")
    if budget:
        opt = F.optimum(law, budget)
        ax.scatter([budget], [opt["loss"]], marker="D", color="tab:red", label=f"target C={budget:.2g}", zorder=3)
    ax.set(xscale="log", xlabel="compute C (FLOPs)", ylabel="eval loss", title="Loss against compute (law extrapolated)")
    ax.legend(fontsize=8)
    paths.append(_save(fig, out_dir / "loss_vs_compute.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    minima = [m for m in iso["minima"] if m["inside"]]
    cs = np.geomspace(min(p.budget or 6 * p.params * p.tokens for p in points) / 2, top, 50)
    for ax, key, label in ((axes[0], "params", "N_opt"), (axes[1], "tokens", "D_opt")):
        ax.scatter([m["budget"] for m in minima], [m[key] for m in minima], color="tab:orange", marker="*", s=150,
                   edgecolor="black", label="IsoFLOP minima", zorder=3)
        if f"{key}_law" in iso:
            e, k = iso[f"{key}_law"]["exponent"], iso[f"{key}_law"]["coefficient"]
            ax.plot(cs, k * cs ** e, color="tab:orange", label=f"IsoFLOP fit: {label} ~ C^{e:.2f}")
        ax.plot(cs, [F.optimum(law, c)[key] for c in cs], color="tab:blue", ls="--", label="parametric law")
        ax.set(xscale="log", yscale="log", xlabel="compute C (FLOPs)", ylabel=label)
        ax.legend(fontsize=8)
    fig.suptitle("Compute-optimal model size and tokens")
    paths.append(_save(fig, out_dir / "optimal_n_d.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    resid = [math.log(p.loss) - math.log(F.predict(law, p.params, p.tokens)) for p in points]
    for ax, xs, label in ((axes[0], [p.params for p in points], "parameters N"),
                          (axes[1], [p.tokens for p in points], "tokens D")):
        ax.scatter(xs, resid, s=15)
        ax.axhline(0, color="black", lw=0.8)
        ax.set(xscale="log", xlabel=label, ylabel="log L - log L_fit")
    fig.suptitle(f"Residuals of the parametric law (rms {np.sqrt(np.mean(np.square(resid))):.4f})")
    paths.append(_save(fig, out_dir / "residuals.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
