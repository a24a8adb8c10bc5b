"""`pretrain scaling plan CONFIG --budgets C1,C2,... --out DIR`: the runs of a scaling-law sweep.

For each compute budget C (FLOPs), model sizes around the expected optimum, each trained on
D = C / FLOPs-per-token tokens (the trainer's PaLM formula, the one that logs C), written as one run
config per run and DIR/manifest.csv.

The model family (docs/scaling.md): the base config's head_dim, GQA ratio (heads per KV head),
SwiGLU rounding and vocabulary are kept; its members are the shapes (depth, whole GQA groups of
heads) whose aspect ratio dim / n_layers is within 2x of the base's, the closest to it among shapes
of about the same N; a size N is reached by the member closest to it. N counts the parameters that do matmul work per token: every parameter but the embedding
lookup, with the LM head counted even when tied: the N of the trainer's 6N + attention FLOPs.

The expected optimum is Chinchilla's D = 20 N (C = 6 N D, so N = sqrt(C / 120)); the sizes span
`--span` (default 8x) around it, log-spaced; where the family has too few members there (an
optimum below its smallest model: tiny budgets with a large vocabulary), the sizes nearest to it,
with a warning. Batch: the base config's global batch in tokens. LR: under sp, the base config's
optimizer.lr scaled by sqrt(base dim / dim) (a heuristic: wider models take smaller steps), or
`--lr` for all; under muP or CompleteP (`--parametrization`, or the base config's
model.parametrization) one rate for every size, `--lr` or the base config's: the base model is the
base config's (mup_base_dim = its dim, mup_base_layers = its depth, unless it sets them), where
`pretrain scaling lr-sweep` tuned the rate (docs/mup.md). Warmup: the base config's, at most 10%
of the run's steps (of its first branch with wsd-s).

Schedules: `--schedule cosine` (default; decay to the end of each run), `wsd` (warmup, stable,
decay over schedule.decay_fraction), or `wsd-s`: one run per size whose decay branches end at each
budget's token count (OLMo-core's WSD-S); the manifest then lists one row per (budget, size) and
several rows share a run.

A sweep dir is self-contained: the manifest's config paths and each config's run dir are relative
(a copied sweep trains into its own runs/). It records its plan (DIR/plan.json: the inputs and
their hash): planning into a dir that holds runs of another plan is refused unless `replace` moves
the old plan and runs to DIR/replaced/; `run` and `fit` refuse runs trained under another config
than the one planned for them (`check_runs`), naming the difference.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import json
import logging
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from pretrain.config import Config, load_config
from pretrain.errors import ConfigError
from pretrain.model.args import ModelArgs
from pretrain.model.model import flops_per_token, matmul_params

log = logging.getLogger(__name__)

MANIFEST = "manifest.csv"
PLAN = "plan.json"
COLUMNS = ["name", "budget", "params", "tokens", "flops", "config", "run", "steps", "end_step", "dim", "n_layers"]
MAX_LAYERS = 64
MIN_STEPS = 100  # fewer and the loss is mostly warmup and noise: warned
SAVE_MINUTES = 5.0  # sweep runs save this often (checkpoint.every_minutes) unless the base config says
# Config fields that do not change what a run computes: a run trained with other values of these
# still belongs to its plan (another machine, launcher, checkpoint cadence or logger).
INCIDENTAL = ("train.run_dir", "train.micro_batch_size", "train.overwrite", "train.compile", "data.num_workers",
              "checkpoint.", "logging.", "distributed.")


def floats(text: str, flag: str = "--budgets") -> list[float]:
    """A command-line list of numbers ("1e15,3e15"); one line naming `flag` if it is not one."""
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        example = "FLOP counts, e.g. 1e15,3e15,1e16" if flag == "--budgets" else "numbers, e.g. 1e-3,2e-3,4e-3"
        raise ConfigError(f"{flag} {text!r}: give comma-separated {example}") from None


def grown(base: ModelArgs, n_layers: int, groups: int) -> ModelArgs:
    """The member of base's family of depth n_layers and width `groups` GQA groups of heads: base's
    head_dim and query heads per KV head, the SwiGLU width derived from dim."""
    heads = groups * (base.n_heads // base.kv_heads)
    return dataclasses.replace(base, preset="", dim=heads * base.head_dim, n_layers=n_layers, n_heads=heads,
                               n_kv_heads=groups if base.n_kv_heads else 0, ffn_hidden_dim=0)


@dataclasses.dataclass
class Family:
    base: ModelArgs
    seq_len: int

    @property
    def group(self) -> int:  # query heads per KV head
        return self.base.n_heads // self.base.kv_heads

    def shape(self, n_layers: int, groups: int) -> ModelArgs:
        return grown(self.base, n_layers, groups)

    @functools.cached_property
    def members(self) -> list[tuple[int, ModelArgs]]:
        """Every shape whose aspect ratio dim / n_layers is within 2x of the base's, by N; of shapes
        with (nearly) the same N, the one whose aspect ratio is closest to the base's."""
        b = self.base
        aspect = b.dim / b.n_layers
        best: dict[int, tuple[float, ModelArgs]] = {}
        for layers in range(1, MAX_LAYERS + 1):
            for groups in range(1, 4 * round(aspect * layers / (b.head_dim * self.group)) + 2):
                args = self.shape(layers, groups)
                off = abs(math.log(args.dim / layers / aspect))
                if off > math.log(2):
                    continue
                n = matmul_params(args)
                key = round(math.log(n) * 20)  # shapes within 5% of each other in N: one member
                if key not in best or off < best[key][0]:
                    best[key] = (off, args)
        return sorted((matmul_params(a), a) for _, a in best.values())

    def around(self, target: float, sizes: int, span: float) -> tuple[list[tuple[int, ModelArgs]], bool]:
        """`sizes` distinct members spread evenly (in member order, so about evenly in log N) over
        `span` around `target`; where the family has too few there, the `sizes` members nearest to
        it. Second: whether target is inside the family."""
        members = self.members
        lo, hi = target / math.sqrt(span), target * math.sqrt(span)
        inside = [m for m in members if lo <= m[0] <= hi]
        if len(inside) >= sizes:
            picks = np.unique(np.round(np.linspace(0, len(inside) - 1, sizes)).astype(int))
            chosen = [inside[i] for i in picks]
        else:
            centre = min(range(len(members)), key=lambda i: abs(math.log(members[i][0] / target)))
            first = min(max(0, centre - sizes // 2), max(0, len(members) - sizes))
            chosen = members[first:first + sizes]
        return chosen, members[0][0] <= target <= members[-1][0]


def plan(config: str, overrides: list[str], budgets: list[float], out: str, sizes: int = 7, span: float = 8.0,
         schedule: str = "cosine", lr: float = 0.0, name: str = "", replace: bool = False,
         parametrization: str = "") -> list[dict]:
    """Write the run configs, DIR/manifest.csv and DIR/plan.json; return the manifest rows. Nothing
    is written unless every config is valid."""
    if not 3 <= sizes <= 15:
        raise ConfigError(f"--sizes {sizes}: give 3 to 15 model sizes per budget (5 to 9 is usual)")
    if not budgets or any(not (math.isfinite(c) and c > 0) for c in budgets):
        raise ConfigError("--budgets: give one or more positive, finite FLOP budgets, e.g. 1e15,3e15,1e16")
    if not (math.isfinite(span) and span > 1):
        raise ConfigError(f"--span {span}: the largest / smallest size per budget must be a number > 1 (8 is usual)")
    if not (math.isfinite(lr) and lr >= 0):
        raise ConfigError(f"--lr {lr}: give a positive learning rate (or 0: scaled by width)")
    if schedule not in ("cosine", "wsd", "wsd-s"):
        raise ConfigError(f"--schedule {schedule!r}: cosine, wsd or wsd-s")
    repeated = sorted({c for c in budgets if budgets.count(c) > 1})
    if repeated:
        log.warning("warning: --budgets: %s given more than once: planned once", ", ".join(f"{c:.3g}" for c in repeated))
    budgets = sorted(set(budgets))
    base = load_config(config, overrides)
    if parametrization:
        set_parametrization(base, parametrization)
    if not base.data.validation:
        raise ConfigError("the base config has no data.validation: a sweep's points are eval losses on held-out "
                          "data; name a validation source (data.validation)")
    from pretrain.build import model_args  # the shape with its vocabulary (from the tokenizer)

    family = Family(model_args(base), base.data.seq_len)
    tokens_per_step = base.global_batch(1) * base.data.seq_len
    out_dir = Path(out).resolve()
    sweep = name or out_dir.name
    rows, warnings = [], []
    smallest = family.members[0]
    for c in budgets:
        n_opt = math.sqrt(c / 120)
        chosen, inside = family.around(n_opt, sizes, span)
        if not inside:
            warnings.append(f"budget {c:.3g}: its expected optimum N={n_opt:.3g} (D = 20 N) is outside the family "
                            f"({smallest[0]:,}-{family.members[-1][0]:,} parameters): the nearest sizes are used")
        for n, args in chosen:
            fpt = flops_per_token(args, base.data.seq_len)
            steps = round(c / fpt / tokens_per_step)
            if steps < 1:
                raise ConfigError(f"budget {c:.3g} FLOPs is too small for a model of {n:,} parameters: one step "
                                  f"of {tokens_per_step:,} tokens costs {fpt * tokens_per_step:.3g}; raise the "
                                  "budgets or lower the batch (train.global_batch_size, data.seq_len)")
            if steps < MIN_STEPS:
                warnings.append(f"budget {c:.3g}, N={n:,}: only {steps} steps (fewer than {MIN_STEPS}): its loss is "
                                "mostly warmup and noise")
            rows.append({"budget": c, "params": n, "args": args, "steps": steps,
                         "tokens": steps * tokens_per_step, "flops": steps * tokens_per_step * fpt})
    if len({r["params"] for r in rows if r["budget"] == rows[0]["budget"]}) < 3:
        raise ConfigError("the family has fewer than 3 distinct sizes at a budget: widen --span or change the "
                          "base model's aspect ratio")
    _check_apart(rows)
    inputs = {"config": base.to_dict(), "budgets": budgets, "sizes": sizes, "span": span, "schedule": schedule,
              "lr": lr, "name": sweep}
    _make_room(out_dir, inputs, replace)
    manifest = _write(base, rows, out_dir, sweep, schedule, lr, inputs)
    if base.model.parametrization == "sp" and not lr:
        log.info("note: under sp each size's rate is a guess (sqrt(base dim / dim)); with --parametrization mup "
                 "(or completep) one rate tuned at the base (pretrain scaling lr-sweep) carries to every size")
    for w in sorted(set(warnings)):
        log.warning("warning: %s", w)
    return manifest


def set_parametrization(base: Config, parametrization: str) -> None:
    """--parametrization: the base config's model becomes the muP/CompleteP base of the family."""
    m = base.model
    if parametrization not in ("sp", "mup", "completep"):
        raise ConfigError(f"--parametrization {parametrization!r}: sp, mup or completep")
    m.parametrization = parametrization
    if parametrization != "sp":
        m.mup_base_dim = m.mup_base_dim or m.dim
        m.mup_base_head_dim = m.mup_base_head_dim or m.head_dim
    if parametrization == "completep":
        m.mup_base_layers = m.mup_base_layers or m.n_layers


def _check_apart(rows: list[dict]) -> None:
    """Budgets close enough to give one size the same number of steps (or the same name) would be
    one run twice, or two decay branches at one step: refused before anything is written."""
    seen: dict = {}
    for r in rows:
        key = (r["params"], r["steps"])
        if key in seen and seen[key] != r["budget"]:
            raise ConfigError(f"--budgets {seen[key]:.3g} and {r['budget']:.3g} are too close: both give the model "
                              f"of {r['params']:,} parameters {r['steps']} steps; spread them further apart or "
                              "merge them")
        seen[key] = r["budget"]
    names = {}
    for c in {r["budget"] for r in rows}:
        if f"{c:.3g}" in names:
            raise ConfigError(f"--budgets {names[f'{c:.3g}']!r} and {c!r} are the same to 3 digits: merge them")
        names[f"{c:.3g}"] = c


def _plan_hash(inputs: dict) -> str:
    """The plan's identity: its inputs, incidental fields left out."""
    flat = {k: v for k, v in _flat(inputs).items() if not _incidental(k)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:16]


def _make_room(out_dir: Path, inputs: dict, replace: bool) -> None:
    """A dir planned before: the same plan is planned again in place; another plan's trained runs
    are refused, or with `replace` moved to DIR/replaced/<time>/ with the old plan's files."""
    if not (out_dir / MANIFEST).is_file():
        return
    try:
        old = json.loads((out_dir / PLAN).read_text())
    except (OSError, ValueError):
        old = {"inputs": {}, "hash": ""}  # planned by an older version (or damaged): another plan
    if old.get("hash") == _plan_hash(inputs):
        return
    runs = sorted(p.name for p in (out_dir / "runs").iterdir()) if (out_dir / "runs").is_dir() else []
    if runs and not replace:
        diff = differences(old["inputs"], inputs) if old.get("inputs") else ["its plan is not recorded"]
        raise ConfigError(f"{out_dir} holds a sweep planned differently ({'; '.join(diff[:3])}) with {len(runs)} "
                          "run(s) in runs/: plan into a new --out, or add --replace to move the old plan and its "
                          "runs to replaced/")
    if not runs:  # nothing trained: the old plan's files go
        shutil.rmtree(out_dir / "configs", ignore_errors=True)
        return
    (out_dir / "replaced").mkdir(exist_ok=True)
    aside = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=out_dir / "replaced"))
    for name in (MANIFEST, PLAN, "configs", "runs"):
        if (out_dir / name).exists():
            (out_dir / name).rename(aside / name)
    log.warning("warning: the old plan and its %d run(s) were moved to %s", len(runs), aside)


