"""`pretrain scaling compare`: on points of two known laws, where B at D tokens is exactly A at k D
(so B is worth k times A's compute, at every size and on the compute-optimal frontier), the
multiplier comes out k, its interval holds k, points are matched by (N, D); bad inputs are one line.
No training."""

import csv
import json
import math

import numpy as np
import pytest

from pretrain.cli import main
from pretrain.scaling import compare as C, fit as F

LAW_A = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}  # Chinchilla's (Hoffmann et al. eq. 10)
K = 2.0
LAW_B = {**LAW_A, "B": LAW_A["B"] / K ** LAW_A["beta"]}  # L_B(N, D) = L_A(N, K D)


def _points(law, budgets=(1e18, 3e18, 1e19, 3e19, 1e20), sizes=6, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for c in budgets:
        n_opt = F.optimum(LAW_A, c)["params"]  # (the same grid for both laws: one plan)
        for f in np.geomspace(1 / 6, 6, sizes):
            n = round(n_opt * f)
            d = round(c / (6 * n))
            out.append(F.Point(n, d, F.predict(law, n, d) * math.exp(rng.normal(0, noise)), c, f"{c:g}/{n}"))
    return out


def _csv(path, points):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["params", "tokens", "loss", "budget", "name"])
        for p in points:
            w.writerow([p.params, p.tokens, p.loss, p.budget, p.name])
    return str(path)


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("pretrain: error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_the_multiplier_of_a_known_law_is_recovered():
    a, b = _points(LAW_A), _points(LAW_B)
    assert all(C.multiplier(LAW_A, p.tokens, p.loss, q.loss) == pytest.approx(K, rel=1e-9) for p, q in zip(a, b))
    assert C.optimal_multiplier(LAW_A, LAW_B, 1e21) == pytest.approx(K, rel=1e-9)
    assert C.multiplier(LAW_A, 1e9, 3.0, 3.0) == pytest.approx(1) and C.multiplier(LAW_A, 1e9, 3.5, 3.0) > 1
    assert C.multiplier(LAW_A, 1e9, 3.0, 1.0) == math.inf  # more than A's D-term has left: never reached


def test_compare_recovers_k_with_an_interval_that_holds_it(tmp_path, capsys):
    # A's points noisy, B's exact (each row's multiplier carries A's point's noise, its interval the law's).
    a = _csv(tmp_path / "a.csv", _points(LAW_A, noise=0.002, seed=2))
    b = _csv(tmp_path / "b.csv", _points(LAW_B))
    out = tmp_path / "cmp.json"
    assert main(["scaling", "compare", a, b, "--budget", "1e21", "--bootstrap", "30", "--json", str(out),
                 "--out", str(tmp_path / "plots")]) == 0
    r = json.loads(out.read_text())
    assert len(r["rows"]) == 30
    g, o = r["geometric_mean"], r["optimal"]
    assert g["multiplier"] == pytest.approx(K, rel=0.05) and g["interval"][0] <= K <= g["interval"][1]
    assert g["interval"][1] / g["interval"][0] < 1.5
    assert o["budget"] == 1e21 and o["multiplier"] == pytest.approx(K, rel=0.3)
    assert o["interval"][0] <= K <= o["interval"][1]
    assert all(x["multiplier"] == pytest.approx(K, rel=0.15) for x in r["rows"])
    assert all(x["difference"] < 0.02 for x in r["rows"])  # B is better, up to A's noise
    text = capsys.readouterr().out
    assert "| N | D | C = 6ND | a loss | b loss | b - a |" in text and "geometric mean" in text
    assert (tmp_path / "plots" / "compare.png").stat().st_size > 10_000


def test_points_are_matched_by_size_and_tokens(tmp_path, caplog):
    a = _points(LAW_A)
    b = _points(LAW_B, budgets=(3e18, 1e19, 3e19, 1e20, 3e20))[::-1]  # other budgets, shuffled
    r = C.compare(_csv(tmp_path / "a.csv", a), _csv(tmp_path / "b.csv", b), bootstrap=0)
    common = {(p.params, p.tokens) for p in a} & {(p.params, p.tokens) for p in b}
    assert len(common) == 24 and {(x["params"], x["tokens"]) for x in r["rows"]} == common
    by = {(p.params, p.tokens): p.loss for p in a}
    for x in r["rows"]:
        assert x["loss_a"] == by[x["params"], x["tokens"]] and x["loss_b"] < x["loss_a"]
        assert x["multiplier"] == pytest.approx(K, rel=1e-3) and x["interval"] is None
    assert "12 point(s) without a partner" in caplog.text
    assert r["optimal"]["budget"] == 3e20  # (default: the largest budget)


def test_by_law_sets_points_of_other_sizes_against_a_law(tmp_path, capsys):
    """--by-law: B's points 2% larger in N than A's (an MoE family's routers) have no partner of the
    same N and D; each is set against A's law at its N and D (marked "(law)"), and the multiplier
    still comes out k, its interval holding it; without the flag the inputs are refused."""
    a = _csv(tmp_path / "a.csv", _points(LAW_A, noise=0.002, seed=2))
    b_points = [F.Point(round(p.params * 1.02), p.tokens, F.predict(LAW_B, round(p.params * 1.02), p.tokens),
                        p.budget, p.name) for p in _points(LAW_B)]
    b = _csv(tmp_path / "b.csv", b_points)
    assert main(["scaling", "compare", a, b, "--budget", "1e21", "--bootstrap", "30"]) == 2
    assert "no model size in common" in _one_error(capsys)
    out = tmp_path / "cmp.json"
    assert main(["scaling", "compare", a, b, "--by-law", "--budget", "1e21", "--bootstrap", "30",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert len(r["rows"]) == 30 and all(x["a_from_law"] for x in r["rows"])
    assert all(x["multiplier"] == pytest.approx(K, rel=0.1) for x in r["rows"])
    g = r["geometric_mean"]
    assert g["multiplier"] == pytest.approx(K, rel=0.05) and g["interval"][0] <= K <= g["interval"][1]
    text = capsys.readouterr().out
    assert "against a's law at its N and D" in text and "(law)" in text


@pytest.mark.parametrize("case,message", [
    ("not_a_sweep", "not a sweep dir (manifest.csv), a run dir (config.yaml) or a .csv"),
    ("no_common_size", "have no model size in common"),
    ("no_common_point", "share model sizes but no point of the same N and D"),
    ("bad_budget", "--budget=-1.0: give a positive, finite number"),
])
def test_bad_inputs_are_one_line(tmp_path, capsys, case, message):
    a = _csv(tmp_path / "a.csv", _points(LAW_A))
    other = _points(LAW_B)
    if case == "no_common_size":
        other = [F.Point(p.params * 1.1, p.tokens, p.loss, p.budget) for p in other]
    if case == "no_common_point":
        other = [F.Point(p.params, p.tokens * 1.1, p.loss, p.budget) for p in other]
    b = _csv(tmp_path / "b.csv", other)
    if case == "not_a_sweep":
        (tmp_path / "empty").mkdir()
        b = str(tmp_path / "empty")
    extra = ["--budget=-1"] if case == "bad_budget" else []
    assert main(["scaling", "compare", a, b, "--bootstrap", "0", *extra]) == 2
    assert message in _one_error(capsys)
