"""The Hugging Face families beside Llama (pretrain/hf/mapping.py): Qwen2 (Qwen2.5), Qwen3 and OLMo 2,
both ways against transformers' own classes, built from their config classes (no download).

Each transformers model is random with its norms and biases drawn away from 1 and 0 (as built they
are 1 and 0: a dropped norm or bias would compute the same), saved with save_pretrained, and read
through the path `pretrain train` (checkpoint.init_from) and `pretrain eval` take: hub.model_args and
hub.LazyWeights."""

import dataclasses

import pytest
import torch

from pretrain.hf import hub
from pretrain.hf.mapping import (FAMILIES, fold_multipliers, from_hf_config, from_hf_state_dict, to_hf_config,
                                 to_hf_state_dict)
from pretrain.model.args import ModelArgs
from pretrain.model.model import Transformer

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
              initializer_range=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=None)
# case -> (model_type, config fields): Qwen2.5 and Qwen3 tie their embeddings at the small sizes and
# not at the large ones; OLMo 2 never does. Qwen3's head_dim (32) is not hidden_size / heads (16).
CASES = {
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-mha": ("qwen2", dict(num_key_value_heads=4)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3-tied": ("qwen3", dict(head_dim=32, tie_word_embeddings=True, num_hidden_layers=3)),
    "olmo2": ("olmo2", dict(num_hidden_layers=3)),
}
CONFIG_CLASSES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "olmo2": "Olmo2Config"}
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def hf_config(model_type: str, **fields):
    cfg = getattr(transformers, CONFIG_CLASSES[model_type])(**{**COMMON, **fields})
    cfg._attn_implementation = "eager"
    return cfg


def vary_norms_and_biases(named_parameters, seed: int) -> None:
    """Norm weights ~ N(1, 0.2), biases ~ N(0, 0.2): each piece then changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_parameters:
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "norm" in name else 0.0))


@pytest.fixture(params=sorted(CASES))
def hf_dir(request, tmp_path):
    """(model_type, saved directory, the transformers model in fp32, eval mode)."""
    model_type, fields = CASES[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(model_type, **fields)).float().eval()
    vary_norms_and_biases(hf.named_parameters(), seed=1)
    hf.save_pretrained(tmp_path)
    return model_type, tmp_path, hf


def load_ours(path) -> Transformer:
    """Our model from an HF directory, as checkpoint.init_from and `pretrain eval` read it."""
    args = hub.model_args(path)
    model = Transformer(args)
    model.load_state_dict(hub.LazyWeights(path, args).state_dict(), strict=True)
    return model.eval()


def test_import_gives_transformers_logits(hf_dir):
    """fp32: within 1e-5. bf16 (both models cast): ours no further from the fp32 logits than
    transformers' own bf16 model is (x1.5), and within 0.2 of them (logits reach about 3.5)."""
    model_type, path, hf = hf_dir
    ours = load_ours(path)
    for field, value in FAMILIES[model_type].args.items():
        assert getattr(ours.args, field) == value, field
    assert ours.args.head_size == (32 if model_type == "qwen3" else 0)  # (0: dim / n_heads)
    with torch.no_grad():
        want = hf(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), want, rtol=0, atol=1e-5)
        ours_bf16 = ours.to(torch.bfloat16)(TOKENS).float()
        hf_bf16 = hf.to(torch.bfloat16)(TOKENS).logits.float()
    ours_err, hf_err = (ours_bf16 - want).abs().max().item(), (hf_bf16 - want).abs().max().item()
    assert ours_err <= max(1.5 * hf_err, 0.02) and ours_err < 0.2, (ours_err, hf_err)


def family_args(model_type: str, **kw) -> ModelArgs:
    """A model of the family as ModelArgs states it (the fields from_hf_dict fills, so that the
    config round trip compares whole)."""
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=96, norm_eps=1e-6,
                rope_theta=10000.0, max_seq_len=128, init_std=0.1)
    return ModelArgs(**{**base, **FAMILIES[model_type].args, **kw})


EXPORTS = {"qwen2": dict(tie_embeddings=True), "qwen3": dict(head_size=32, n_layers=3), "olmo2": dict(z_loss=1e-5)}


