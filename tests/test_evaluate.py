"""`pretrain eval`: `--data SRC` scores that source instead of the config's validation data, and
`--micro-batch-size` changes only how many sequences go through one forward: both give the numbers
computed here from the same windows, with a plain cross-entropy over the model's logits."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

import data_pipeline as dp
import helpers
from helpers import REPO
from pretrain.config import load_config
from pretrain.eval.evaluate import _config, evaluate
from pretrain.model.args import ModelArgs
from pretrain.model.model import Transformer
from pretrain.parallel import distributed

ENV = distributed.Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
TOKENIZER = "builtin:python-bpe-512"
WORDS = "the value of a list is returned by the function when its name is called from a module".split()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A small held-out file (a full pass is a few dozen windows) and a config whose own validation
    data is something else (the built-in docs)."""
    import random

    d = tmp_path_factory.mktemp("eval")
    rng = random.Random(0)
    path = d / "held_out.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))})
                            + "\n" for i in range(40)))
    config = d / "eval.yaml"
    config.write_text(f"data:\n  tokenizer: {TOKENIZER}\n  seq_len: 32\n  num_streams: 2\n  validation:\n"
                      "    - path: builtin:python-docs\n      split: validation\ntrain:\n  micro_batch_size: 4\n")
    return path, config


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=512, multiple_of=32,
                              max_seq_len=64))
    m.init_weights()
    return m.eval()


def _cfg(config, source):
    return load_config(str(config), [f"data.validation=[{{path: {source}}}]"])


def reference(model, tokenizer, cfg, sequences: int = 0) -> dict:
    """Loss, bits per byte and counts over the windows, one window at a time."""
    loss_sum, tokens, n_bytes, n = 0.0, 0, 0, 0
    with torch.no_grad():
        for w in dp.evaluation_windows(cfg.data, tokenizer, 0, 1, sequences):
            w = torch.from_numpy(w.astype("int64"))
            logits = model(w[None, :-1])[0].double()
            loss_sum += F.cross_entropy(logits, w[1:], reduction="sum").item()
            tokens += len(w) - 1
            n_bytes += len(tokenizer.decode(w[1:].tolist(), skip_special_tokens=False).encode("utf-8"))
            n += 1
    return {"loss": loss_sum / tokens, "bits_per_byte": loss_sum / (math.log(2) * n_bytes), "tokens": tokens,
            "bytes": n_bytes, "sequences": n}


def _same(got: dict, want: dict) -> None:
    assert {k: got[k] for k in ("tokens", "bytes", "sequences")} == {k: want[k] for k in ("tokens", "bytes", "sequences")}
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["bits_per_byte"] == pytest.approx(want["bits_per_byte"], rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-12)


