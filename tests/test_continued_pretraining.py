"""Continued pretraining from Hugging Face models, `pretrain eval`, and exports that transformers 4.x
and 5.x read: HF -> our checkpoint -> HF is lossless (sharded safetensors in, ZeRO-3 at 2 ranks),
the refusals, eval equal across world sizes, to the training run's own eval and to its export."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helpers
from helpers import REPO, free_port, hf_weights, read_metrics, run_train, train_env

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

CONTINUE = REPO / "configs" / "continue_smollm2.yaml"  # init_from and tokenizer overridden to local dirs
BUILTIN_TOKENIZER = REPO / "data_pipeline" / "assets" / "python-docs-bpe.json"
SMALL = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.wandb=disabled",
         "logging.log_every=1"]


def hf_llama_dir(path: Path, tied=False, rope_scaling=None, shard=True, **extra) -> Path:
    """A randomly initialised LlamaForCausalLM saved by transformers (sharded safetensors), with our
    builtin tokenizer, as a user's downloaded model directory would look."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(BUILTIN_TOKENIZER)).get_vocab_size()
    cfg = transformers.LlamaConfig(
        vocab_size=extra.pop("vocab_size", vocab), hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=50000.0,
        tie_word_embeddings=tied, rope_scaling=rope_scaling, **extra)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float()
    model.save_pretrained(path, max_shard_size="100KB" if shard else "10GB")
    shutil.copy(BUILTIN_TOKENIZER, path / "tokenizer.json")
    return path


def pretrain_cmd(*args, nproc=1, timeout=300, check=True):
    return helpers.pretrain(list(args), nproc=nproc, timeout=timeout, check=check)


def one_error_line(proc) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_in_zero3_at_two_ranks_then_export_is_lossless(tmp_path, tied):
    """A sharded HF model -> `checkpoint.init_from` into a ZeRO-3 model at 2 ranks -> one step at
    lr 0 -> our checkpoint -> export: the same tensors, bit for bit."""
    src = hf_llama_dir(tmp_path / "hf", tied=tied)
    assert len(list(src.glob("model-*-of-*.safetensors"))) > 1  # really sharded
    run = tmp_path / "run"
    proc = run_train(SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={src}", "optimizer.lr=0",
                              "schedule.min_lr=0", "train.max_steps=1", "distributed.zero_stage=3",
                              f"train.run_dir={run}"], nproc=2, config=CONTINUE)
    assert "from the Hugging Face model" in proc.stdout
    pretrain_cmd("export", str(run / "checkpoints"), str(tmp_path / "out"))
    want, got = hf_weights(src), hf_weights(tmp_path / "out")
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_differing_model_section_is_reported(tmp_path):
    src = hf_llama_dir(tmp_path / "hf", shard=False)
    proc = run_train(SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={src}", "model.dim=128",
                              f"train.run_dir={tmp_path / 'run'}"], check=False, config=CONTINUE)
    line = one_error_line(proc)
    assert "model.dim=128" in line and "64" in line and "config.json" in line
    assert not (tmp_path / "run").exists()


def test_a_model_section_that_matches_is_accepted(tmp_path):
    """Fields that restate config.json (or derive its values, like the SwiGLU width from
    multiple_of) are not a difference; changing one derived value is."""
    from pretrain.build import hf_model_args
    from pretrain.config import load_config
    from pretrain.errors import ConfigError

    src = hf_llama_dir(tmp_path / "hf", shard=False)
    base = [f"checkpoint.init_from={src}", f"data.tokenizer={src}"]
    same = ["model.dim=64", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.multiple_of=32",
            "model.ffn_dim_multiplier=0.9375", "model.rope_theta=50000", "model.max_seq_len=1024"]
    args = hf_model_args(load_config(CONTINUE, base + same))
    assert (args.dim, args.kv_heads, args.hidden_dim, args.max_seq_len) == (64, 2, 160, 1024)
    with pytest.raises(ConfigError, match=r"model.ffn_hidden_dim=192 \(config.json: 160\)"):
        hf_model_args(load_config(CONTINUE, base + ["model.multiple_of=64"]))


