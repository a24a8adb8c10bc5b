"""Context extension (docs/long_context.md): a checkpoint trained at S tokens continued at 4S through
checkpoint.init_from with a larger rope_theta, or llama3 RoPE scaling. `pretrain eval --by-position`
shows the loss past S fall, the same at 1 and 2 ranks; only the RoPE settings and max_seq_len may
change; the extended checkpoints export to transformers with our logits."""

import json

import pytest
import torch

import helpers
from helpers import REPO, free_port, run_train

S = 32  # the context of the base run; extended to 4 S
# (the 512-token vocabulary: a cheaper output layer; the tiny model's 4 layers and head_dim 32 kept, as
# a 2-layer, 64-wide one used its context too little for the margins below)
COMMON = ["logging.wandb=disabled", "train.eval_every=0", "schedule.warmup_steps=10",
          "data.tokenizer=builtin:python-bpe-512"]
# 200 steps of 1,024 tokens: enough for the model to use its context, so that positions it never saw
# cost it something. Measured at train.seed 42 and 1: the base model's loss past S 0.12 above its loss
# within S; the extension's 50 steps lower it by 0.24 past S and by 0.08 within S (past - within: 0.16,
# twice the 0.08 asked). 150 and 40 steps left past - within at 0.09.
BASE = COMMON + [f"data.seq_len={S}", f"model.max_seq_len={S}", "train.micro_batch_size=32", "train.max_steps=200"]
EXTEND = COMMON + [f"data.seq_len={4 * S}", f"model.max_seq_len={4 * S}", "train.micro_batch_size=8",
                   "optimizer.lr=1e-3", "schedule.min_lr=1e-4"]
THETA = 44000.0  # the ratio rule: 10000 x 4^(hd / (hd - 2)) = 43,870 at head_dim 32 (configs/extend_tiny.yaml)
LLAMA3 = ["model.rope_scaling_factor=4", f"model.rope_original_max_seq_len={S}", "model.rope_low_freq_factor=1",
          "model.rope_high_freq_factor=4"]


def pretrain(*args, nproc=1, check=True):
    return helpers.pretrain(list(args), nproc=nproc, check=check)


def by_position(tmp_path, model, *args, nproc=1) -> dict:
    out = tmp_path / f"eval-{free_port()}.json"
    pretrain("eval", str(model), *args, "--json", str(out), nproc=nproc)
    return json.loads(out.read_text())


