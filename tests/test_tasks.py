"""Downstream tasks (pretrain/eval/tasks/): formats, the hub schemas, scoring equal to
lm-evaluation-harness (its HFLM on our export, over the same local files), `pretrain eval --tasks`
equal at 1 and 2 ranks, and bad input in one line."""

import json
import math
import os
import random
from pathlib import Path

import pytest

from helpers import free_port, run_train
from pretrain.cli import main
from pretrain.errors import UserError
from pretrain.eval.tasks import Instance, load, metrics
from pretrain.eval.tasks.scoring import encode_pair

# ------------------------------------------------------------------------- formats (fast tier)


def test_multiple_choice_metrics_as_lm_eval_defines_them():
    inst = Instance("multiple_choice", ["Q:"], [" a", " bbbb", " cc"], 1, ["a", "bbbb", "cc"])
    lls = [-2.0, -6.0, -3.5]
    m = metrics(inst, lls, [True, False, False])
    assert m["acc"] == 0.0  # argmax is choice 0
    assert m["acc_norm"] == 1.0  # per character: -2/1, -6/4 = -1.5, -3.5/2 = -1.75
    assert m["bpb"] == pytest.approx(6.0 / (math.log(2) * len(" bbbb")))
    assert m["prob"] == pytest.approx(math.exp(-6) / sum(math.exp(x) for x in lls))


def test_schema_and_cloze_metrics():
    schema = Instance("schema", ["The cup", "The bird"], [" fell."], 0, ["The cup", "The bird"])
    assert schema.requests() == [("The cup", " fell."), ("The bird", " fell.")]
    assert metrics(schema, [-3.0, -4.0], [False, False])["acc"] == 1.0
    cloze = Instance("cloze", ["It was a dark and stormy"], [" night"], 0, ["night"])
    m = metrics(cloze, [-1.5], [True])
    assert m == {"acc": 1.0, "loss": 1.5, "bpb": pytest.approx(1.5 / (math.log(2) * 6))}


def test_pairs_are_encoded_as_lm_eval_encodes_them():
    """Trailing spaces of the context move to the continuation; the continuation's tokens are the
    whole's past the context's; an empty context is the end-of-text token."""
    from data_pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin:python-docs-bpe")
    ctx, cont = encode_pair(tok, 0, "The value is ", "returned")
    assert ctx == tok.encode("The value is").ids and ctx + cont == tok.encode("The value is returned").ids
    assert encode_pair(tok, 0, "", " list") == ([0], tok.encode(" list").ids)