def test_continuing_keeps_the_document_masking_the_run_config_sets(tmp_path):
    """config.json holds no document masking: continuing an HF model with model.document_mask and
    model.document_positions set trains with them (they were dropped: the run trained without the
    mask while its config.yaml said true), with the tokenizer's end-of-text id; the run dir's
    config.yaml and the checkpoint's say the same model; the first loss is not the unmasked one."""
    import yaml

    src = hf_llama_dir(tmp_path / "hf", shard=False)
    base = SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={src}", "train.max_steps=1"]
    masked, plain = tmp_path / "masked", tmp_path / "plain"
    run_train(base + ["model.document_mask=true", "model.document_positions=true", f"train.run_dir={masked}"],
              config=CONTINUE)
    run_train(base + [f"train.run_dir={plain}"], config=CONTINUE)
    ckpt = masked / "checkpoints" / "step_00000001"
    function = json.loads((ckpt / "meta.json").read_text())["model_function"]
    assert function["document_mask"] is True and function["document_positions"] is True and function["eot_id"] >= 0
    model = yaml.safe_load((masked / "config.yaml").read_text())["model"]
    assert model == yaml.safe_load((ckpt / "config.yaml").read_text())["model"]
    assert model["document_mask"] is True and model["eot_id"] == function["eot_id"]
    first = [next(r["train/loss"] for r in read_metrics(run) if "train/loss" in r) for run in (masked, plain)]
    assert first[0] != pytest.approx(first[1], rel=1e-4)


@pytest.mark.parametrize("change,named", [
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1),
     "use_sliding_window=True (sliding-window attention (sliding_window=32) from block max_window_layers=1 on)"),
    (dict(model_type="olmo2", attention_bias=True), "attention_bias=True"),
    (dict(model_type="mistral", sliding_window=32), "sliding"),
    (dict(model_type="qwen2_moe", num_experts=8), "shared experts with a gate"),
    (dict(model_type="mixtral", num_local_experts=4, router_jitter_noise=0.1), "router_jitter_noise"),
    (dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 50000.0}), "longrope"),
    (dict(attention_bias=True), "bias"),
])
def test_unsupported_architectures_are_refused_in_one_line(tmp_path, change, named):
    src = hf_llama_dir(tmp_path / "hf", shard=False)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (src / "config.json").write_text(json.dumps(cfg))
    proc = run_train(SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={src}",
                              f"train.run_dir={tmp_path / 'run'}"], check=False, config=CONTINUE)
    line = one_error_line(proc)
    assert named in line and "not supported" in line


GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4, "n_layer": 2,
        "n_positions": 256, "vocab_size": 4096}


NAMED = {"gpt2": "model_type 'gpt2' (not a family this model holds); Llama, Mistral, Mixtral, Qwen2, Qwen3, "
                 "Qwen3-MoE, OLMo 2, OLMo 3, Gemma 3, GPT-OSS and SmolLM3 load",
         "llama3_without_low_freq": "llama3 RoPE scaling without low_freq_factor",
         "yarn_without_its_context": "yarn RoPE scaling without original_max_position_embeddings",
         "truncated_shard": "is not a readable safetensors file (Error while deserializing header"}


@pytest.mark.parametrize("case,command", [("gpt2", "train"), ("gpt2", "eval"), ("gpt2", "estimate"),
                                          ("gpt2", "generate"), ("llama3_without_low_freq", "train"),
                                          ("yarn_without_its_context", "train"),
                                          ("truncated_shard", "train"), ("truncated_shard", "eval")])
