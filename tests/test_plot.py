"""`pretrain plot RUN_DIR... --out DIR`: runs' curves from metrics.jsonl, without W&B."""

import json

import pytest

from pretrain.cli import main
from pretrain.plot import read_run, series


def _write(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def _train(step, loss, lr=1e-3):
    return {"step": step, "train/loss": loss, "train/lr": lr, "tokens_seen": 100 * step, "flops": 1e9 * step}


@pytest.fixture
def runs(tmp_path):
    """Run a, killed after logging step 6 and resumed from its step-4 checkpoint (steps 5-6 logged
    again, with other values: the resume's are the run's), and run b."""
    a = [_train(s, 10 - s) for s in range(1, 7)] + [_train(s, 9.5 - s) for s in range(5, 11)]
    a.insert(5, {"step": 5, "eval/loss": 5.5, "tokens_seen": 500, "flops": 5e9})
    a.append({"step": 10, "eval/loss": 1.0, "tokens_seen": 1000, "flops": 1e10})
    b = [_train(s, 8 - 0.5 * s) for s in range(1, 11)]
    return _write(tmp_path / "a", a), _write(tmp_path / "b", b)


def test_a_resumed_run_is_one_line_with_the_resumes_values(runs):
    name, records = read_run(str(runs[0]))
    assert name == "a"
    xs, ys = series(records, "train/loss", "step")
    assert xs == list(range(1, 11))
    assert ys == [9, 8, 7, 6] + [9.5 - s for s in range(5, 11)]
    assert series(records, "eval/loss", "tokens") == ([500, 1000], [5.5, 1.0])
    assert series(records, "train/loss", "flops")[0] == [1e9 * s for s in range(1, 11)]


def test_plot_writes_a_png_per_metric_with_the_runs_overlaid(runs, tmp_path, capsys):
    out = tmp_path / "plots"
    assert main(["plot", *map(str, runs), "--out", str(out)]) == 0
    # The defaults that were logged (no grad norm here), each a real PNG.
    assert sorted(p.name for p in out.iterdir()) == ["eval_loss.png", "train_loss.png", "train_lr.png"]
    for p in out.iterdir():
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
    assert capsys.readouterr().out.count("wrote ") == 3
    assert main(["plot", str(runs[0]), "--metrics", "train/loss", "--x", "tokens", "--out", str(out / "t")]) == 0
    assert [p.name for p in (out / "t").iterdir()] == ["train_loss.png"]


@pytest.mark.parametrize("case,message", [
    ("no_metrics", "no metrics.jsonl here: give a run dir"),
    ("unknown_metric", "--metrics: eval/acc in no run's metrics.jsonl; they have: eval/loss, train/loss, train/lr"),
    ("out_is_a_file", "--out"),
    ("bad_line", "metrics.jsonl:2: not a JSON line"),
])
def test_bad_input_is_one_line(runs, tmp_path, capsys, case, message):
    args = [str(runs[0]), "--out", str(tmp_path / "plots")]
    if case == "no_metrics":
        args[0] = str(tmp_path / "nothing")
    elif case == "unknown_metric":
        args += ["--metrics", "eval/acc"]
    elif case == "out_is_a_file":
        (tmp_path / "file").write_text("x")
        args[2] = str(tmp_path / "file")
    elif case == "bad_line":
        _write(tmp_path / "bad", [_train(1, 2.0)])
        with open(tmp_path / "bad" / "metrics.jsonl", "a") as f:
            f.write("garbage\n" + json.dumps(_train(2, 1.0)) + "\n")
        args[0] = str(tmp_path / "bad")
    assert main(["plot", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_last_line_cut_short_is_left_out(tmp_path):
    run = _write(tmp_path / "killed", [_train(1, 2.0), _train(2, 1.5)])
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/lo')
    assert series(read_run(str(run))[1], "train/loss", "step") == ([1, 2], [2.0, 1.5])
