"""The path users run, emulated on CPU: 2 ranks, bf16 and fp32, ZeRO stage 3 and stage 0 (bf16 there:
DeepSpeed's bf16 optimizer), activation checkpointing on every block, compile (bf16, ZeRO-3), GQA,
1024-token sequences (past the positions that bf16 rounds). Real `pretrain train` / `pretrain eval`
processes."""

import json
import re
import shutil

import pytest

from helpers import USER_PATH, losses, pretrain, read_metrics, run_train

pytestmark = pytest.mark.slow

PATH = USER_PATH
SETUPS = {"bf16-z3": ["train.precision=bf16", "distributed.zero_stage=3"],
          "fp32-z3": ["train.precision=fp32", "distributed.zero_stage=3"],
          "bf16-z0": ["train.precision=bf16", "distributed.zero_stage=0"],
          "fp32-z0": ["train.precision=fp32", "distributed.zero_stage=0"],
          "bf16-z3-compiled": ["train.precision=bf16", "distributed.zero_stage=3", "train.compile=true"]}


# Downstream tasks scored by the final evaluation (3 instances of each format: an odd count over
# 2 ranks, so one rank repeats a forward to keep ZeRO-3's collective forwards even).
TASK_ROWS = [{"context": "The return statement", "choices": ["returns a value", "is a fish", "loops"], "gold": 0},
             {"contexts": ["A list is", "A string is"], "continuation": "a sequence of characters.", "gold": 1},
             {"context": "Import a", "continuation": " module"}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each setup trained 6 steps on 2 ranks (checkpoints at 3 and 6), tasks scored at the end."""
    root = tmp_path_factory.mktemp("user_path")
    (root / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TASK_ROWS))
    out = {}
    for name, setup in SETUPS.items():
        out[name] = root / name
        proc = run_train(PATH + setup + [f"train.eval_tasks=[{root / 'mine.jsonl'}]", f"train.run_dir={out[name]}"],
                         nproc=2)
        (root / f"{name}.stdout").write_text(proc.stdout)
    return out


@pytest.mark.parametrize("name", list(SETUPS))
def test_in_loop_tasks_and_the_compute_clock_on_the_users_path(runs, name):
    """Every setup (bf16 and fp32, ZeRO-3 and 0, activation checkpointing, compile, 2 ranks, 1024
    tokens) scores the tasks at its final eval and times each rank's compute (the straggler report)."""
    [final] = [r for r in read_metrics(runs[name]) if "eval/mine/acc" in r]
    assert final["step"] == 6 and 0 <= final["eval/mine/acc"] <= 1 and 0 < final["eval/mine/bpb"] < 20
    assert {"eval/mine/acc_norm", "eval/mine/prob", "eval/mine/loss"} <= set(final)
    train = [r for r in read_metrics(runs[name]) if "train/loss" in r]
    assert all(r["perf/straggler_ratio_compute"] >= 1.0 for r in train)  # (max over median of 2 positive times)


def test_bf16_zero3_in_loop_tasks_follow_fp32_and_pretrain_eval(runs, tmp_path):
    """The bf16 ZeRO-3 engine's task scores: within bf16's rounding of the fp32 run's, and of
    `pretrain eval --tasks` of its own final checkpoint (whole model, fp32 on the CPU)."""
    [bf16] = [r for r in read_metrics(runs["bf16-z3"]) if "eval/mine/bpb" in r]
    [fp32] = [r for r in read_metrics(runs["fp32-z3"]) if "eval/mine/bpb" in r]
    # (measured: 1.8553 against 1.8551 for fp32 and 1.8551 for the CLI; bf16 logits round at ~4e-3)
    assert bf16["eval/mine/bpb"] == pytest.approx(fp32["eval/mine/bpb"], rel=2e-3)
    out = tmp_path / "tasks.json"
    pretrain(["eval", str(runs["bf16-z3"]), "--tasks", str(runs["bf16-z3"].parent / "mine.jsonl"), "--json", str(out)])
    cli = json.loads(out.read_text())["tasks"]["mine"]["metrics"]
    assert bf16["eval/mine/bpb"] == pytest.approx(cli["bpb"], rel=2e-3)


def _final_eval(run) -> float:
    return [r["eval/loss"] for r in read_metrics(run) if "eval/loss" in r][-1]


@pytest.mark.parametrize("name", list(SETUPS))
def test_the_loss_falls(runs, name):
    a = losses(runs[name])
    assert sorted(a) == list(range(1, 7))
    assert a[6] < a[1] - 0.3, a


def test_compiled_trains_like_eager(runs):
    """train.compile under ZeRO-3 in bf16 (each block and the head compiled): eager's losses within
    1e-3, and graphs were compiled (dynamo's own count: a compile that compiled nothing would pass the
    first check). ZeRO-0 and fp32: tests/test_train.py."""
    compiled, eager = losses(runs["bf16-z3-compiled"]), losses(runs["bf16-z3"])
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], abs=1e-3), (step, compiled[step], eager[step])
    stdout = (runs["bf16-z3-compiled"].parent / "bf16-z3-compiled.stdout").read_text()
    graphs = re.search(r"train.compile: the first step \(compiling\) took .* s: (\d+) graphs compiled", stdout)
    assert graphs and int(graphs.group(1)) >= 1, stdout[-2000:]