@pytest.mark.parametrize("model_type", sorted(EXPORTS))
def test_export_gives_our_logits(model_type, tmp_path):
    """Ours -> to_hf_config + to_hf_state_dict -> the family's transformers class (strict load),
    saved and read back by AutoModelForCausalLM: our logits within 1e-5; the config reads back to
    the same ModelArgs (z_loss, a training setting, aside)."""
    args = family_args(model_type, **EXPORTS[model_type])
    ours = Transformer(args)
    torch.manual_seed(2)
    ours.init_weights()
    vary_norms_and_biases(ours.named_parameters(), seed=3)
    ours.eval()
    cfg = to_hf_config(args)
    assert cfg.model_type == model_type and cfg.architectures == [FAMILIES[model_type].architecture]
    assert from_hf_config(cfg) == dataclasses.replace(args, z_loss=0.0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), args), strict=True)
    hf.save_pretrained(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == FAMILIES[model_type].architecture
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours(TOKENS), rtol=0, atol=1e-5)


def test_hf_to_ours_to_hf_is_bitwise(hf_dir):
    model_type, path, hf = hf_dir
    args = hub.model_args(path)
    hf_sd = hf.state_dict()
    ours = Transformer(args)
    ours.load_state_dict(from_hf_state_dict(hf_sd, args), strict=True)
    back = to_hf_state_dict(ours.state_dict(), args)
    assert back.keys() == hf_sd.keys()
    for name, t in hf_sd.items():
        assert torch.equal(back[name], t), name


# Each family's distinctive pieces: its field, and how a table without it would read the weights
# (the piece's weights dropped, or OLMo 2's post-norms read as Llama's pre-norms).
PIECES = {"qwen2": ["qkv_bias"], "qwen3": ["qk_norm"], "olmo2": ["qk_norm", "norm_placement"]}


def as_pre_norms(name: str) -> str:
    """OLMo 2's post-norms under the names of Llama's pre-norms."""
    return name.replace("attention_out_norm.", "attention_norm.").replace("ffn_out_norm.", "ffn_norm.")


def test_each_distinctive_piece_changes_the_logits(hf_dir):
    """The parity above would catch a piece left out: with any one of them set to Llama's (its
    weights dropped, or OLMo 2's post-norms applied as pre-norms) the logits are far from HF's."""
    model_type, path, hf = hf_dir
    args = hub.model_args(path)
    state = hub.LazyWeights(path, args).state_dict()
    with torch.no_grad():
        want = hf(TOKENS).logits
        for piece in PIECES[model_type]:
            without = dataclasses.replace(args, **{piece: getattr(ModelArgs(), piece)})
            model = Transformer(without)
            renamed = {as_pre_norms(k): v for k, v in state.items()} if piece == "norm_placement" else state
            model.load_state_dict({k: v for k, v in renamed.items() if k in model.state_dict()}, strict=True)
            assert (model.eval()(TOKENS) - want).abs().max() > 0.1, piece