@pytest.mark.parametrize("batches", [0, 2])
def test_micro_batch_size_changes_nothing_but_the_batching(model, data, batches):
    """A full pass (batches 0) and the first 2 global batches of 4 sequences, at micro-batch sizes 1,
    3 (a short last batch), 4 (the config's: 0) and 7."""
    path, config = data
    tokenizer = dp.load_tokenizer(TOKENIZER)
    cfg = _cfg(config, path)
    want = reference(model, tokenizer, cfg, batches * cfg.global_batch(1))
    assert want["sequences"] == (8 if batches else want["sequences"]) and want["sequences"] >= 8
    for micro in (1, 3, 0, 7):
        sizes = []
        hook = model.register_forward_pre_hook(lambda module, args: sizes.append(len(args[0])))
        try:
            _same(evaluate(model, tokenizer, cfg, ENV, batches, micro), want)
        finally:
            hook.remove()
        b = micro or 4
        assert sizes == [b] * (want["sequences"] // b) + [want["sequences"] % b] * bool(want["sequences"] % b)


def test_data_replaces_the_configs_validation_sources(model, data, tmp_path):
    path, config = data
    tokenizer = dp.load_tokenizer(TOKENIZER)
    cfg = _config(tmp_path, True, str(config), [], str(path))  # an HF model dir: CONFIG for the rest
    assert [s.path for s in cfg.data.validation] == [str(path)] and cfg.data.seq_len == 32
    _same(evaluate(model, tokenizer, cfg, ENV), reference(model, tokenizer, _cfg(config, path)))
    saved = tmp_path / "ckpt"  # a checkpoint: its own config.yaml for the rest
    saved.mkdir()
    (saved / "config.yaml").write_text(config.read_text())
    cfg = _config(saved, False, None, ["data.seq_len=16"], str(path))
    assert [s.path for s in cfg.data.validation] == [str(path)] and cfg.data.seq_len == 16


@pytest.mark.slow
def test_eval_command_with_data_and_micro_batch_size(data, tmp_path, monkeypatch, capsys):
    """`pretrain eval MODEL CONFIG --data FILE --micro-batch-size 3` on a Hugging Face model directory:
    the numbers of the same windows computed here, and those of a config whose validation is FILE;
    the model sees batches of 3 sequences (the same command in this process, to watch it)."""
    transformers = pytest.importorskip("transformers")
    import shutil

    from pretrain.hf.export import load_for_inference

    path, config = data
    hf = tmp_path / "hf"
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf)
    shutil.copy(REPO / "data_pipeline" / "assets" / "python-bpe-512.json", hf / "tokenizer.json")
    own = tmp_path / "own.yaml"
    own.write_text(config.read_text().replace("    - path: builtin:python-docs\n      split: validation\n",
                                              f"    - path: {path}\n"))

    def pretrain_eval(*args):
        out = tmp_path / f"eval{len(list(tmp_path.glob('eval*.json')))}.json"
        helpers.pretrain(["eval", str(hf), *args, "--json", str(out)])
        return json.loads(out.read_text())

    got = pretrain_eval(str(config), "--data", str(path), "--micro-batch-size", "3")
    model, tokenizer, _ = load_for_inference(str(hf))
    want = reference(model, tokenizer, _cfg(config, path))
    _same(got, want)
    _same(pretrain_eval(str(own)), want)

    from pretrain.cli import main
    import pretrain.eval.evaluate

    sizes, real = [], pretrain.eval.evaluate.evaluate

    def watched(model, *args, **kwargs):
        model.register_forward_pre_hook(lambda module, inputs: sizes.append(len(inputs[0])))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(pretrain.eval.evaluate, "evaluate", watched)
    monkeypatch.setattr(distributed, "init", lambda *args, **kwargs: ENV)  # (no process group in this process)
    monkeypatch.setattr(distributed, "shutdown", lambda: None)
    assert main(["eval", str(hf), str(config), "--data", str(path), "--micro-batch-size", "3", "--json",
                 str(tmp_path / "here.json")]) == 0
    _same(json.loads((tmp_path / "here.json").read_text()), want)
    n = want["sequences"]
    assert sizes == [3] * (n // 3) + [n % 3] * bool(n % 3)
    assert f"{n:,} sequences, {want['tokens']:,} tokens" in capsys.readouterr().out


def reference_by_position(model, tokenizer, cfg, width: int) -> list[tuple[int, int, float, int]]:
    """(start, end, mean loss, tokens) per bucket of `width` positions, one window at a time, from a
    plain cross-entropy over the logits."""
    T = cfg.data.seq_len
    sums, counts = [0.0] * -(-T // width), [0] * -(-T // width)
    with torch.no_grad():
        for w in dp.evaluation_windows(cfg.data, tokenizer, 0, 1):
            w = torch.from_numpy(w.astype("int64"))
            losses = F.cross_entropy(model(w[None, :-1])[0].double(), w[1:], reduction="none")
            for t, x in enumerate(losses.tolist()):
                sums[t // width] += x
                counts[t // width] += 1
    return [(i * width, min((i + 1) * width, T), s / c, c) for i, (s, c) in enumerate(zip(sums, counts))]


def test_by_position_gives_the_mean_loss_of_each_bucket_of_positions(model, data):
    """--by-position 10 over 32-token windows: buckets [0,10) [10,20) [20,30) [30,32), each the mean of
    its tokens' losses, the same at any micro-batch size (float64 sums of the same fp32 losses; measured:
    to the bit), so at any world size; the overall numbers are those without it."""
    path, config = data
    tokenizer = dp.load_tokenizer(TOKENIZER)
    cfg = _cfg(config, path)
    want = reference_by_position(model, tokenizer, cfg, 10)
    seen = []
    for micro in (3, 0):
        plain = evaluate(model, tokenizer, cfg, ENV, micro_batch_size=micro)
        got = evaluate(model, tokenizer, cfg, ENV, micro_batch_size=micro, by_position=10)
        assert "by_position" not in plain and {k: v for k, v in got.items() if k != "by_position"} == plain
        buckets = got["by_position"]
        assert [(b["start"], b["end"], b["tokens"]) for b in buckets] == [(s, e, n) for s, e, _, n in want]
        assert [b["tokens"] for b in buckets] == [got["sequences"] * n for n in (10, 10, 10, 2)]
        for b, (_, _, loss, _) in zip(buckets, want):
            assert b["loss"] == pytest.approx(loss, rel=1e-5)
        overall = sum(b["loss"] * b["tokens"] for b in buckets) / got["tokens"]
        assert overall == pytest.approx(got["loss"], rel=1e-6)
        seen.append(buckets)
    for a, b in zip(*seen):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12)
    assert len(evaluate(model, tokenizer, cfg, ENV, by_position=64)["by_position"]) == 1  # wider than a window


@pytest.mark.parametrize("argv,line", [
    (["--by-position", "-8"], "--by-position -8: give a bucket width in tokens >= 1 (0 = off)"),
    (["--by-position", "8", "--tasks", "arc_easy"], "--by-position goes with the loss eval, not --tasks"),
    (["model.n_layers=2"], "model.n_layers: the model is the checkpoint's; an eval may change only model.max_seq_len, "
                           "model.rope_theta"),
])
def test_bad_eval_options_are_one_line(tmp_path, capsys, argv, line):
    from pretrain.cli import main

    assert main(["eval", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pretrain: error: {line}"), err