def test_a_model_dir_that_cannot_load_is_one_line_in_every_command(tmp_path, case, command):
    """Each was a traceback (KeyError 'hidden_size', KeyError 'low_freq_factor', SafetensorError at the
    first tensor read)."""
    src = hf_llama_dir(tmp_path / "hf", shard=case == "truncated_shard")
    cfg = json.loads((src / "config.json").read_text())
    if case == "gpt2":
        cfg = GPT2
    elif case == "llama3_without_low_freq":  # (as transformers 4.x writes it)
        cfg.pop("rope_parameters", None)
        cfg.update(rope_theta=50000.0, rope_scaling={"rope_type": "llama3", "factor": 4.0, "high_freq_factor": 4.0,
                                                     "original_max_position_embeddings": 32})
    elif case == "yarn_without_its_context":
        cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 50000.0}
    else:
        shard = sorted(src.glob("model-*.safetensors"))[-1]
        shard.write_bytes(shard.read_bytes()[:-100])
    (src / "config.json").write_text(json.dumps(cfg))
    train = [*SMALL, f"checkpoint.init_from={src}", f"data.tokenizer={src}", f"train.run_dir={tmp_path / 'run'}"]
    args = {"train": ["train", str(CONTINUE), *train], "estimate": ["estimate", str(CONTINUE), *train, "--gpus", "1"],
            "eval": ["eval", str(src), "--data", "builtin:python-docs"],
            "generate": ["generate", str(src), "--prompt", "def", "--max-new-tokens", "2"]}[command]
    assert NAMED[case] in one_error_line(pretrain_cmd(*args, check=False))


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(tmp_path):
    """An HF model of vocabulary 1024 with a 4096-token tokenizer: eval crashed in torch.embedding
    (a device-side assert on a GPU); init_from said "set model.vocab_size to 0", which does not help."""
    src = hf_llama_dir(tmp_path / "hf", shard=False, vocab_size=1024)
    proc = pretrain_cmd("eval", str(src), "--data", "builtin:python-docs", check=False)
    assert "its tokenizer has 4096 tokens, more than the model's vocabulary (1024)" in one_error_line(proc)
    builtin = "builtin:python-docs-bpe"
    proc = run_train(SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={builtin}",
                              f"train.run_dir={tmp_path / 'run'}"], check=False, config=CONTINUE)
    line = one_error_line(proc)
    assert "has 4096 tokens, more than the vocabulary of checkpoint.init_from" in line
    assert "use the model's own tokenizer" in line and "vocab_size to 0" not in line


def test_a_hub_model_that_cannot_be_downloaded_is_one_line(tmp_path, monkeypatch):
    """hub:NAME goes through huggingface_hub (offline here: the same path as a failed download)."""
    from pretrain.errors import CheckpointError
    from pretrain.hf import hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    hub.resolve.cache_clear()
    with pytest.raises(CheckpointError, match="could not download the model 'nobody/no-such-model'") as e:
        hub.resolve("hub:nobody/no-such-model")
    assert "\n" not in str(e.value)


