"""Scaling laws: schedules (WSD, WSD-S branches), the fitters against known laws, the sweep planned,
run, fitted and plotted end to end on CPU, and the bad inputs."""

import csv
import json
import math

import numpy as np
import pytest
import torch

from helpers import REPO, TINY, read_metrics, run_train
from pretrain.cli import main
from pretrain.config import load_config
from pretrain.model.model import Transformer
from pretrain.optim.schedule import Schedule
from pretrain.scaling import fit as F

SCALING_TINY = REPO / "configs" / "scaling_tiny.yaml"
CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}  # Hoffmann et al. 2022, eq. 10


def synthetic(law, budgets=(1e18, 3e18, 1e19, 3e19, 1e20), sizes=7, noise=0.01, seed=0):
    """Points of a known law at each budget, sizes around its optimum, log-normal noise."""
    rng = np.random.default_rng(seed)
    out = []
    for c in budgets:
        n_opt = F.optimum(law, c)["params"]
        for f in np.geomspace(1 / 8, 8, sizes):
            n = n_opt * f
            d = c / (6 * n)
            out.append(F.Point(n, d, F.predict(law, n, d) * math.exp(rng.normal(0, noise)), c, f"{c:g}/{n:.3g}"))
    return out


# -------------------------------------------------------------------------------- schedules
def _schedule(**kw):
    overrides = [f"{k}={v}" for k, v in {"optimizer.lr": 1.0, "schedule.min_lr": 0.0, "train.max_steps": 100,
                                         "schedule.warmup_steps": 10, **kw}.items()]
    return Schedule(load_config(None, overrides))