def test_weights_a_table_lacks_are_refused_not_dropped(hf_dir):
    """Read with Llama's table (a family without the piece), the family's weights are an error
    naming them, as is a bias on Qwen2's o_proj (transformers' Qwen2 has none)."""
    model_type, path, hf = hf_dir
    named = {"qwen2": "self_attn.q_proj.bias", "qwen3": "self_attn.q_norm.weight",
             "olmo2": "post_feedforward_layernorm.weight"}[model_type]
    llama = dataclasses.replace(hub.model_args(path), **{p: getattr(ModelArgs(), p) for p in PIECES[model_type]})
    with pytest.raises(ValueError, match=f"unexpected state-dict keys: .*{named}"):
        from_hf_state_dict(hf.state_dict(), llama)
    if model_type == "qwen2":
        sd = {**hf.state_dict(), "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
        with pytest.raises(ValueError, match="o_proj.bias"):
            from_hf_state_dict(sd, hub.model_args(path))


SLIDING = dict(use_sliding_window=True, sliding_window=32, max_window_layers=1)


@pytest.mark.parametrize("model_type,change,named", [
    pytest.param("qwen2", SLIDING, "use_sliding_window=True (sliding-window attention (sliding_window=32) from "
                 "block max_window_layers=1 on)", id="qwen2-sliding-window"),
    pytest.param("qwen3", SLIDING, "use_sliding_window=True", id="qwen3-sliding-window"),
    pytest.param("qwen3", dict(attention_bias=True), "attention_bias=True (biases on q_proj, k_proj, v_proj and "
                 "o_proj)", id="qwen3-attention-bias"),
    pytest.param("olmo2", dict(attention_bias=True), "attention_bias=True", id="olmo2-attention-bias"),
    pytest.param("qwen2", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
                 "RoPE scaling 'yarn'", id="qwen2-yarn"),
    pytest.param("qwen3", dict(rope_parameters=None, rope_theta=1e6, rope_scaling={"type": "dynamic", "factor": 2.0}),
                 "RoPE scaling 'dynamic'", id="qwen3-dynamic-as-4x-writes-it"),
    pytest.param("olmo2", dict(hidden_act="gelu"), "hidden_act='gelu'", id="olmo2-gelu"),
    pytest.param("qwen2", dict(layer_types=["full_attention", "sliding_attention"]),
                 "layer_types ['sliding_attention']", id="qwen2-layer-types"),
    pytest.param("qwen3", dict(model_type="qwen3_moe"), "model_type 'qwen3_moe'", id="qwen3-moe"),
])
def test_what_a_family_has_and_we_lack_is_refused_in_one_line(tmp_path, model_type, change, named):
    """config.json as transformers writes it, with the change: hub.model_args refuses it in one line
    naming the field."""
    import json

    from pretrain.errors import CheckpointError

    raw = {**hf_config(model_type).to_dict(), "model_type": model_type}
    raw.pop("_attn_implementation", None)
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(CheckpointError) as e:
        hub.model_args(tmp_path)
    assert named in str(e.value) and "not supported" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_qwen2_5_config_json_loads_without_its_unused_window():
    """Qwen2.5's config.json names a sliding_window and max_window_layers with use_sliding_window
    false: they are not in use, and it loads (a Mistral's sliding_window is refused)."""
    from pretrain.hf.mapping import from_hf_dict

    raw = dict(model_type="qwen2", hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
               num_hidden_layers=24, intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
               rms_norm_eps=1e-6, rope_theta=1000000.0, sliding_window=32768, max_window_layers=21,
               use_sliding_window=False, tie_word_embeddings=True, hidden_act="silu")
    args = from_hf_dict(raw)
    assert args.qkv_bias and args.head_dim == 64 and args.kv_heads == 2 and args.rope_theta == 1e6
    assert args.tie_embeddings and not args.sliding_window
    with pytest.raises(ValueError, match=r"sliding_window=32768 \(sliding-window attention\)"):
        from_hf_dict({**raw, "model_type": "mistral"})


@pytest.mark.parametrize("change,named", [
    pytest.param(dict(attn_sinks=True), "model.attn_sinks=True", id="sinks"),
    pytest.param(dict(sliding_window=16, layer_pattern=["local", "global"]), "model.sliding_window=16", id="window"),
    pytest.param(dict(norm_placement="sandwich"), "model.norm_placement='sandwich'", id="sandwich"),
    pytest.param(dict(ffn_activation="gelu_tanh"), "model.ffn_activation='gelu_tanh'", id="geglu"),
    pytest.param(dict(embed_scale=8.0), "model.embed_scale=8.0", id="embed-scale"),
    pytest.param(dict(nope_period=2), "model.nope_period=2", id="nope"),
    pytest.param(dict(rope_fraction=0.5), "model.rope_fraction=0.5", id="partial-rope"),
    pytest.param(dict(attn_out_bias=True), "model.attn_out_bias=True", id="wo-bias"),
    pytest.param(dict(qkv_bias=True, qk_norm="head"), "model.qk_norm='head', model.qkv_bias=True",
                 id="qwen2-with-qwen3"),
    pytest.param(dict(norm_placement="post", qk_norm="head"), "model.norm_placement='post', model.qk_norm='head'",
                 id="olmo2-with-qwen3"),
    pytest.param(dict(qk_norm="head", moe_experts=4), "model.qk_norm='head' with model.moe_experts=4", id="moe"),
])
def test_a_model_no_family_holds_is_refused_in_one_line(change, named):
    args = family_args("llama", **change)
    for convert in (to_hf_config, lambda a: to_hf_state_dict(Transformer(a).state_dict(), a)):
        with pytest.raises(ValueError) as e:
            convert(args)
        assert named in str(e.value) and "no Hugging Face family holds" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", sorted(EXPORTS))
def test_a_completep_model_exports_folded_into_its_family(model_type):
    """CompleteP's multipliers (attention scale, residual branch, logits) fold into the weights the
    family has: into q's norm where it has one (in wq the norm would undo it) and into the
    post-norms where there are (in wo and w2 they would be undone too)."""
    args = family_args(model_type, parametrization="completep", mup_base_dim=32, mup_base_layers=1,
                       mup_base_head_dim=8, **EXPORTS[model_type])
    ours = Transformer(args)
    torch.manual_seed(4)
    ours.init_weights()
    vary_norms_and_biases(ours.named_parameters(), seed=5)
    sd, sp = fold_multipliers(ours.state_dict(), args)
    hf = transformers.AutoModelForCausalLM.from_config(to_hf_config(sp)).float().eval()
    hf.load_state_dict(to_hf_state_dict(sd, sp), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours.eval()(TOKENS), rtol=0, atol=1e-5)