def _write(base: Config, rows: list[dict], out_dir: Path, sweep: str, schedule: str, lr: float,
           inputs: dict) -> list[dict]:
    runs: dict = {}  # run name -> rows it serves
    for r in rows:
        size = f"n{r['params']:.3g}".replace("+", "")
        run = size if schedule == "wsd-s" else f"c{r['budget']:.3g}-{size}".replace("+", "")
        r["name"] = f"c{r['budget']:.3g}-{size}".replace("+", "")
        r["run"] = run
        runs.setdefault(run, []).append(r)
    manifest, texts = [], {}
    for run, members in runs.items():
        args = members[0]["args"]
        steps = max(m["steps"] for m in members)
        d = run_config(base, args, sweep, run)
        d["train"]["max_steps"] = steps
        d["optimizer"]["lr"] = lr or (base.optimizer.lr if args.parametrization != "sp"  # muP: the base's rate
                                      else base.optimizer.lr * math.sqrt(base.model.dim / args.dim))
        shortest = min(m["steps"] for m in members)  # a run's own end, or its first decay branch's
        d["schedule"].update(warmup_steps=max(1, min(base.schedule.warmup_steps, shortest // 10)), decay_steps=0,
                             kind="cosine" if schedule == "cosine" else "wsd",
                             decay_points=sorted(m["steps"] for m in members if m["steps"] < steps))
        d["scaling"] = {"sweep": sweep, "budgets": sorted(m["budget"] for m in members)}
        texts[f"configs/{run}.yaml"] = yaml.safe_dump(d, sort_keys=False)
        for m in members:
            manifest.append({"name": m["name"], "budget": m["budget"], "params": m["params"], "tokens": m["tokens"],
                             "flops": m["flops"], "config": f"configs/{run}.yaml", "run": run, "steps": steps,
                             "end_step": m["steps"], "dim": args.dim, "n_layers": args.n_layers})
    manifest.sort(key=lambda m: (m["budget"], m["params"]))
    write_sweep(out_dir, texts, manifest, inputs)
    return manifest


def run_config(base: Config, args: ModelArgs, sweep: str, run: str) -> dict:
    """The base config of one run of a sweep dir: its model (vocabulary filled in, as the trainer
    records it), its run dir relative to the config (a copied sweep is whole), the save cadence, and
    the W&B group and name."""
    d = base.to_dict()
    d["model"] = dataclasses.asdict(args)
    d["train"]["run_dir"] = f"../runs/{run}"
    d["checkpoint"]["every_minutes"] = base.checkpoint.every_minutes or SAVE_MINUTES
    d["logging"].update(group=sweep, name=f"{sweep}/{run}")
    return d


def write_sweep(out_dir: Path, texts: dict[str, str], manifest: list[dict], inputs: dict) -> None:
    """A sweep's files: its run configs (relative path -> YAML), plan.json and manifest.csv. Every
    config is checked to be one `pretrain train` accepts before any file is written."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "configs").mkdir()
        for rel, text in texts.items():
            (Path(tmp) / rel).write_text(text)
            load_config(str(Path(tmp) / rel))
    try:
        (out_dir / "configs").mkdir(parents=True, exist_ok=True)
        for rel, text in texts.items():
            (out_dir / rel).write_text(text)
        (out_dir / PLAN).write_text(json.dumps({"hash": _plan_hash(inputs), "inputs": inputs}, indent=1))
        with open(out_dir / MANIFEST, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(manifest)
    except OSError as e:
        raise ConfigError(f"--out {out_dir}: {e.strerror} ({e.filename})") from None


def read_manifest(sweep_dir: str | Path) -> list[dict]:
    path = Path(sweep_dir) / MANIFEST
    if not path.is_file():
        raise ConfigError(f"{sweep_dir} has no {MANIFEST}: make one with `pretrain scaling plan`")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r["config"] = str(Path(sweep_dir).absolute() / r["config"])  # relative to the sweep (an absolute one stays)
        for k in ("budget", "flops"):
            r[k] = float(r[k])
        for k in ("params", "tokens", "steps", "end_step", "dim", "n_layers"):
            r[k] = int(r[k])
    return rows


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _incidental(key: str) -> bool:
    return key.removeprefix("config.").startswith(INCIDENTAL)  # (a plan's base config is under "config")


def differences(old: dict, new: dict) -> list[str]:
    """What differs between two (nested) configs or plans, as `key: old -> new`, incidental fields
    left out."""
    a, b = _flat(old), _flat(new)
    keys = [k for k in sorted(a.keys() | b.keys()) if not _incidental(k)]
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def trained_config(run_dir: Path) -> dict | None:
    """The config a run was last trained under: its newest complete checkpoint's (else the run
    dir's config.yaml); None if it never started."""
    from pretrain.checkpoint.layout import complete_checkpoints

    done = complete_checkpoints(run_dir / "checkpoints")
    path = done[-1] / "config.yaml" if done else run_dir / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def check_runs(sweep_dir: Path, rows: list[dict]) -> None:
    """Refuse runs trained under another config than the one planned for them (a re-planned or
    edited sweep, a run trained by hand), naming the first difference."""
    bad = []
    for run, config in {r["run"]: r["config"] for r in rows}.items():
        trained = trained_config(sweep_dir / "runs" / run)
        if trained is not None:
            diff = differences(trained, load_config(config).to_dict())
            if diff:
                bad.append(f"{run} ({diff[0]}{', ...' if len(diff) > 1 else ''})")
    if bad:
        raise ConfigError(f"{sweep_dir}: {len(bad)} run(s) were trained under another config than the one planned, "
                          f"e.g. {bad[0]} (trained -> planned): move runs/{bad[0].split()[0]} aside to retrain it, "
                          "or plan again with --replace")


def table(rows: list[dict]) -> str:
    lines = ["| name | budget | params (N) | dim x layers | tokens (D) | D/N | steps | run |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['budget']:.3g} | {r['params']:,} | {r['dim']} x {r['n_layers']} | "
                     f"{r['tokens']:,} | {r['tokens'] / r['params']:.1f} | {r['end_step']} | {r['run']} |")
    return "\n".join(lines)