def test_an_empty_choice_is_scored_as_lm_eval_scores_it(tmp_path):
    """acc and acc_norm of lm-eval's own multiple-choice task (its process_results) on the same
    log-likelihoods, empty choices included: lm-eval divides an empty choice's ll by 0 (-inf, never
    chosen; nan, which argmax picks, for an ll of exactly 0). We gave it its raw ll (0.2 against 1.0
    in the issue's case)."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.task import ConfigurableTask

    (tmp_path / "mc.jsonl").write_text(json.dumps({"q": "Q:", "choices": ["a", "b"], "gold": 0}) + "\n")
    task = ConfigurableTask(config={
        "task": "mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(tmp_path / "mc.jsonl")}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{gold}}", "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]})
    rng = random.Random(0)
    cases = [(["abcd", "", "cc", "e"], [-2.0, -1.0, -3.5, -1.9]), (["abcd", "", "cc"], [-2.0, 0.0, -3.5])]
    for _ in range(200):
        k = rng.randint(2, 5)
        cases.append(([rng.choice(["", "x", "yy", "zzzz"]) for _ in range(k)],
                      [rng.choice([0.0, -round(rng.uniform(0, 8), 1)]) for _ in range(k)]))
    for choices, lls in cases:
        for gold in range(len(choices)):
            want = task.process_results({"q": "Q:", "choices": choices, "gold": gold}, [(ll, False) for ll in lls])
            got = metrics(Instance("multiple_choice", ["Q:"], [" " + c for c in choices], gold, choices), lls,
                          [False] * len(lls))
            assert (got["acc"], got["acc_norm"]) == (want["acc"], want["acc_norm"]), (choices, lls, gold)


def test_raw_line_separators_inside_json_strings_are_read(tmp_path):
    """JSON allows U+2028, U+2029 and U+0085 raw inside strings (json.dumps(..., ensure_ascii=False)
    writes them so); str.splitlines() split the line there ("not a JSON object")."""
    rows = [{"context": "one\u2028two", "choices": ["a\u0085b", "c"], "gold": 0},
            {"context": "x\u2029y", "continuation": " z"}]
    path = tmp_path / "sep.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    mc, cloze = load(str(path))[0]
    assert mc.contexts == ["one\u2028two"] and mc.choices == ["a\u0085b", "c"] and cloze.contexts == ["x\u2029y"]


@pytest.mark.parametrize("row,message", [
    ({"context": "Q:", "choices": "ab", "gold": 0}, "choices 'ab' is not a list"),
    ({"context": "Q:", "choices": ["a", "b"], "gold": True}, "gold True is not the index of a choice"),
    ({"context": "Q:", "choices": ["a", "b"], "gold": 1.7}, "gold 1.7 is not the index of a choice"),
    ({"context": "  \n", "choices": ["a", "b"], "gold": 0}, "the context '  \\n' is only whitespace"),
    ({"context": "It was", "continuation": ""}, "the continuation is empty"),
])
def test_bad_rows_of_a_plain_file_are_one_line(tmp_path, capsys, row, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"context": "Q:", "choices": ["a", "b"], "gold": 1}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError) as e:
        load(str(path))
    assert message in str(e.value) and "row 1" in str(e.value) and "\n" not in str(e.value).replace("\\n", ""), e.value


def test_a_bad_line_of_a_hub_schema_file_names_the_reason(tmp_path):
    path = tmp_path / "piqa.jsonl"
    path.write_text('{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}\n{"goal": "g",, "sol1": "a"}\n')
    with pytest.raises(UserError, match=r"could not read .*piqa.jsonl: JSON parse error: .* in row 1$"):
        load(f"piqa={path}")


def _tiny_model(tok):
    import torch

    from pretrain.model.args import ModelArgs
    from pretrain.model.model import Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=tok.get_vocab_size(), max_seq_len=64)).eval()


def test_requests_the_model_cannot_score_are_one_line_and_cut_contexts_are_warned_of(tmp_path, caplog):
    """A cloze continuation longer than the model's context is one line before any forward (it was
    an IndexError); a context cut from the left to fit (as lm-eval cuts it) is warned of."""
    import torch

    from data_pipeline.tokenizer import load_tokenizer
    from pretrain.eval.tasks import TaskSuite

    tok = load_tokenizer("builtin:python-docs-bpe")
    words = " the value of a list is returned by the function" * 4
    (tmp_path / "long.jsonl").write_text(json.dumps({"context": "It", "continuation": words}) + "\n")
    suite = TaskSuite([str(tmp_path / "long.jsonl")])
    with pytest.raises(UserError, match=r"task long, instance 0: the continuation .* is \d+ tokens, more than the "
                                        r"model's context of 16"):
        suite(lambda t: pytest.fail("no forward before the check"), torch.device("cpu"), tokenizer=tok, eot=0,
              max_len=16)
    (tmp_path / "cut.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"context": words, "continuation": " module"}, {"context": "Import a", "continuation": " module"}]))
    model = _tiny_model(tok)
    with caplog.at_level("WARNING"):
        r = TaskSuite([str(tmp_path / "cut.jsonl")])(model, torch.device("cpu"), tokenizer=tok, eot=0, max_len=16)["cut"]
    assert r["truncated"] == 1 and [i["truncated"] for i in r["instances"]] == [True, False]
    assert "cut: 1 of 2 instance(s) are longer than the model's context of 16 tokens" in caplog.text



def test_checking_thousands_of_requests_is_progress_the_hang_watchdog_sees(tmp_path):
    """Before any forward every request is encoded (the check above): 8,000 instances took over 4 s on
    a 2-core machine with no progress mark, and a run with resilience.hang_timeout_s=4 was killed as
    hung in its final evaluation. The check now reports progress every 64 instances."""
    import torch

    from data_pipeline.tokenizer import load_tokenizer
    from pretrain.eval.tasks import TaskSuite

    tok = load_tokenizer("builtin:python-docs-bpe")
    (tmp_path / "many.jsonl").write_text("".join(json.dumps({"context": f"Call {i} returns", "continuation": " a value"})
                                                 + "\n" for i in range(1000)))
    marks = []
    suite = TaskSuite([str(tmp_path / "many.jsonl")])
    suite.check(tok, 0, 64, progress=lambda: marks.append(1))
    assert len(marks) == 16  # (1000 / 64, rounded up)
    marks.clear()  # the evaluation passes it on to its check
    TaskSuite([str(tmp_path / "many.jsonl")])(lambda t: torch.zeros(*t.shape, tok.get_vocab_size()), torch.device("cpu"),
                                              progress=lambda: marks.append(1), tokenizer=tok, eot=0, max_len=64)
    assert len(marks) == 16


def test_few_shot_examples_come_from_every_row_never_the_instance_itself(tmp_path):
    """--limit 3 --fewshot 3 with 15 rows: the pool is the 15 rows (limit shrank it to 3 and refused
    "has 3 examples"); an instance never demonstrates itself; where the pool came from is said."""
    from pretrain.eval.tasks.scoring import fewshot_prefix

    rows = [{"context": f"Q{i}:", "choices": [f"a{i}", f"b{i}"], "gold": 0} for i in range(15)]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    instances, pool, where = load(str(path), limit=3, fewshot=3)
    assert len(instances) == 3 and len(pool) == 15 and where == f"{path}, the scored rows themselves: 15 examples"
    for i, inst in enumerate(instances):
        for seed in range(30):
            shots = fewshot_prefix(i, "mine", pool, 14, seed, exclude=inst)
            assert shots.count("Q") == 14 and f"Q{i}:" not in shots
    with pytest.raises(UserError, match="has 14 examples to draw from .* less the one scored"):
        load(str(path), fewshot=15)


def test_a_hub_task_whose_few_shot_split_fails_says_so(monkeypatch):
    """arc_easy's few-shot pool is its train split: when that fails to load, one line (it silently
    drew from the scored test split)."""
    import datasets

    row = {"id": "q", "question": "Why?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"}

    def fake(hub, config=None, split=None, **kw):
        if split == "train":
            raise ConnectionError("no network")
        return [dict(row, id=f"q{i}") for i in range(5)]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert len(load("arc_easy")[0]) == 5
    with pytest.raises(UserError, match=r"could not read allenai/ai2_arc \(train\) \(the few-shot pool of --fewshot 2; "
                                        r"--fewshot 0 needs no pool\): no network"):
        load("arc_easy", fewshot=2)


def _rows(rng):
    words = "the value of a list is returned by function class method module string error import".split()
    sent = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    return {
        "hellaswag": [{"ind": i, "activity_label": "Python", "ctx_a": sent(8) + ".", "ctx_b": sent(5),
                       "endings": [sent(6) + " [title] " + sent(2) for _ in range(4)], "label": str(i % 4)} for i in range(12)],
        "arc_easy": [{"id": f"q{i}", "question": sent(7) + "?", "choices": {"text": [sent(3) for _ in range(4)],
                      "label": ["A", "B", "C", "D"]}, "answerKey": "ABCD"[i % 4]} for i in range(12)],
        "arc_challenge": [{"id": f"c{i}", "question": sent(9) + "?", "choices": {"text": [sent(2) for _ in range(3)],
                           "label": ["1", "2", "3"]}, "answerKey": "123"[i % 3]} for i in range(12)],
        "piqa": [{"goal": sent(6), "sol1": sent(5), "sol2": sent(7), "label": i % 2} for i in range(12)],
        "sciq": [{"support": " " + sent(20), "question": sent(6) + "?", "distractor1": sent(2), "distractor2": sent(1),
                  "distractor3": sent(3), "correct_answer": sent(2)} for i in range(12)],
        "winogrande": [{"sentence": sent(5) + " _ " + sent(6) + ".", "option1": sent(1), "option2": sent(1),
                        "answer": str(1 + i % 2)} for i in range(12)],
        "lambada_openai": [{"text": sent(25)} for i in range(12)],
    }


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    """Local files in each hub dataset's own schema, and a plain JSONL of each format."""
    d = tmp_path_factory.mktemp("tasks")
    for name, rows in _rows(random.Random(0)).items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = [{"context": "The return statement", "choices": ["returns a value", "is a fish"], "gold": 0},
             {"contexts": ["A list is", "A string is"], "continuation": "a sequence of characters.", "gold": 1},
             {"context": "Import a", "continuation": " module"}]
    (d / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in plain * 3))
    return d