def test_weights_that_do_not_fit_their_config_are_refused_before_loading(tmp_path):
    """A config.json whose vocab_size disagrees with the stored embedding: one line, at 2 ranks
    (rank 0 checks every shape from the file headers before any rank starts copying)."""
    src = hf_llama_dir(tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["vocab_size"] += 128
    (src / "config.json").write_text(json.dumps(cfg))
    proc = run_train(SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={src}", "distributed.zero_stage=3",
                              f"train.run_dir={tmp_path / 'run'}"], nproc=2, check=False, config=CONTINUE)
    assert proc.returncode != 0  # torchrun exits 1 for any failed worker
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain: error:")]
    assert len(lines) == 1 and "tok_embeddings.weight has shape (4096, 64), the model (4224, 64)" in lines[0], \
        proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short tiny run that evaluates 2 global batches of held-out data at its last step."""
    run = tmp_path_factory.mktemp("trained")
    run_train(SMALL + ["train.max_steps=6", "train.eval_every=0", "train.eval_batches=2", f"train.run_dir={run}"])
    [final] = [r for r in read_metrics(run) if "eval/loss" in r]
    return run, final["eval/loss"]


def _eval(*args, nproc=1) -> dict:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"eval-{os.getpid()}-{free_port()}.json"
    pretrain_cmd("eval", *args, "--json", str(out), nproc=nproc)
    return json.loads(out.read_text())


def test_eval_equals_the_runs_own_eval_at_any_world_size_and_its_export(tmp_path, trained):
    run, run_eval = trained
    one = _eval(str(run), "--batches", "2")
    assert one["loss"] == pytest.approx(run_eval, rel=1e-5)
    two = _eval(str(run), "--batches", "2", nproc=2)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6) and two["sequences"] == one["sequences"] == 16
    pretrain_cmd("export", str(run / "checkpoints"), str(tmp_path / "hf"))
    ckpt_config = sorted((run / "checkpoints").glob("step_*"))[-1] / "config.yaml"
    exported = _eval(str(tmp_path / "hf"), str(ckpt_config), "--batches", "2")
    assert exported["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert one["perplexity"] == pytest.approx(math.exp(one["loss"]), rel=1e-12)
    # Bits per byte: the summed loss in bits over the scored text's UTF-8 bytes (nats, or bytes
    # miscounted, fail). The bytes per token are checked against the tokenizer on the held-out text
    # itself, encoded here: the 16 scored windows are a sample of it.
    assert one["bits_per_byte"] == pytest.approx(one["loss"] * one["tokens"] / (math.log(2) * one["bytes"]), rel=1e-9)
    assert one["tokens"] == 16 * 64
    from data_pipeline import builtin
    from data_pipeline.tokenizer import load_tokenizer

    text = "\n\n".join(builtin.split_docs(builtin.python_docs(), "validation"))
    tok = load_tokenizer("builtin:python-docs-bpe")
    corpus_ratio = len(text.encode("utf-8")) / len(tok.encode(text).ids)
    assert one["bytes"] / one["tokens"] == pytest.approx(corpus_ratio, rel=0.25)  # (a sample of 1,024 tokens)


def test_eval_batches_are_the_training_runs_at_any_world_size(tmp_path):
    """A run whose global batch is micro_batch_size x its world size (train.global_batch_size unset):
    `--batches 2` scores its 2 x 4 sequences at 1 and at 2 ranks (2 ranks scored 16), as its own eval
    did. Asking for more sequences than one pass of the data has says that windows repeat."""
    run = tmp_path / "run"
    run_train(SMALL + ["train.global_batch_size=0", "train.max_steps=2", "train.eval_batches=2", f"train.run_dir={run}"])
    [final] = [r for r in read_metrics(run) if "eval/loss" in r]
    one = _eval(str(run), "--batches", "2")
    two = _eval(str(run), "--batches", "2", nproc=2)
    assert one["sequences"] == two["sequences"] == 8
    assert one["loss"] == pytest.approx(final["eval/loss"], rel=1e-5) and two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    one_pass = _eval(str(run))["sequences"]
    proc = pretrain_cmd("eval", str(run), "--batches", str(one_pass // 4 + 1))
    assert f"warning: the first {4 * (one_pass // 4 + 1)} validation sequences repeat windows" in proc.stderr
    assert "repeat windows" not in pretrain_cmd("eval", str(run), "--batches", "2").stderr


def test_eval_full_pass_is_the_same_at_one_and_two_ranks(trained):
    run, _ = trained
    one, two = _eval(str(run)), _eval(str(run), nproc=2)
    assert one["sequences"] == two["sequences"] > 16
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["bits_per_byte"] == pytest.approx(one["bits_per_byte"], rel=1e-6)


def test_export_writes_the_fields_transformers_4_reads(tmp_path, trained):
    run, _ = trained
    pretrain_cmd("export", str(run / "checkpoints"), str(tmp_path / "hf"), "--dtype", "bf16")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"]  # 4.x reads the top level only
    assert "rope_scaling" in cfg and cfg["torch_dtype"] == "bfloat16"
    tok = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"  # a class 4.x and 5.x both have
    assert all(t.dtype == torch.bfloat16 for t in hf_weights(tmp_path / "hf").values())


TRANSFORMERS_4 = "4.57.1"
READ_WITH_4 = """
import json, sys, torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
path, tokens = sys.argv[1], json.loads(sys.argv[2])
cfg = AutoConfig.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(path)
with torch.no_grad():
    logits = model(torch.tensor([tokens])).logits[0]
print(json.dumps({"version": transformers.__version__, "rope_theta": cfg.rope_theta,
                  "rope_scaling": getattr(cfg, "rope_scaling", None), "class": type(model).__name__,
                  "logits": logits.tolist(), "tokenizer": type(tok).__name__, "ids": tok("def f(x):").input_ids}))