def mean_loss(buckets: list[dict]) -> float:
    return sum(b["loss"] * b["tokens"] for b in buckets) / sum(b["tokens"] for b in buckets)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The base run at S tokens, and its checkpoint continued at 4 S with rope_theta raised (50 steps
    of the same 1,024 tokens) and with llama3 scaling (3 steps: for the export)."""
    d = tmp_path_factory.mktemp("ctx")
    run_train(BASE + [f"train.run_dir={d / 'base'}"])
    init = f"checkpoint.init_from={d / 'base' / 'checkpoints'}"
    run_train(EXTEND + [init, f"model.rope_theta={THETA}", "train.max_steps=50", f"train.run_dir={d / 'theta'}"])
    run_train(EXTEND + [init, *LLAMA3, "train.max_steps=3", f"train.run_dir={d / 'llama3'}"])
    return d


@pytest.mark.slow
def test_loss_past_the_old_context_falls_after_extension(runs, tmp_path):
    """The base checkpoint scored at 4 S (max_seq_len raised for the eval) against the extended one,
    per bucket of S positions: past S the loss falls by far more than within the first S (which
    the base run trained), and the base model is worse past S than within it."""
    before = by_position(tmp_path, runs / "base", f"data.seq_len={4 * S}", f"model.max_seq_len={4 * S}",
                         "--by-position", str(S))
    after = by_position(tmp_path, runs / "theta", "--by-position", str(S))
    assert before["model_overrides"] == {"max_seq_len": 4 * S} and "model_overrides" not in after
    assert [(b["start"], b["end"]) for b in after["by_position"]] == [(i * S, (i + 1) * S) for i in range(4)]
    assert before["sequences"] == after["sequences"] > 50  # the same windows
    within = before["by_position"][0]["loss"] - after["by_position"][0]["loss"]
    past = mean_loss(before["by_position"][1:]) - mean_loss(after["by_position"][1:])
    print(f"loss by position before: {[round(b['loss'], 4) for b in before['by_position']]}, after: "
          f"{[round(b['loss'], 4) for b in after['by_position']]}; drop within S {within:.4f}, past S {past:.4f}")
    assert past > 0.08 and past > within + 0.08
    assert mean_loss(before["by_position"][1:]) > before["by_position"][0]["loss"]


@pytest.mark.slow
def test_by_position_is_the_same_at_one_and_two_ranks_and_a_bad_width_is_one_line(runs, tmp_path):
    one = by_position(tmp_path, runs / "theta", "--by-position", "24")
    two = by_position(tmp_path, runs / "theta", "--by-position", "24", nproc=2)
    assert two["world_size"] == 2 and len(one["by_position"]) == 6 and one["by_position"][-1]["end"] == 4 * S
    assert [{**b, "loss": 0} for b in two["by_position"]] == [{**b, "loss": 0} for b in one["by_position"]]
    for a, b in zip(two["by_position"], one["by_position"]):  # float64 sums of the same fp32 losses (measured:
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12)  # equal to the bit)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    proc = pretrain("eval", str(runs / "theta"), "--by-position", "-1", nproc=2, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain: error:")]
    assert proc.returncode != 0  # (torchrun exits 1 for any failed worker, with its own report)
    assert lines == ["pretrain: error: --by-position -1: give a bucket width in tokens >= 1 (0 = off)"], proc.stderr


@pytest.mark.slow
def test_only_rope_and_max_seq_len_may_change_when_continuing_a_checkpoint(runs, tmp_path):
    """The extension runs above changed max_seq_len, rope_theta and the llama3 fields; a change of
    shape along with them is refused in one line that names it (and not the RoPE change)."""
    proc = run_train(EXTEND + [f"checkpoint.init_from={runs / 'base' / 'checkpoints'}", f"model.rope_theta={THETA}",
                               "model.n_layers=3", f"train.run_dir={tmp_path / 'run'}"], check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain: error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "another model shape (n_layers: checkpoint 4 vs config 3)" in lines[0] and "rope" not in lines[0]
    for name, rope in (("theta", {"rope_theta": THETA}), ("llama3", {"rope_scaling_factor": 4.0})):
        meta = json.loads(sorted((runs / name / "checkpoints").glob("step_*/meta.json"))[-1].read_text())
        assert meta["model_function"].items() >= rope.items()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["theta", "llama3"])
def test_an_extended_checkpoint_exports_to_transformers_with_our_logits(runs, tmp_path, monkeypatch, name):
    """4 S tokens of held-out text through the export in transformers (fp32, offline) and through our
    model: the same logits within 1e-5, past the base run's context too."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import data_pipeline as dp
    from pretrain.config import load_config
    from pretrain.hf.export import export, load_for_inference

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = export(str(runs / name / "checkpoints"), str(tmp_path / "hf"))
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.max_position_embeddings == 4 * S
    rope = cfg.rope_parameters
    if name == "theta":
        assert rope["rope_theta"] == THETA and rope["rope_type"] == "default"
    else:
        assert rope["rope_type"] == "llama3" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == S
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours, tokenizer, _ = load_for_inference(str(runs / name / "checkpoints"))
    data = load_config(REPO / "configs" / "tiny.yaml", [f"data.seq_len={4 * S}"]).data
    window = next(iter(dp.evaluation_windows(data, tokenizer)))
    x = torch.from_numpy(window[None, :-1].astype("int64"))
    with torch.no_grad():
        want, got = ours(x), hf(x).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_hugging_face_model_may_be_continued_with_other_rope_settings(tmp_path):
    """checkpoint.init_from = an HF model directory: model.max_seq_len and the RoPE settings of the
    run config replace config.json's; another width is still refused in one line."""
    from pretrain.build import hf_model_args
    from pretrain.config import load_config
    from pretrain.errors import ConfigError

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 256,
        "rope_theta": 50000.0}))
    (hf / "model.safetensors").write_bytes(b"")  # (only its presence is looked at here)
    tokenizer = REPO / "data_pipeline" / "assets" / "python-docs-bpe.json"
    base = [f"checkpoint.init_from={hf}", f"data.tokenizer={tokenizer}", "data.seq_len=1024"]
    args = hf_model_args(load_config(REPO / "configs" / "continue_smollm2.yaml",
                                     base + ["model.max_seq_len=1024", "model.rope_theta=200000", *LLAMA3]))
    assert (args.dim, args.max_seq_len, args.rope_theta, args.rope_scaling_factor) == (64, 1024, 200000.0, 4.0)
    assert args.rope_original_max_seq_len == S
    kept = hf_model_args(load_config(REPO / "configs" / "continue_smollm2.yaml", base + ["model.max_seq_len=1024"]))
    assert (kept.rope_theta, kept.rope_scaling_factor) == (50000.0, 0.0)
    with pytest.raises(ConfigError, match=r"differs in model.dim=128 \(config.json: 64\):"):
        hf_model_args(load_config(REPO / "configs" / "continue_smollm2.yaml",
                                  base + ["model.max_seq_len=1024", "model.rope_theta=200000", "model.dim=128"]))
    # The output z-loss is a loss weight, the run config's (OLMo 2 continues with 1e-5); the per-layer
    # description is config.json's: another one is refused, not mixed in.
    assert hf_model_args(load_config(REPO / "configs" / "continue_smollm2.yaml",
                                     base + ["model.max_seq_len=1024", "model.z_loss=1e-5"])).z_loss == 1e-5
    with pytest.raises(ConfigError, match=r"differs in model.qk_norm=head \(config.json: none\):"):
        hf_model_args(load_config(REPO / "configs" / "continue_smollm2.yaml",
                                  base + ["model.max_seq_len=1024", "model.qk_norm=head"]))