@pytest.mark.parametrize("stage", ["z3", "z0"])
def test_bf16_follows_fp32(runs, stage):
    """bf16 weights and activations, fp32 gradient accumulation and reduction: within 0.005 nats of
    the fp32 run at every step (measured: 3.3e-4 at most)."""
    bf16, fp32 = losses(runs[f"bf16-{stage}"]), losses(runs[f"fp32-{stage}"])
    for step in fp32:
        assert abs(bf16[step] - fp32[step]) < 0.005, (step, bf16[step], fp32[step])
    assert bf16 != fp32  # it really ran in bf16


@pytest.mark.parametrize("name", ["bf16-z3", "bf16-z0"])
def test_resume_is_bitwise_at_the_same_precision_and_world_size(runs, name, tmp_path):
    """Steps 4-6 from the step-3 checkpoint, in new processes, equal the run that never stopped."""
    run = tmp_path / "run"
    shutil.copytree(runs[name] / "checkpoints" / "step_00000003", tmp_path / "step_00000003")
    run_train(PATH + SETUPS[name] + [f"train.run_dir={run}", f"checkpoint.resume={tmp_path / 'step_00000003'}"],
              nproc=2)
    resumed, straight = losses(run), losses(runs[name])
    assert sorted(resumed) == [4, 5, 6]
    assert {s: resumed[s] for s in resumed} == {s: straight[s] for s in resumed}


def test_bf16_zero3_resumes_on_one_rank(runs, tmp_path):
    """2 -> 1 rank through DeepSpeed's universal checkpoint, the same micro-batches accumulated on
    one rank instead of reduced over two (measured: equal losses; allowed: 1e-4)."""
    run = tmp_path / "run"
    shutil.copytree(runs["bf16-z3"] / "checkpoints" / "step_00000003", tmp_path / "step_00000003")
    run_train(PATH + SETUPS["bf16-z3"] + [f"train.run_dir={run}", f"checkpoint.resume={tmp_path / 'step_00000003'}"])
    resumed, straight = losses(run), losses(runs["bf16-z3"])
    assert sorted(resumed) == [4, 5, 6]
    for step in resumed:
        assert resumed[step] == pytest.approx(straight[step], abs=1e-4), (step, resumed[step], straight[step])


@pytest.mark.parametrize("name", ["fp32-z3", "bf16-z3"])
def test_eval_rebuilds_the_model_that_trained(runs, name, tmp_path):
    """`pretrain eval` builds a plain model from the checkpoint's weights (fp32, one process here):
    it must score the held-out batch as the engine did at the end of training (fp32: the same
    numbers; bf16: within bf16's rounding of activations)."""
    out = tmp_path / "eval.json"
    pretrain(["eval", str(runs[name]), "--batches", "1", "--micro-batch-size", "1", "--json", str(out)])
    got, trained = json.loads(out.read_text())["loss"], _final_eval(runs[name])
    assert got == pytest.approx(trained, rel=1e-5 if name.startswith("fp32") else 5e-3), (got, trained)
