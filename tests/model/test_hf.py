"""Parity and lossless conversion against transformers' LlamaForCausalLM (built from config, no download)."""

import dataclasses

import pytest
import torch

from pretrain.hf.mapping import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict
from pretrain.model.args import ModelArgs
from pretrain.model.model import Transformer, num_params

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "gqa": dict(n_heads=4, n_kv_heads=2),
    "mha": dict(n_heads=4, n_kv_heads=0),
    "tied": dict(n_heads=4, n_kv_heads=1, tie_embeddings=True),
}


def tiny(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=2, vocab_size=256, multiple_of=32, max_seq_len=64, rope_theta=5e5, norm_eps=1e-6)
    return ModelArgs(**{**base, **kw})


def hf_model(args, attn="eager"):
    cfg = to_hf_config(args)
    cfg._attn_implementation = attn
    return transformers.LlamaForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_logits_match_hf(config, attn):
    args = tiny(**CONFIGS[config])
    ours = Transformer(args)
    torch.manual_seed(0)
    ours.init_weights()
    hf = hf_model(args, attn)
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), args), strict=True)
    if args.tie_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    tokens = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_hf_to_ours_to_hf_is_lossless(config):
    args = tiny(**CONFIGS[config])
    torch.manual_seed(1)
    hf_sd = hf_model(args).state_dict()
    ours = Transformer(args)
    ours.load_state_dict(from_hf_state_dict(hf_sd, args), strict=True)
    back = to_hf_state_dict(ours.state_dict(), args)
    assert back.keys() == hf_sd.keys()
    for name, t in hf_sd.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_ours_to_hf_to_ours_is_lossless(config):
    args = tiny(**CONFIGS[config])
    ours = Transformer(args)
    torch.manual_seed(2)
    ours.init_weights()
    hf = hf_model(args)
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), args), strict=True)
    back = from_hf_state_dict(hf.state_dict(), args)
    sd = ours.state_dict()
    assert back.keys() == sd.keys()
    for name, t in sd.items():
        assert torch.equal(back[name], t), name


def test_tied_checkpoint_without_lm_head_loads():
    args = tiny(**CONFIGS["tied"])
    hf_sd = dict(hf_model(args).state_dict())
    del hf_sd["lm_head.weight"]  # save_pretrained drops tied copies
    ours = Transformer(args)
    ours.load_state_dict(from_hf_state_dict(hf_sd, args), strict=True)
    assert ours.output.weight is ours.tok_embeddings.weight


def test_config_round_trip():
    args = tiny(n_heads=8, n_kv_heads=2, tie_embeddings=True)
    cfg = to_hf_config(args)
    assert (cfg.intermediate_size, cfg.num_key_value_heads, cfg.attention_bias, cfg.mlp_bias) == (
        args.hidden_dim, 2, False, False)
    back = from_hf_config(cfg)
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "hidden_dim", "norm_eps",
                  "rope_theta", "max_seq_len", "tie_embeddings", "init_std"):
        assert getattr(back, field) == getattr(args, field), field
    assert num_params(back) == num_params(args) == sum(p.numel() for p in hf_model(args).parameters())


def test_unsupported_hf_config_is_refused():
    cfg = to_hf_config(tiny())
    cfg.attention_bias = True
    with pytest.raises(ValueError, match="bias"):
        from_hf_config(cfg)