@pytest.mark.parametrize("shape,mid", [("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_wsd_warms_up_holds_then_decays_with_its_shape(shape, mid):
    s = _schedule(**{"schedule.kind": "wsd", "schedule.decay_fraction": 0.2, "schedule.decay_shape": shape})
    lrs = [s(i) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0  # warmup to the peak
    assert all(lr == 1.0 for lr in lrs[10:80])  # stable
    assert lrs[90] == pytest.approx(mid)  # halfway through the last 20 steps
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:])) and lrs[99] < 0.25
    # A branch that ends at step 50 decays over its own last 10 steps, from the same stable phase.
    assert s(39, end=50) == 1.0 and s(45, end=50) == pytest.approx(mid)


def test_linear_and_constant_schedules():
    lin = _schedule(**{"schedule.kind": "linear"})
    assert lin(10) == 1.0 and lin(55) == pytest.approx(0.5) and lin(99) == pytest.approx(1 / 90)
    const = _schedule(**{"schedule.kind": "constant"})
    assert const(5) == pytest.approx(0.6) and const(99) == 1.0


def test_bad_schedules_are_reported_together():
    with pytest.raises(Exception) as e:
        load_config(None, ["schedule.kind=step", "schedule.decay_shape=exp", "schedule.decay_fraction=0",
                           "schedule.decay_points=[5,200]", "train.max_steps=100"])
    text = str(e.value)
    for part in ("schedule.kind", "schedule.decay_shape", "schedule.decay_fraction", "needs schedule.kind=wsd",
                 "before train.max_steps"):
        assert part in text, part
    with pytest.raises(Exception, match="start their decay at the same step"):  # 12 - 2 == 13 - 3
        load_config(None, ["schedule.kind=wsd", "schedule.decay_points=[12,13]", "train.max_steps=100",
                           "schedule.warmup_steps=5"])


# ---------------------------------------------------------------------------------- fitting
def test_parametric_fit_recovers_a_known_law():
    """1% noise on Chinchilla's law, 5 budgets x 7 sizes: exponents within 0.03, E within 0.05,
    N* at 1e21 within 20%, its predicted loss within 1%."""
    result = F.parametric(synthetic(CHINCHILLA), bootstrap=60)
    law, ci = result["law"], result["intervals"]
    assert law["alpha"] == pytest.approx(0.34, abs=0.03) and law["beta"] == pytest.approx(0.28, abs=0.03)
    assert law["E"] == pytest.approx(1.69, abs=0.05)
    for k in ("alpha", "beta"):  # bootstrap intervals around the estimate, narrow at this noise
        assert ci[k][0] <= law[k] <= ci[k][1] and ci[k][1] - ci[k][0] < 0.1
    got, want = F.optimum(law, 1e21), F.optimum(CHINCHILLA, 1e21)
    assert got["params"] == pytest.approx(want["params"], rel=0.2)
    assert got["loss"] == pytest.approx(want["loss"], rel=0.01)


@pytest.mark.slow
def test_bootstrap_intervals_cover_the_true_exponents():
    """Over 40 noise seeds (1% noise, Chinchilla's law, 5 budgets x 7 sizes) the 95% intervals of
    alpha and beta hold the true value at least 90% of the time (measured: 39/40 and 38/40; before
    the refits ran to convergence, 8/12 and 7/12), and the point estimates are unbiased within 0.015
    (measured means: alpha 0.332 for 0.34, beta 0.278 for 0.28)."""
    seeds, hits, estimates = 40, {"alpha": 0, "beta": 0}, {"alpha": [], "beta": []}
    for seed in range(seeds):
        fit = F.parametric(synthetic(CHINCHILLA, seed=seed), bootstrap=50, seed=seed)
        for k in hits:
            lo, hi = fit["intervals"][k]
            hits[k] += lo <= CHINCHILLA[k] <= hi
            estimates[k].append(fit["law"][k])
    for k in hits:
        assert hits[k] / seeds >= 0.9, (k, hits[k])
        assert np.mean(estimates[k]) == pytest.approx(CHINCHILLA[k], abs=0.015), (k, np.mean(estimates[k]))


def test_isoflop_fit_recovers_the_optimal_exponents():
    """Under C = 6ND the law's N_opt grows as C^(beta/(alpha+beta)) = C^0.452: recovered within 0.02
    from the parabolas' minima (1% noise); each minimum within 25% of the law's."""
    iso = F.isoflop(synthetic(CHINCHILLA))
    a, b = CHINCHILLA["alpha"], CHINCHILLA["beta"]
    assert iso["params_law"]["exponent"] == pytest.approx(b / (a + b), abs=0.02)
    assert iso["tokens_law"]["exponent"] == pytest.approx(a / (a + b), abs=0.02)
    for m in iso["minima"]:
        assert m["inside"] and m["params"] == pytest.approx(F.optimum(CHINCHILLA, m["budget"])["params"], rel=0.25)


def test_isoflop_minima_outside_the_trained_sizes_are_left_out_of_the_power_laws(tmp_path, capsys, caplog):
    """A budget whose sizes all lie below its optimum: its parabola's vertex is an extrapolation past
    the largest size trained. It is reported, marked, and left out of N_opt(C) and D_opt(C), which go
    through the other budgets' minima only (fitted again here)."""
    points = synthetic(CHINCHILLA, budgets=(1e18, 1e19, 1e20), sizes=5)
    c = 3e19
    n_opt = F.optimum(CHINCHILLA, c)["params"]
    for f in np.geomspace(1 / 64, 1 / 4, 5):
        n = n_opt * f
        points.append(F.Point(n, c / (6 * n), F.predict(CHINCHILLA, n, c / (6 * n)), c, f"low/{n:.3g}"))
    minima = {}  # budget -> (N at the vertex, inside the sizes)
    for budget in (1e18, 1e19, 3e19, 1e20):
        x = np.log([p.params for p in points if p.budget == budget])
        a, b, _ = np.polyfit(x, [p.loss for p in points if p.budget == budget], 2)
        minima[budget] = (math.exp(-b / (2 * a)), x.min() <= -b / (2 * a) <= x.max())
    assert [inside for _, inside in minima.values()] == [True, True, False, True]
    iso = F.isoflop(points)
    assert [(m["budget"], m["inside"]) for m in iso["minima"]] == [(b, i) for b, (_, i) in minima.items()]
    assert iso["minima"][2]["params"] == pytest.approx(minima[3e19][0], rel=1e-9)
    good = [b for b, (_, inside) in minima.items() if inside]
    want = np.polyfit(np.log(good), np.log([minima[b][0] for b in good]), 1)[0]
    assert iso["params_law"]["exponent"] == pytest.approx(want, rel=1e-9)
    every = np.polyfit(np.log(list(minima)), np.log([n for n, _ in minima.values()]), 1)[0]
    assert abs(every - want) > 0.02  # (with the extrapolated vertex the law would be another)
    want_d = np.polyfit(np.log(good), np.log([b / (6 * minima[b][0]) for b in good]), 1)[0]
    assert iso["tokens_law"]["exponent"] == pytest.approx(want_d, rel=1e-9)
    path = _write_csv(tmp_path / "points.csv", points)
    assert main(["scaling", "fit", str(path), "--bootstrap", "0"]) == 0
    assert f"| 3e+19 | {minima[3e19][0]:.4g} (outside the sizes trained) |" in capsys.readouterr().out
    assert f"budget 3e+19: the fitted minimum N={minima[3e19][0]:.3g} lies outside the sizes trained" in caplog.text


def _write_csv(path, points, columns=("params", "tokens", "loss", "budget")):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for p in points:
            w.writerow([getattr(p, c) for c in columns])
    return path


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("pretrain: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_fit_from_csv_prints_the_recommendation_and_writes_json(tmp_path, capsys):
    path = _write_csv(tmp_path / "points.csv", synthetic(CHINCHILLA, noise=0.005))
    assert main(["scaling", "fit", str(path), "--budget", "1e21", "--bootstrap", "20",
                 "--json", str(tmp_path / "fit.json")]) == 0
    out = json.loads((tmp_path / "fit.json").read_text())
    assert set(out["law"]) == {"E", "A", "B", "alpha", "beta"}
    assert set(out["optimum"]) >= {"budget", "params", "tokens", "loss"} and out["optimum"]["budget"] == 1e21
    assert "N* = " in capsys.readouterr().out


@pytest.mark.parametrize("case,message", [
    ("nan", "has loss nan"),
    ("nan_tokens", "tokens=nan: both must be finite and > 0"),
    ("inf_params", "params=inf"),
    ("no_tokens_column", "lacks the column(s) tokens"),
    ("negative_budget", "--budget=-1e+21: give a positive, finite number"),
    ("nan_budget", "--budget=nan: give a positive, finite number"),
])
def test_bad_fit_inputs_are_one_line(tmp_path, capsys, case, message):
    points = synthetic(CHINCHILLA, budgets=(1e18, 1e19), sizes=5)
    if case == "nan":
        points[3].loss = float("nan")
    if case == "nan_tokens":
        points[3].tokens = float("nan")
    if case == "inf_params":
        points[3].params = float("inf")
    columns = ("params", "loss", "budget") if case == "no_tokens_column" else ("params", "tokens", "loss", "budget")
    path = _write_csv(tmp_path / "points.csv", points, columns)
    extra = {"negative_budget": ["--budget=-1e21"], "nan_budget": ["--budget=nan"]}.get(case, [])
    assert main(["scaling", "fit", str(path), "--bootstrap", "0", *extra]) == 2
    assert message in _one_error(capsys)


def test_a_budget_with_two_sizes_leaves_the_parametric_fit(tmp_path, capsys, caplog):
    """An IsoFLOP parabola needs 3 sizes: a budget with 2 is left out, warned; the other budgets'
    parabolas and the parametric law go on (the whole fit used to stop)."""
    points = synthetic(CHINCHILLA, budgets=(1e18, 1e19, 1e20), sizes=5)
    points = [p for p in points if p.budget != 1e18] + [p for p in points if p.budget == 1e18][:2]
    path = _write_csv(tmp_path / "points.csv", points)
    assert main(["scaling", "fit", str(path), "--bootstrap", "0", "--budget", "1e21"]) == 0
    out = capsys.readouterr().out
    assert "N* = " in out and "| 1e+19 |" in out and "| 1e+20 |" in out
    assert "budget 1e+18 has 2 model size(s): an IsoFLOP parabola needs at least 3; left out" in caplog.text


def test_a_point_without_a_budget_keeps_the_isoflop_fit(tmp_path, capsys):
    """Points without a budget are grouped by 6ND (docs/scaling.md): one such row among budgeted ones
    turned the IsoFLOP fit off for every point."""
    points = synthetic(CHINCHILLA, budgets=(1e18, 1e19, 1e20), sizes=5)
    points[0].budget = 0.0
    path = _write_csv(tmp_path / "points.csv", points)
    out = tmp_path / "fit.json"
    assert main(["scaling", "fit", str(path), "--bootstrap", "0", "--json", str(out)]) == 0
    iso = json.loads(out.read_text())["isoflop"]
    assert iso is not None and len(iso["minima"]) == 3 and "params_law" in iso


def test_a_law_that_does_not_hold_is_said_and_still_written(tmp_path, capsys):
    """Loss curves that open downwards at every budget: no law of this form fits them (beta comes
    out 1.16). The fit is shown and written, marked as not holding, with no N*/D* and exit 2 (it
    used to recommend)."""
    points = synthetic(CHINCHILLA, budgets=(1e18, 1e19, 1e20), sizes=5)
    for p in points:
        p.loss = 3.0 - 0.05 * math.log(p.params / 1e6) ** 2 / 10
    path = _write_csv(tmp_path / "points.csv", points)
    out = tmp_path / "fit.json"
    assert main(["scaling", "fit", str(path), "--bootstrap", "0", "--json", str(out)]) == 2
    assert "the law does not hold for these points" in _one_error(capsys)
    written = json.loads(out.read_text())
    assert written["holds"] is False and written["optimum"] is None and written["problems"]
    assert set(written["law"]) == {"E", "A", "B", "alpha", "beta"}


def test_fitting_an_unfinished_sweep_is_one_line(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["scaling", "plan", str(SCALING_TINY), "--budgets", "1e10,2e10", "--sizes", "3", "--out", str(out)]) == 0
    assert main(["scaling", "fit", str(out)]) == 2  # planned, never run
    line = _one_error(capsys)
    assert "6 run(s) unfinished" in line and f"pretrain scaling run {out}" in line


def test_a_budget_too_small_for_the_smallest_model_is_one_line(tmp_path, capsys):
    assert main(["scaling", "plan", str(TINY), "--budgets", "1e3", "--out", str(tmp_path / "s")]) == 2
    assert "too small for a model of" in _one_error(capsys)
    assert main(["scaling", "plan", str(TINY), "--budgets", "1e15", "--sizes", "2", "--out", str(tmp_path / "s")]) == 2
    assert "give 3 to 15 model sizes" in _one_error(capsys)


def test_plan_writes_configs_and_a_manifest_the_trainer_accepts(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["scaling", "plan", str(TINY), "--budgets", "3e13,1e14", "--sizes", "5", "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "manifest.csv")))
    assert {"name", "budget", "params", "tokens", "flops", "config"} <= set(rows[0])
    base = load_config(TINY).model
    for r in rows:
        assert r["config"] == f"configs/{r['run']}.yaml"  # relative: a copied sweep is whole
        cfg = load_config(out / r["config"])  # usable with pretrain train / config show
        assert cfg.train.run_dir == str(out / "runs" / r["run"]) and cfg.checkpoint.every_minutes == 5
        per_step = cfg.global_batch(1) * cfg.data.seq_len
        assert int(r["tokens"]) == cfg.train.max_steps * per_step
        assert cfg.scaling.sweep == "sweep" and cfg.logging.group == "sweep"
        m = cfg.model  # the family keeps the base's head size and GQA ratio
        assert m.dim // m.n_heads == base.dim // base.n_heads
        assert m.n_heads // m.kv_heads == base.n_heads // base.kv_heads
        # N counted on the model itself (not with the planner's arithmetic): every parameter but the
        # embedding lookup, the LM head counted when tied; C per token 6N + 12 L H Q T (PaLM).
        with torch.device("meta"):
            total = sum(p.numel() for p in Transformer(m).parameters())
        n = total - (0 if m.tie_embeddings else m.vocab_size * m.dim)
        fpt = 6 * n + 12 * m.n_layers * m.n_heads * (m.dim // m.n_heads) * cfg.data.seq_len
        assert int(r["params"]) == n
        assert float(r["flops"]) == pytest.approx(cfg.train.max_steps * per_step * fpt, rel=1e-12)
        assert abs(float(r["flops"]) - float(r["budget"])) <= 0.5 * per_step * fpt  # within half a step
    for c in ("3e+13", "1e+14"):
        assert len({r["params"] for r in rows if r["budget"] == str(float(c))}) >= 3
    assert "| name | budget |" in capsys.readouterr().out


# ------------------------------------------------------------------------------- end to end
SMALL = ["data.seq_len=64", "train.micro_batch_size=8", "train.global_batch_size=8", "logging.wandb=disabled",
         "logging.log_every=5", "train.eval_batches=2", "schedule.warmup_steps=5", "optimizer.lr=3e-3"]


@pytest.mark.slow
def test_wsd_s_branches_match_separate_runs(tmp_path):
    """One WSD-S run of 40 steps with a branch ending at step 20 against two separate WSD runs of
    20 and 40 steps: the branch's eval loss equals the 20-step run's, and the run's own end the
    40-step run's (the stable phase continues from the checkpoint before the branch): within 1e-5."""
    wsd = SMALL + ["schedule.kind=wsd", "schedule.decay_fraction=0.3"]
    run_train(wsd + ["train.max_steps=40", "schedule.decay_points=[20]", f"train.run_dir={tmp_path / 's'}"])
    run_train(wsd + ["train.max_steps=20", f"train.run_dir={tmp_path / 'a'}"])
    run_train(wsd + ["train.max_steps=40", f"train.run_dir={tmp_path / 'b'}"])
    [branch] = [r for r in read_metrics(tmp_path / "s") if "branch/eval_loss" in r]
    assert branch["branch/end_step"] == 20 and branch["step"] == 20 - round(0.3 * 20)
    final = lambda run: [r["eval/loss"] for r in read_metrics(run) if "eval/loss" in r][-1]  # noqa: E731
    assert branch["branch/eval_loss"] == pytest.approx(final(tmp_path / "a"), rel=1e-5)
    assert final(tmp_path / "s") == pytest.approx(final(tmp_path / "b"), rel=1e-5)


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory):
    """3 budgets x 4 sizes of tiny models on the built-in data, WSD-S (one run per size, a decay
    branch per budget), planned and run through the CLI; shared by the tests that read a trained
    sweep (each copies it before changing anything)."""
    sweep = tmp_path_factory.mktemp("tiny") / "sweep"
    overrides = ["data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=8", "logging.progress=false"]
    assert main(["scaling", "plan", str(SCALING_TINY), *overrides, "--budgets", "5e9,1e10,2e10", "--sizes", "4",
                 "--span", "6", "--schedule", "wsd-s", "--out", str(sweep)]) == 0
    assert main(["scaling", "run", str(sweep)]) == 0
    return sweep


def _copy(sweep, to):
    import shutil

    shutil.copytree(sweep, to)
    return to


@pytest.mark.slow
def test_a_tiny_sweep_is_planned_run_fitted_and_plotted(tiny_sweep, tmp_path, capsys):
    sweep = tiny_sweep
    rows = list(csv.DictReader(open(sweep / "manifest.csv")))
    assert len({r["budget"] for r in rows}) == 3 and all(
        len({r["params"] for r in rows if r["budget"] == b}) >= 4 for b in {r["budget"] for r in rows})
    capsys.readouterr()
    before = {m: m.read_bytes() for m in sweep.glob("runs/*/metrics.jsonl")}
    assert main(["scaling", "run", str(sweep)]) == 0  # everything finished: skipped, nothing trained
    assert capsys.readouterr().out.count("finished, skipped") == len({r["run"] for r in rows})
    assert {m: m.read_bytes() for m in sweep.glob("runs/*/metrics.jsonl")} == before
    assert main(["scaling", "fit", str(sweep), "--budget", "1e12", "--bootstrap", "20",
                 "--json", str(tmp_path / "fit.json")]) == 0
    out = json.loads((tmp_path / "fit.json").read_text())
    assert out["holds"] and len(out["points"]) == len(rows) and len(out["isoflop"]["minima"]) == 3
    law = out["law"]
    assert 0 < law["alpha"] < 1 and 0 < law["beta"] < 1
    # The recommendation is the law's own optimum under C = 6 N D.
    assert 6 * out["optimum"]["params"] * out["optimum"]["tokens"] == pytest.approx(1e12, rel=1e-9)
    assert main(["scaling", "plot", str(sweep), "--out", str(tmp_path / "plots"), "--budget", "1e12"]) == 0
    for name in ("isoflop", "loss_vs_compute", "optimal_n_d", "residuals"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 10_000


@pytest.mark.slow
def test_run_dirs_give_the_points_of_their_sweep(tiny_sweep, tmp_path):
    """Run dirs as inputs keep their planned budgets (their spent FLOPs made every point a budget of
    its own, and the IsoFLOP fit failed); given with their sweep dir, each point counts once."""
    def points(*inputs):
        assert main(["scaling", "fit", *map(str, inputs), "--bootstrap", "0", "--json", str(tmp_path / "f.json")]) == 0
        fit = json.loads((tmp_path / "f.json").read_text())
        return sorted((p["params"], p["tokens"], p["loss"], p["budget"]) for p in fit["points"]), fit["isoflop"]

    runs = sorted((tiny_sweep / "runs").iterdir())
    from_sweep, iso = points(tiny_sweep)
    from_runs, iso_runs = points(*runs)
    assert from_runs == from_sweep
    assert [m["budget"] for m in iso_runs["minima"]] == [m["budget"] for m in iso["minima"]] == [5e9, 1e10, 2e10]
    for got, want in zip(iso_runs["minima"], iso["minima"]):  # (the same points in another order)
        assert got["parabola"] == pytest.approx(want["parabola"], rel=1e-9)
    assert points(tiny_sweep, *runs[:2])[0] == from_sweep


@pytest.mark.slow
def test_a_copied_sweep_is_its_own_and_a_run_of_another_plan_is_refused(tiny_sweep, tmp_path, capsys):
    """cp -r gives a sweep that trains into its own runs/ (it trained into the original); a run
    trained under another config than its planned one is refused by run and fit, naming the field."""
    copy = _copy(tiny_sweep, tmp_path / "copy")
    from pretrain.scaling.run import config_of, planned_runs

    first = planned_runs(copy)[0]
    assert load_config(first["config"]).train.run_dir == str(copy / "runs" / first["run"])
    shutil_config = copy / "configs" / f"{first['run']}.yaml"
    text = shutil_config.read_text()
    lr = load_config(shutil_config).optimizer.lr
    shutil_config.write_text(text.replace(f"lr: {lr}", f"lr: {lr / 2}"))  # the run was trained at lr
    for argv in (["scaling", "run", str(copy)], ["scaling", "fit", str(copy), "--bootstrap", "0"]):
        assert main(argv) == 2
        line = _one_error(capsys)
        assert "1 run(s) were trained under another config than the one planned" in line
        assert f"optimizer.lr: {lr} -> {lr / 2}" in line and first["run"] in line
    assert main(["scaling", "run", str(copy), "--config-of", "0"]) == 2  # (the Slurm array task's question)
    shutil_config.write_text(text)
    assert config_of(str(copy), 0) == ""  # finished, in the copy


@pytest.mark.slow
def test_a_sweep_run_without_eval_losses_names_the_cause(tiny_sweep, tmp_path, capsys):
    """A run that trained to its end without held-out data (a config edited by hand: plan refuses
    such a base) makes fit say so, instead of 'unfinished, run it' while run says all finished."""
    import yaml

    copy = _copy(tiny_sweep, tmp_path / "copy")
    run = sorted((copy / "runs").iterdir())[0]
    config = copy / "configs" / f"{run.name}.yaml"
    for path in (config, *run.glob("checkpoints/step_*/config.yaml")):
        d = yaml.safe_load(path.read_text())
        d["data"]["validation"] = []
        path.write_text(yaml.safe_dump(d, sort_keys=False))
    records = [r for r in read_metrics(run) if "eval/loss" not in r and "branch/eval_loss" not in r]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["scaling", "fit", str(copy), "--bootstrap", "0"]) == 2
    assert f"{run.name} ran to its end but has no eval loss: its config has no data.validation" in _one_error(capsys)


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_after_saving_and_the_rerun_resumes(tmp_path):
    """SIGINT to the sweep's process group (Ctrl-C): the training run saves, the sweep stops with 75
    (it exited 130 and saved nothing); run again, it resumes and finishes."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from helpers import train_env

    sweep = tmp_path / "sweep"
    assert main(["scaling", "plan", str(SCALING_TINY), "data.seq_len=32", "train.global_batch_size=4",
                 "train.micro_batch_size=4", "logging.progress=false", "logging.log_every=1", "train.eval_batches=1",
                 "--budgets", "2e9", "--sizes", "3", "--span", "4", "--out", str(sweep)]) == 0
    proc = subprocess.Popen([sys.executable, "-m", "pretrain", "scaling", "run", str(sweep)], env=train_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while not any(m.read_text().count("\n") >= 3 for m in sweep.glob("runs/*/metrics.jsonl")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "was stopped by a signal (checkpoint saved)" in err
    [saved] = sweep.glob("runs/*/checkpoints/step_*")
    assert main(["scaling", "run", str(sweep)]) == 0
    resumed = saved.parent.parent
    steps = [r["step"] for r in read_metrics(resumed) if "train/loss" in r]
    assert steps == list(range(1, steps[-1] + 1)) and (resumed / "checkpoints" / f"step_{steps[-1]:08d}").is_dir()


@pytest.mark.parametrize("flags,message", [
    (["--budgets", "inf"], "--budgets: give one or more positive, finite FLOP budgets"),
    (["--budgets", "1e15", "--span", "0"], "--span 0.0: the largest / smallest size per budget must be a number > 1"),
    (["--budgets", "1e15", "--span", "nan"], "--span nan"),
    (["--budgets", "1e15", "--lr", "nan"], "--lr nan: give a positive learning rate"),
    (["--budgets", "1e15", "optimizer.lr=nan"], "optimizer.lr=nan: must be finite numbers"),
])
def test_bad_plan_numbers_are_one_line(tmp_path, capsys, flags, message):
    assert main(["scaling", "plan", str(REPO / "configs" / "scaling_tiny.yaml"), *flags,
                 "--out", str(tmp_path / "sweep")]) == 2
    assert message in _one_error(capsys)
    assert not (tmp_path / "sweep").exists()


def test_fit_json_into_a_missing_dir_is_one_line(tmp_path, capsys):
    path = _write_csv(tmp_path / "points.csv", synthetic(CHINCHILLA, budgets=(1e18, 1e19, 1e20), sizes=5))
    assert main(["scaling", "fit", str(path), "--bootstrap", "0", "--json", str(tmp_path / "no" / "fit.json")]) == 2
    assert "No such file or directory" in _one_error(capsys)


# ------------------------------------------------------------------------- the sweep dir
def _plan(out, *flags, config=SCALING_TINY):
    return main(["scaling", "plan", str(config), "--budgets", "1e10,2e10", "--sizes", "3", "--out", str(out), *flags])


def test_duplicate_budgets_are_merged_and_close_ones_refused(tmp_path, capsys, caplog):
    assert _plan(tmp_path / "a", "--budgets", "1e10,1e10,2e10") == 0
    names = [r["name"] for r in csv.DictReader(open(tmp_path / "a" / "manifest.csv"))]
    assert len(names) == len(set(names)) == 6 and "1e+10 given more than once: planned once" in caplog.text
    capsys.readouterr()
    for schedule in ("cosine", "wsd-s"):  # wsd-s failed on "schedule.decay_points=[9, 9] must be increasing"
        assert _plan(tmp_path / "b", "--budgets", "1e10,1.001e10", "--schedule", schedule) == 2
        assert "are too close: both give the model of" in _one_error(capsys)
        assert not (tmp_path / "b").exists()  # refused before anything is written


def test_plan_scales_the_learning_rate_by_the_square_root_of_the_width(tmp_path):
    """Each size's LR is the base config's optimizer.lr x sqrt(base dim / dim) (wider models take
    smaller steps); --lr gives every run the same rate."""
    base = load_config(SCALING_TINY)
    assert _plan(tmp_path / "a", "--budgets", "1e10,1e12", "--sizes", "5", "optimizer.lr=0.004") == 0
    runs = {r["run"]: r for r in csv.DictReader(open(tmp_path / "a" / "manifest.csv"))}
    dims = set()
    for r in runs.values():
        cfg = load_config(tmp_path / "a" / r["config"])
        assert cfg.model.dim == int(r["dim"])
        assert cfg.optimizer.lr == pytest.approx(0.004 * math.sqrt(base.model.dim / cfg.model.dim), rel=1e-12)
        dims.add(cfg.model.dim)
    assert len(dims) >= 3 and min(dims) < base.model.dim < max(dims)  # narrower and wider than the base
    assert _plan(tmp_path / "b", "--lr", "0.002") == 0
    for r in csv.DictReader(open(tmp_path / "b" / "manifest.csv")):
        assert load_config(tmp_path / "b" / r["config"]).optimizer.lr == 0.002


def test_a_base_without_validation_data_is_refused_at_plan_time(tmp_path, capsys):
    assert _plan(tmp_path / "a", "data.validation=[]") == 2
    assert "the base config has no data.validation" in _one_error(capsys)
    assert not (tmp_path / "a").exists()


def test_replanning_a_dir_with_runs_is_refused_unless_replaced(tmp_path, capsys, caplog):
    """The same plan again is harmless; another plan over trained runs is refused naming what
    changed (it resumed the old runs under the new plan), and --replace moves them aside."""
    out = tmp_path / "sweep"
    assert _plan(out) == 0
    (out / "runs" / "c1e10-n1").mkdir(parents=True)  # (a run that trained)
    assert _plan(out, "train.micro_batch_size=4") == 0  # incidental: the same plan
    capsys.readouterr()
    assert _plan(out, "--lr", "0.001") == 2
    line = _one_error(capsys)
    assert "holds a sweep planned differently (lr: 0.0 -> 0.001)" in line and "--replace" in line
    assert _plan(out, "--lr", "0.001", "--replace") == 0
    [aside] = (out / "replaced").iterdir()
    assert (aside / "runs" / "c1e10-n1").is_dir() and (aside / "manifest.csv").is_file() and not (out / "runs").exists()
    assert json.loads((out / "plan.json").read_text())["inputs"]["lr"] == 0.001
    assert "moved to" in caplog.text


def test_unwritable_outputs_are_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert _plan(tmp_path / "file" / "sweep") == 2
    assert "--out" in _one_error(capsys)
    path = _write_csv(tmp_path / "points.csv", synthetic(CHINCHILLA, budgets=(1e18, 1e19, 1e20), sizes=5))
    assert main(["scaling", "plot", str(path), "--out", str(tmp_path / "file")]) == 2
    assert "--out" in _one_error(capsys)


@pytest.mark.slow
def test_scaling_run_nproc_trains_on_that_many_ranks_and_failed_runs_exit_2(tmp_path, capfd):
    """`scaling run --nproc 2` trains a run under torchrun with 2 ranks; a sweep whose runs fail goes
    on with the others, then names the failed ones in one line and exits 2 (finished runs skipped)."""
    from pretrain.checkpoint.layout import read_meta
    from pretrain.scaling.run import planned_runs

    sweep = tmp_path / "sweep"
    assert main(["scaling", "plan", str(SCALING_TINY), "data.seq_len=32", "train.global_batch_size=4",
                 "train.micro_batch_size=2", "logging.progress=false", "train.eval_batches=1", "--budgets", "1e9",
                 "--sizes", "3", "--span", "4", "--out", str(sweep)]) == 0
    runs = planned_runs(sweep)
    assert len(runs) == 3
    last = runs[2]
    assert main(["scaling", "run", str(sweep), "--index", "2", "--nproc", "2"]) == 0
    final = sweep / "runs" / last["run"] / "checkpoints" / f"step_{last['steps']:08d}"
    assert read_meta(final)["world_size"] == 2
    assert json.loads((final / "data_state.json").read_text())["consumed"] == last["steps"] * 4
    assert [r["step"] for r in read_metrics(sweep / "runs" / last["run"]) if "train/loss" in r][-1] == last["steps"]
    capfd.readouterr()
    for r in runs[:2]:  # a file where the run dir should be: each of these runs fails to start (exit 2)
        (sweep / "runs" / r["run"]).write_text("not a directory")
    assert main(["scaling", "run", str(sweep)]) == 2
    out, err = capfd.readouterr()
    assert f"[1/3] {runs[0]['run']}: training" in out and f"[2/3] {runs[1]['run']}: training" in out
    assert f"[3/3] {last['run']}: finished, skipped" in out
    lines = [x for x in err.splitlines() if x.startswith("pretrain: error: ")]
    assert lines[-1] == (f"pretrain: error: 2 run(s) failed: {runs[0]['run']} (exit 2), {runs[1]['run']} (exit 2); the "
                         f"others are done. Fix the cause, then run `pretrain scaling run {sweep}` again (finished "
                         "runs are skipped)")


@pytest.mark.slow
def test_a_signal_during_a_decay_branch_reruns_the_branch_on_resume(tmp_path):
    """SIGTERM in step 11, inside the WSD-S branch that decays from step 8 to 16: the run stops with
    the checkpoint of the branch's start (step 8) and exit 75; the resume runs the whole branch
    again, then the stable phase, and the run equals an uninterrupted one (every step, the branch's
    result, the final eval)."""
    import subprocess
    import sys

    from helpers import losses, train_env

    wsd = SMALL + ["logging.log_every=1", "schedule.kind=wsd", "schedule.decay_fraction=0.5", "train.max_steps=24",
                   "schedule.decay_points=[16]", "train.eval_batches=1"]
    run_train(wsd + [f"train.run_dir={tmp_path / 'straight'}"])
    run = tmp_path / "stopped"
    proc = subprocess.run([sys.executable, "-m", "pretrain", "train", str(TINY), "logging.progress=false", *wsd,
                           f"train.run_dir={run}"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=train_env({"PRETRAIN_FAULT": "signal@step=11,signum=15"}), start_new_session=True)
    assert proc.returncode == 75, proc.stderr[-3000:]
    assert "decay branch to step 16 (schedule.decay_points), then back here" in proc.stdout
    assert "received SIGTERM: saved step 8; exiting with 75" in proc.stdout
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000008"]
    assert not [r for r in read_metrics(run) if "branch/end_step" in r]  # the branch never finished
    run_train(wsd + [f"train.run_dir={run}", "checkpoint.resume=auto"])
    straight = tmp_path / "straight"
    assert losses(run) == losses(straight) and sorted(losses(run)) == list(range(1, 25))
    [branch] = [r for r in read_metrics(run) if "branch/end_step" in r]
    [want] = [r for r in read_metrics(straight) if "branch/end_step" in r]
    assert branch == want and branch["step"] == 8 and "branch/eval_loss" in branch
    final = [[r["eval/loss"] for r in read_metrics(d) if "eval/loss" in r] for d in (run, straight)]
    assert final[0] == final[1] and len(final[0]) == 1


def test_only_the_ends_of_a_run_and_its_decay_branches_are_points(tmp_path):
    """A WSD-S run (decay branch ending at step 4, run end 8) evaluated every 2 steps: its mid-run
    evaluations (steps 2, 4, 6: before the rate decayed) are not points, and the one at step 4,
    logged after the branch that ends there, does not replace the branch's (annealed) value.
    The old rule took every evaluation: points at steps 2, 4 (the mid-run value), 6, 8."""
    from pretrain.model.model import matmul_params
    from pretrain.scaling import ladder, results

    cfg = load_config(TINY, ["model.vocab_size=4096", "schedule.kind=wsd", "schedule.warmup_steps=1",
                             "train.max_steps=8", "schedule.decay_points=[4]", "train.eval_every=2",
                             "train.eval_tasks=[mine.jsonl]"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    mid = lambda step, v: {"step": step, "eval/loss": v, "eval/mine/acc": v / 10, "eval/mine/bpb": v}  # noqa: E731
    records = [mid(2, 5.0), {"step": 2, "branch/end_step": 4, "branch/eval_loss": 3.0, "branch/mine/acc": 0.3,
                             "branch/mine/bpb": 3.0}, mid(4, 4.0), mid(6, 3.5), mid(8, 2.0)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokens = cfg.global_batch(1) * cfg.data.seq_len
    assert [(p.tokens, p.loss) for p in results.from_run(run)] == [(4 * tokens, 3.0), (8 * tokens, 2.0)]
    assert results.run_losses(run, 8) == {4: 3.0, 8: 2.0}
    points = ladder.collect([str(run)], "mine/acc")
    n = matmul_params(cfg.model)
    assert [(p.params, p.tokens, p.bpb, p.value) for p in points] == [(n, 4 * tokens, 3.0, 0.3), (n, 8 * tokens, 2.0, 0.2)]


def test_a_decay_branch_that_dropped_updates_is_refused_by_the_fit(tmp_path, capsys):
    """A branch to step 4 that dropped 1 of its updates (branch/dropped_steps: a spike not rolled back)
    is not a run of 4 steps: `pretrain scaling fit` refuses it in one line, naming the branch; the
    same run with the branch whole gives its 2 points. The old reader took it as a point."""
    from pretrain.scaling import results

    cfg = load_config(TINY, ["model.vocab_size=4096", "schedule.kind=wsd", "schedule.warmup_steps=1",
                             "train.max_steps=8", "schedule.decay_points=[4]"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    for dropped in (0, 1):
        records = [{"step": 2, "branch/end_step": 4, "branch/eval_loss": 3.0, "branch/dropped_steps": dropped},
                   {"step": 8, "eval/loss": 2.0}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        if not dropped:
            assert [p.loss for p in results.from_run(run)] == [3.0, 2.0]
    assert main(["scaling", "fit", str(run)]) == 2
    assert f"{run}: its decay branch to step 4 dropped 1 of its updates" in _one_error(capsys)