def test_hub_schemas_are_prompted_as_lm_eval_prompts_them(task_files):
    [h, *_], *_ = load(f"hellaswag={task_files / 'hellaswag.jsonl'}")
    row = json.loads((task_files / "hellaswag.jsonl").read_text().splitlines()[0])
    assert h.contexts == [f"Python: {row['ctx_a']} {row['ctx_b'].capitalize()}"]
    assert "[title]" not in h.continuations[0] and ". " in h.continuations[0] and h.gold == 0
    [a, *_], *_ = load(f"arc_challenge={task_files / 'arc_challenge.jsonl'}", limit=1)
    assert a.contexts[0].startswith("Question: ") and a.contexts[0].endswith("?\nAnswer:") and a.gold == 0
    [w, *_], *_ = load(f"winogrande={task_files / 'winogrande.jsonl'}")
    assert w.format == "schema" and len(w.contexts) == 2 and w.continuations[0].startswith(" ")
    [s, *_], *_ = load(f"sciq={task_files / 'sciq.jsonl'}")
    assert s.gold == 3 and "\nQuestion: " in s.contexts[0] and not s.contexts[0].startswith(" ")
    [lam, *_], *_ = load(f"lambada_openai={task_files / 'lambada_openai.jsonl'}")
    assert lam.format == "cloze" and len(lam.contexts[0].split()) == 24
    mine, *_ = load(str(task_files / "mine.jsonl"))
    assert [m.format for m in mine[:3]] == ["multiple_choice", "schema", "cloze"]
    assert len(load(str(task_files / "mine.jsonl"), limit=4)[0]) == 4