def test_unknown_keys_are_refused():
    args = tiny()
    sd = Transformer(args).state_dict()
    sd["layers.0.attention.wq.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match="wq.bias"):
        to_hf_state_dict(sd, args)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def llama31_style(tied=False):
    """A Llama 3.1-style HF model: llama3 RoPE scaling from an original context of 32 to 256."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=500000.0, rope_scaling=dict(LLAMA3), tie_word_embeddings=tied,
                                   rms_norm_eps=1e-5)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float().eval()


@pytest.mark.parametrize("tied", [False, True])
def test_llama3_rope_scaling_matches_hf_past_the_original_context(tied):
    hf = llama31_style(tied)
    args = from_hf_config(hf.config)
    assert (args.rope_scaling_factor, args.rope_original_max_seq_len) == (8.0, 32)
    ours = Transformer(args)
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=True)
    ours.eval()
    tokens = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(1))  # 200 > 32
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
    # Without the scaling the logits past position 32 are not HF's: the test sees the difference.
    plain = Transformer(dataclasses.replace(args, rope_scaling_factor=0.0))
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (plain(tokens)[:, 40:] - hf(tokens).logits[:, 40:]).abs().max() > 1e-3
    # Greedy generation with the KV cache gives HF's tokens, well past the original context.
    from pretrain.model.generate import sample

    prompt = tokens[0, :20].tolist()
    got = sample(ours, prompt, 100, temperature=0.0)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=100, do_sample=False, min_new_tokens=100,
                       pad_token_id=0)[0, 20:].tolist()
    assert got == want


def test_config_json_of_4x_and_5x_read_the_same():
    """transformers 4.x writes `rope_theta` and `rope_scaling`, 5.x `rope_parameters`."""
    from pretrain.hf.mapping import from_hf_dict

    base = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, intermediate_size=160, vocab_size=256, max_position_embeddings=256)
    v4 = from_hf_dict({**base, "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3)})
    v5 = from_hf_dict({**base, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}})
    assert v4 == v5 and v4.rope_theta == 500000.0 and v4.rope_scaling_factor == 8.0


# YaRN as Qwen3 (truncated ramp, attention factor from the factor), GPT-OSS (no truncation) and OLMo 3
# (an attention factor of its own) set it
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
YARNS = {"qwen3": YARN, "untruncated": {**YARN, "truncate": False, "beta_fast": 16.0, "beta_slow": 2.0},
         "attention-factor": {**YARN, "factor": 4.0, "attention_factor": 1.2}}


@pytest.mark.parametrize("case", sorted(YARNS))
def test_yarn_rope_scaling_matches_hf_past_the_original_context(case):
    """The table against transformers' own YaRN (inverse frequencies and attention factor), and a
    Llama with YaRN both ways: its logits within 1e-5 over 200 positions (64 trained), greedy
    generation with the KV cache giving transformers' tokens; without the scaling, other logits. (At
    base 10,000 and 64 tokens trained, the ramp's ends are fractional: truncating them matters.)"""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pretrain.model.rope import precompute_freqs_cis

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, rope_scaling=dict(YARNS[case]), rms_norm_eps=1e-5)
    cfg._attn_implementation = "eager"
    args = from_hf_config(cfg)
    assert (args.rope_scaling_type, args.rope_scaling_factor, args.rope_original_max_seq_len) == \
        ("yarn", YARNS[case]["factor"], 64)
    inv_freq, gain = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    table = precompute_freqs_cis(16, 256, 10000.0, args.rope_scaling)
    angles = torch.outer(torch.arange(256, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(table, torch.stack((angles.cos() * gain, angles.sin() * gain), -1), rtol=0, atol=1e-6)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    ours = Transformer(args)
    ours.load_state_dict(from_hf_state_dict(hf.state_dict(), args), strict=True)
    ours.eval()
    back = to_hf_config(args).to_dict()["rope_parameters"]
    assert {k: back[k] for k in YARNS[case]} == YARNS[case]
    tokens = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)
        plain = Transformer(dataclasses.replace(args, rope_scaling_factor=0.0))
        plain.load_state_dict(ours.state_dict())
        assert (plain(tokens) - hf(tokens).logits).abs().max() > 1e-3
    from pretrain.model.generate import sample

    prompt = tokens[0, :20].tolist()
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False, min_new_tokens=60,
                       pad_token_id=0)[0, 20:].tolist()
    assert sample(ours, prompt, 60, temperature=0.0) == want