"""


@pytest.fixture(scope="session")
def python_with_transformers_4(tmp_path_factory):
    """A venv over this Python's packages with transformers 4.x (and its tokenizers, hub) on top.
    (Not `venv --system-site-packages`: run from inside a venv, that gives the base interpreter's
    packages, without torch. A .pth file adds this interpreter's own site dirs after the venv's.)"""
    venv = tmp_path_factory.mktemp("transformers4") / "venv"
    outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        purelib = subprocess.run([str(venv / "bin" / "python"), "-c",
                                  "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        (Path(purelib) / "_outer_site.pth").write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in outer))
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"transformers=={TRANSFORMERS_4}"], check=True,
                       capture_output=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"could not install transformers {TRANSFORMERS_4} into a venv (the package registry?): {e}")
    return venv / "bin" / "python"


def test_an_export_with_llama3_rope_scaling_reads_right_in_transformers_4(tmp_path, python_with_transformers_4):
    """Imported from an HF model with Llama 3.1 RoPE scaling, trained one step, exported: transformers
    4.57 sees the same RoPE settings and gives our model's logits, also past the original context."""
    from pretrain.hf.export import load_for_inference

    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
    src = hf_llama_dir(tmp_path / "src", rope_scaling=scaling)
    run = tmp_path / "run"
    run_train(SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={src}", "train.max_steps=1",
                       f"train.run_dir={run}"], config=CONTINUE)
    out = tmp_path / "hf"
    pretrain_cmd("export", str(run / "checkpoints"), str(out))
    ours, _, _ = load_for_inference(str(run / "checkpoints"))
    tokens = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(0)).tolist()  # 100 > 32
    with torch.no_grad():
        want = ours(torch.tensor([tokens]))[0]
    proc = subprocess.run([str(python_with_transformers_4), "-c", READ_WITH_4, str(out), json.dumps(tokens)],
                          capture_output=True, text=True, env={**train_env(), "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["version"] == TRANSFORMERS_4
    assert got["rope_theta"] == 50000.0 and got["rope_scaling"]["rope_type"] == "llama3"
    assert got["rope_scaling"]["factor"] == 4.0 and got["rope_scaling"]["original_max_position_embeddings"] == 32
    torch.testing.assert_close(torch.tensor(got["logits"]), want, rtol=1e-4, atol=1e-4)
    assert got["tokenizer"] == "PreTrainedTokenizerFast" and got["ids"]


def hf_qwen3_dir(path: Path) -> Path:
    """A random Qwen3ForCausalLM saved by transformers, with our builtin tokenizer: per-head q/k norms
    (drawn away from 1, as built they are 1), head_dim 32 on hidden_size 64 with 4 heads, tied."""
    from tokenizers import Tokenizer

    cfg = transformers.Qwen3Config(
        vocab_size=Tokenizer.from_file(str(BUILTIN_TOKENIZER)).get_vocab_size(), hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(path)
    shutil.copy(BUILTIN_TOKENIZER, path / "tokenizer.json")
    return path


def test_a_qwen3_continues_and_exports_as_a_qwen3(tmp_path):
    """A Qwen3 -> `pretrain train` (checkpoint.init_from) for 2 steps -> `pretrain export`: config.json
    says qwen3 (Qwen3ForCausalLM, head_dim 32), AutoModelForCausalLM reads it and gives our checkpoint's
    logits within 1e-5; the same tensor names as the start, the q/k norms among those training moved."""
    from transformers import AutoModelForCausalLM

    from pretrain.hf.export import load_for_inference

    src = hf_qwen3_dir(tmp_path / "qwen3")
    run, out = tmp_path / "run", tmp_path / "hf"
    proc = run_train(SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={src}", "train.max_steps=2",
                              "train.eval_every=0", f"train.run_dir={run}"], config=CONTINUE)
    assert "from the Hugging Face model" in proc.stdout
    pretrain_cmd("export", str(run / "checkpoints"), str(out))
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"], cfg["head_dim"]) == ("qwen3", ["Qwen3ForCausalLM"], 32)
    start, exported = hf_weights(src), hf_weights(out)
    assert sorted(exported) == sorted(start)
    assert not torch.equal(exported["model.layers.0.self_attn.q_norm.weight"],
                           start["model.layers.0.self_attn.q_norm.weight"])
    ours, _, _ = load_for_inference(str(run / "checkpoints"))
    assert (ours.args.qk_norm, ours.args.head_dim) == ("head", 32)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    tokens = torch.randint(0, 4096, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=0, atol=1e-5)


def test_a_model_no_family_holds_is_refused_by_export_in_one_line(tmp_path):
    """Sinks and GeGLU (GPT-OSS's, Gemma's): no family the export writes holds them; named, nothing written."""
    run = tmp_path / "run"
    run_train(SMALL + ["model.attn_sinks=true", "model.ffn_activation=gelu_tanh", "train.max_steps=1",
                       "train.eval_every=0", f"train.run_dir={run}"])
    line = one_error_line(pretrain_cmd("export", str(run / "checkpoints"), str(tmp_path / "hf"), check=False))
    for named in ("no Hugging Face family holds", "model.attn_sinks=True", "model.ffn_activation='gelu_tanh'"):
        assert named in line, line
    assert not (tmp_path / "hf").exists()


# A Mixture-of-Experts run Mixtral holds (softmax router, top-k renormalised, every block MoE, no
# shared expert), trained on 2 ranks at ZeRO-3: exported from its shards.
MIXTRAL = ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_hidden_dim=48", "model.dim=64", "model.n_layers=2",
           "model.n_heads=4", "model.n_kv_heads=2", "distributed.zero_stage=3", "train.precision=fp32",
           "train.max_steps=2", "train.eval_every=0", "data.seq_len=64", "train.micro_batch_size=2",
           "logging.wandb=disabled"]


def test_an_moe_exports_to_mixtral_that_transformers_5_and_4_read(tmp_path, python_with_transformers_4):
    """Each expert under its own name on disk (block_sparse_moe.experts.{e}.w1.weight, 4.x's names,
    which 5.x merges on loading); MixtralForCausalLM's logits within 1e-5 of ours under both."""
    from safetensors import safe_open
    from transformers import MixtralForCausalLM

    from pretrain.hf.export import load_for_inference

    run = tmp_path / "run"
    run_train(MIXTRAL + [f"train.run_dir={run}"], nproc=2)
    out = tmp_path / "hf"
    pretrain_cmd("export", str(run / "checkpoints"), str(out))
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight"} <= names
    assert not any("expert_bias" in n or "gate_up_proj" in n for n in names)
    ours, _, _ = load_for_inference(str(run / "checkpoints"))
    tokens = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        want = ours(torch.tensor([tokens]))[0]
        hf = MixtralForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        torch.testing.assert_close(hf(torch.tensor([tokens])).logits[0], want, rtol=1e-5, atol=1e-5)
    proc = subprocess.run([str(python_with_transformers_4), "-c", READ_WITH_4, str(out), json.dumps(tokens)],
                          capture_output=True, text=True, env={**train_env(), "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["version"] == TRANSFORMERS_4 and got["class"] == "MixtralForCausalLM"
    torch.testing.assert_close(torch.tensor(got["logits"]), want, rtol=1e-5, atol=1e-5)


def test_an_moe_that_mixtral_cannot_hold_is_refused_in_one_line(tmp_path):
    run = tmp_path / "run"
    run_train(MIXTRAL + ["model.moe_shared_experts=1", "model.moe_router=sigmoid", "model.moe_bias_rate=0.01",
                         "distributed.zero_stage=0", f"train.run_dir={run}"])
    line = one_error_line(pretrain_cmd("export", str(run / "checkpoints"), str(tmp_path / "hf"), check=False))
    for named in ("is not a Hugging Face Mixtral", "model.moe_router=sigmoid", "model.moe_shared_experts=1",
                  "routers' bias"):
        assert named in line, line
    assert not (tmp_path / "hf").exists()


def test_continued_pretraining_from_a_mixtral(tmp_path):
    """A Mixtral (random, saved by transformers, sharded: each expert under its own name) starts a
    2-rank ZeRO-3 run: our model from it gives Mixtral's logits (1e-5), the run loads every expert
    (its first loss is a trained model's, not a random one's), and the balancing settings are the run
    config's."""
    import yaml
    from tokenizers import Tokenizer

    from pretrain.hf.export import load_for_inference

    vocab = Tokenizer.from_file(str(BUILTIN_TOKENIZER)).get_vocab_size()
    cfg = transformers.MixtralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     rms_norm_eps=1e-5, rope_theta=50000.0, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=None)
    torch.manual_seed(0)
    src = tmp_path / "mixtral"
    transformers.MixtralForCausalLM(cfg).float().save_pretrained(src, max_shard_size="100KB")
    shutil.copy(BUILTIN_TOKENIZER, src / "tokenizer.json")
    hf = transformers.MixtralForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ours, _, _ = load_for_inference(str(src))
    assert ours.args.moe_experts == 4 and ours.args.moe_top_k == 2 and ours.args.moe_hidden_dim == 48
    tokens = torch.randint(0, vocab, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    run = tmp_path / "run"
    proc = run_train(SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={src}", "train.max_steps=1",
                              "distributed.zero_stage=3", "train.precision=fp32", "model.moe_aux_loss=0.02",
                              f"train.run_dir={run}"], config=CONTINUE, nproc=2)
    assert "2 of 4 experts" in proc.stdout
    resolved = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert resolved["moe_experts"] == 4 and resolved["moe_aux_loss"] == 0.02
    first = next(r for r in read_metrics(run) if "train/loss" in r)
    assert first["train/loss"] < math.log(vocab) + 1


def _mixtral_dir(path: Path, **config) -> Path:
    """A small random Mixtral saved by transformers (one file), with our builtin tokenizer."""
    from tokenizers import Tokenizer

    cfg = transformers.MixtralConfig(**{
        "vocab_size": Tokenizer.from_file(str(BUILTIN_TOKENIZER)).get_vocab_size(), "hidden_size": 64,
        "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
        **config})
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(cfg).float().save_pretrained(path)
    shutil.copy(BUILTIN_TOKENIZER, path / "tokenizer.json")
    return path


@pytest.mark.parametrize("change,named", [
    ("train.mlp_chunk_tokens=64", "model.moe_experts=4 with train.mlp_chunk_tokens"),
    ("distributed.tensor_parallel=2", "model.moe_experts=4 with distributed.tensor_parallel > 1"),
    ("distributed.expert_parallel=3 distributed.zero_stage=3", "distributed.expert_parallel=3 does not divide model.moe_experts=4"),
    ("train.precision=fp16", "model.moe_experts=4 with train.precision=fp16"),
])
def test_an_hf_mixtral_gets_the_checks_of_a_native_moe(tmp_path, change, named):
    """The config checks run on the model that will be trained: continuing a Mixtral (the run config
    has no model.moe_experts) is refused where a native MoE config is, in one line (mlp_chunk_tokens
    was accepted and ignored, tensor_parallel passed the check); expert_parallel=2 is accepted (it
    was refused: "needs a Mixture-of-Experts model"; tests/test_expert_parallel.py trains it)."""
    src = _mixtral_dir(tmp_path / "mixtral")
    proc = run_train(SMALL + [f"checkpoint.init_from={src}", f"data.tokenizer={src}", *change.split(),
                              f"train.run_dir={tmp_path / 'run'}"], check=False, config=CONTINUE)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain: error:")]
    # (with one rank, tensor_parallel=2 is also refused for the world size, in a line of its own)
    assert proc.returncode == 2 and any(named in line for line in lines) and "Traceback" not in proc.stderr, lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train", "eval"])
def test_a_mixtral_config_the_model_cannot_take_is_one_line(tmp_path, command):
    """num_experts_per_tok: 5 with 4 experts ended `pretrain train` and `pretrain eval` in a traceback."""
    src = _mixtral_dir(tmp_path / "mixtral")
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts_per_tok"] = 5
    (src / "config.json").write_text(json.dumps(cfg))
    args = {"train": ["train", str(CONTINUE), *SMALL, f"checkpoint.init_from={src}", f"data.tokenizer={src}",
                      f"train.run_dir={tmp_path / 'run'}"],
            "eval": ["eval", str(src), "--data", "builtin:python-docs"]}[command]
    line = one_error_line(pretrain_cmd(*args, check=False))
    assert "num_experts_per_tok=5 must be between 1 and num_local_experts=4" in line, line