# ------------------------------------------------------------------ a trained model (slow tier)

SMALL = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.wandb=disabled",
         "schedule.warmup_steps=2", "train.eval_every=0", "distributed.zero_stage=0"]
TASKS = ["hellaswag", "arc_easy", "arc_challenge", "piqa", "sciq", "winogrande", "lambada_openai"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    run_train(SMALL + ["train.max_steps=30", f"train.run_dir={run}"])
    return run


def _specs(task_files):
    return ",".join([f"{t}={task_files / (t + '.jsonl')}" for t in TASKS] + [str(task_files / "mine.jsonl")])


def _eval(*args, nproc=1) -> dict:
    from helpers import pretrain

    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"tasks-{os.getpid()}-{free_port()}.json"
    pretrain(["eval", *args, "--json", str(out)], nproc=nproc, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_task_scores_are_the_same_at_one_and_two_ranks(trained, task_files):
    one = _eval(str(trained), "--tasks", _specs(task_files))
    two = _eval(str(trained), "--tasks", _specs(task_files), nproc=2)
    assert sorted(one["tasks"]) == sorted(TASKS + ["mine"])
    for task, r in one["tasks"].items():
        assert r["n"] == (9 if task == "mine" else 12)
        assert two["tasks"][task] == r, task  # per instance, exactly
    # few-shot: examples drawn per instance with the seed, the same at any world size
    shot1 = _eval(str(trained), "--tasks", f"arc_easy={task_files / 'arc_easy.jsonl'}", "--fewshot", "2")
    shot2 = _eval(str(trained), "--tasks", f"arc_easy={task_files / 'arc_easy.jsonl'}", "--fewshot", "2", nproc=2)
    assert shot1["tasks"] == shot2["tasks"]
    assert shot1["tasks"]["arc_easy"]["instances"][0]["lls"] != one["tasks"]["arc_easy"]["instances"][0]["lls"]


@pytest.mark.slow
def test_task_scores_equal_lm_evaluation_harness(trained, task_files, tmp_path, monkeypatch):
    """lm-eval 0.4's HFLM on our HF export, its own task YAMLs pointed at the same local files
    (offline): every request's log-likelihood within 1e-4 of ours, acc and acc_norm equal exactly."""
    lm_eval = pytest.importorskip("lm_eval")  # (the test extra installs it)
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    ours = _eval(str(trained), "--tasks", _specs(task_files))["tasks"]
    assert main(["export", str(trained / "checkpoints"), str(tmp_path / "hf")]) == 0
    where = Path(lm_eval.__file__).parent / "tasks"
    yamls = tmp_path / "yaml"
    yamls.mkdir()
    files = {"hellaswag": ("hellaswag/hellaswag.yaml", "validation"), "arc_easy": ("arc/arc_easy.yaml", "test"),
             "arc_challenge": ("arc/arc_challenge.yaml", "test"), "piqa": ("piqa/piqa.yaml", "validation"),
             "sciq": ("sciq/sciq.yaml", "test"), "winogrande": ("winogrande/default.yaml", "validation"),
             "lambada_openai": ("lambada/lambada_openai.yaml", "test")}
    for task, (path, split) in files.items():
        (yamls / f"{task}.yaml").write_text(
            f"include: {where / path}\ntask: local_{task}\ntag: null\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n    {split}: {task_files / (task + '.jsonl')}\n"
            f"training_split: null\nvalidation_split: {split if split == 'validation' else 'null'}\n"
            f"test_split: {split if split == 'test' else 'null'}\n")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", dtype="float32", batch_size=1)
    res = lm_eval.simple_evaluate(model=lm, tasks=[f"local_{t}" for t in files], num_fewshot=0, log_samples=True,
                                  task_manager=TaskManager(include_path=str(yamls)))
    worst = 0.0
    for task in files:
        samples = sorted(res["samples"][f"local_{task}"], key=lambda s: s["doc_id"])
        mine = ours[task]["instances"]
        assert len(samples) == len(mine) == 12
        for s, o in zip(samples, mine):
            lls = [r[0] for r in s["filtered_resps"]]
            assert len(lls) == len(o["lls"])
            worst = max(worst, *(abs(a - b) for a, b in zip(lls, o["lls"])))
            assert s["acc"] == o["acc"], (task, s["doc_id"])
            if "acc_norm" in s:
                assert s["acc_norm"] == o["acc_norm"], (task, s["doc_id"])
        assert res["results"][f"local_{task}"]["acc,none"] == pytest.approx(ours[task]["metrics"]["acc"], abs=1e-12)
    assert worst < 1e-4, worst
    # LAMBADA's perplexity is exp of the mean loss of the final words
    ppl = res["results"]["local_lambada_openai"]["perplexity,none"]
    assert ppl == pytest.approx(math.exp(ours["lambada_openai"]["metrics"]["loss"]), rel=1e-4)


@pytest.mark.slow
def test_the_scoring_dtype_is_chosen_and_said(trained, task_files):
    """`pretrain eval --tasks` scores in fp32 on the CPU (what lm-eval's HFLM does on the fp32
    export: the equality above), bf16 with --dtype bf16 (CUDA's default), and says which."""
    spec = f"arc_easy={task_files / 'arc_easy.jsonl'}"
    fp32, bf16 = _eval(str(trained), "--tasks", spec), _eval(str(trained), "--tasks", spec, "--dtype", "bf16")
    assert (fp32["dtype"], bf16["dtype"]) == ("fp32", "bf16")
    assert _eval(str(trained), "--tasks", spec, "--dtype", "fp32")["tasks"] == fp32["tasks"]
    gaps = [abs(a - b) for x, y in zip(fp32["tasks"]["arc_easy"]["instances"], bf16["tasks"]["arc_easy"]["instances"])
            for a, b in zip(x["lls"], y["lls"])]
    print(f"bf16 - fp32 log-likelihoods: max {max(gaps):.4f}, mean {sum(gaps) / len(gaps):.4f} nats")
    assert 0 < max(gaps) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("case,message", [
    ("unknown", "unknown task 'hellaswagg'; tasks: hellaswag, arc_easy"),
    ("schema", "row 0 is not in the task's schema (no ctx_a, ctx_b, activity_label, endings): it needs the fields"),
    ("no_tokenizer", "tokenizer"),
])
def test_bad_task_input_is_one_line(trained, task_files, tmp_path, capsys, case, message):
    model, tasks = str(trained), "hellaswagg"
    if case == "schema":
        tasks = f"hellaswag={task_files / 'piqa.jsonl'}"
    elif case == "no_tokenizer":
        assert main(["export", str(trained / "checkpoints"), str(tmp_path / "hf")]) == 0
        (tmp_path / "hf" / "tokenizer.json").unlink()
        model, tasks = str(tmp_path / "hf"), str(task_files / "mine.jsonl")
    capsys.readouterr()
    assert main(["eval", model, "--tasks", tasks]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and message in err[0], err


def test_limit_zero_is_one_line(capsys):
    assert main(["eval", "no-such-model", "--tasks", "hellaswag", "--limit", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["pretrain: error: --limit 0: give N >= 1 instances per task (leave it out for all of them)"]


@pytest.mark.slow
def test_in_loop_tasks_at_zero3_on_two_ranks_equal_pretrain_eval(task_files, tmp_path):
    """train.eval_tasks on 2 ranks at ZeRO-3 (7 instances: one rank scores one more, and repeats
    one to keep the collective forwards even): eval/TASK/METRIC at each eval and at the end, equal to
    `pretrain eval --tasks` of the final checkpoint; a WSD-S decay branch gives branch/TASK/METRIC."""
    from helpers import read_metrics

    run = tmp_path / "run"
    specs = [f"arc_easy={task_files / 'arc_easy.jsonl'}", str(task_files / "mine.jsonl")]
    run_train(["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.wandb=disabled",
               "logging.log_every=1", "distributed.zero_stage=3", "train.max_steps=6", "train.eval_every=3",
               f"train.eval_tasks=[{', '.join(specs)}]", "train.eval_task_limit=7", "schedule.kind=wsd",
               "schedule.warmup_steps=1", "schedule.decay_points=[4]", f"train.run_dir={run}"], nproc=2)
    records = read_metrics(run)
    evals = {r["step"]: r for r in records if "eval/arc_easy/acc" in r}
    assert sorted(evals) == [3, 6]
    assert {k for k in evals[6] if k.startswith("eval/")} >= {
        "eval/loss", "eval/arc_easy/acc", "eval/arc_easy/acc_norm", "eval/arc_easy/bpb", "eval/arc_easy/prob",
        "eval/mine/acc", "eval/mine/loss"}
    [branch] = [r for r in records if "branch/end_step" in r]
    assert {"branch/eval_loss", "branch/arc_easy/acc", "branch/mine/bpb"} <= set(branch)
    cli = _eval(str(run), "--tasks", ",".join(specs), "--limit", "7")["tasks"]
    for task in ("arc_easy", "mine"):
        assert cli[task]["n"] == 7
        for k, v in cli[task]["metrics"].items():
            # (the engine's ZeRO-3 forward and one process's whole model differ by summation order)
            assert evals[6][f"eval/{task}/{k}"] == pytest.approx(v, rel=1e-5, abs=1e-6), (task, k)


@pytest.mark.slow
def test_task_points_of_a_run_feed_the_ladder(task_files, tmp_path):
    """A WSD-S run with in-loop tasks gives the ladder one (N, D, bpb, metric) point per decay
    branch and at its end, D counted from the step."""
    from pretrain.config import load_config
    from pretrain.model.model import matmul_params
    from pretrain.scaling.ladder import collect

    run = tmp_path / "run"
    over = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.wandb=disabled",
            "distributed.zero_stage=0", "train.max_steps=6", "schedule.kind=wsd", "schedule.warmup_steps=1",
            "schedule.decay_points=[3]", f"train.eval_tasks=[arc_easy={task_files / 'arc_easy.jsonl'}]",
            f"train.run_dir={run}"]
    run_train(over)
    points = collect([str(run)], "arc_easy/acc_norm")
    n = matmul_params(load_config(sorted((run / "checkpoints").glob("step_*"))[-1] / "config.yaml").model)
    assert [(p.params, p.tokens) for p in points] == [(n, 3 * 8 * 64), (n, 6 * 8 * 64)]
    assert all(0 < p.bpb < 10 and 0 <= p.value <= 1 for p in points)


@pytest.mark.slow
def test_in_loop_tasks_use_the_runs_end_of_text_token(tmp_path):
    """Trained with data.eot_token=Ġthe, the in-loop scores of instances with an empty context
    (scored after the end-of-text token) equal `pretrain eval` of the same weights, which reads the
    token from the checkpoint's config. In-loop scoring used the vocabulary's default token before:
    its loss differed (39.2 against 37.9 in the issue's run)."""
    from helpers import read_metrics

    (tmp_path / "empty.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"context": "", "continuation": " the value is returned"},
        {"context": "", "choices": ["list", "string of characters"], "gold": 1}]))
    run = tmp_path / "run"
    spec = str(tmp_path / "empty.jsonl")
    run_train(SMALL + ["train.max_steps=3", "data.eot_token=Ġthe", f"train.eval_tasks=[{spec}]", f"train.run_dir={run}"])
    [final] = [r for r in read_metrics(run) if "eval/empty/loss" in r]
    cli = _eval(str(run), "--tasks", spec)["tasks"]["empty"]["metrics"]
    for k, v in cli.items():
        assert final[f"eval/empty/{k}"] == pytest.approx(v, rel=1e-5, abs=1e-6), k
