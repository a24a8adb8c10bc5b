"""The Hugging Face families beside Llama (pretrain/hf/mapping.py): Qwen2 (Qwen2.5), Qwen3, Qwen3-MoE,
OLMo 2, OLMo 3, Gemma 3 (text) and SmolLM3, both ways against transformers' own classes, built from
their config classes (no download).

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
    # Qwen3-MoE: a dense first block (mlp_only_layers), top-2 of 4 experts renormalised, or not
    "qwen3_moe": ("qwen3_moe", dict(head_dim=32, num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen3_moe-unnormalised": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                                 norm_topk_prob=False, tie_word_embeddings=True,
                                                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                                  "original_max_position_embeddings": 16})),
    # OLMo 3: 3 sliding-window blocks to 1 global (its config class's pattern), a window of 8 of the 40
    # tokens; the local blocks' RoPE base its own here (OLMo 3's are equal)
    "olmo3": ("olmo3", dict(num_hidden_layers=4, sliding_window=8,
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # OLMo 3's long-context models: YaRN on the global blocks (an attention factor of its own), none on the local
    "olmo3-yarn": ("olmo3", dict(num_hidden_layers=4, sliding_window=8, rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                           "attention_factor": 1.2, "rope_theta": 500000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
    # Gemma 3: 2 local blocks to 1 global, RoPE bases 10k and 1M, head_dim 32 (not 64 / 4) and the
    # attention scaled by query_pre_attn_scalar 24 (not head_dim), tied
    "gemma3": ("gemma3_text", dict(num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
                                   sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=10000.0)),
    # GPT-OSS: sinks, windows of 8 on alternate blocks, biases on every attention projection, a biased
    # router over 4 experts (2 a token) with biases, the clamped SwiGLU (a limit of 0.4, which the
    # activations cross), YaRN on every block (untruncated)
    "gpt_oss": ("gpt_oss", dict(num_hidden_layers=2, head_dim=16, sliding_window=8, num_local_experts=4,
                                num_experts_per_tok=2, intermediate_size=32, swiglu_limit=0.4,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                 "truncate": False, "original_max_position_embeddings": 16,
                                                 "rope_theta": 150000.0})),
    # SmolLM3: no RoPE in every 2nd block (every 4th in SmolLM3-3B), tied
    "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=2)),
}
CONFIG_CLASSES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "olmo2": "Olmo2Config", "qwen3_moe": "Qwen3MoeConfig",
                  "olmo3": "Olmo3Config", "gemma3_text": "Gemma3TextConfig", "smollm3": "SmolLM3Config",
                  "gpt_oss": "GptOssConfig"}
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


def hf_config(model_type: str, **fields):
    cfg = getattr(transformers, CONFIG_CLASSES[model_type])(**{**COMMON, **fields})
    cfg._attn_implementation = "eager"
    return cfg


def vary_norms_and_biases(named_parameters, seed: int, unit_offset: bool = False) -> None:
    """Norm gains ~ N(1, 0.2) (weights N(0, 0.2) where the norm adds 1: Gemma's), biases ~ N(0, 0.2):
    each piece then changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_parameters:
            if p.dim() == 1 or name.endswith("_bias") or ".experts.b" in name:  # (an MoE's expert biases: (E, ...))
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "norm" in name and not unit_offset else 0.0))


@pytest.fixture(params=sorted(CASES))
def hf_dir(request, tmp_path):
    """(model_type, saved directory, the transformers model in fp32, eval mode)."""
    model_type, fields = CASES[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_config(model_type, **fields)).float().eval()
    vary_norms_and_biases(hf.named_parameters(), seed=1, unit_offset=model_type == "gemma3_text")
    hf.save_pretrained(tmp_path)
    return model_type, tmp_path, hf


def load_ours(path) -> Transformer:
    """Our model from an HF directory, as checkpoint.init_from and `pretrain eval` read it."""
    from pretrain.checkpoint.reshard import persistent_buffers

    args = hub.model_args(path)
    model = Transformer(args)
    state = hub.LazyWeights(path, args).state_dict()
    for name, buffer in persistent_buffers(model):  # (an MoE router's selection bias: no HF family has one)
        state.setdefault(name, buffer)
    model.load_state_dict(state, strict=True)
    return model.eval()


def test_import_gives_transformers_logits(hf_dir):
    """fp32: within 1e-5. bf16 (both models cast): ours no further from the fp32 logits than
    transformers' own bf16 model is (x1.5), and within 0.2 of them (logits reach about 3.5; an MoE's
    0.6)."""
    model_type, path, hf = hf_dir
    ours = load_ours(path)
    for field, value in FAMILIES[model_type].fixed(ours.args).items():
        assert getattr(ours.args, field) == value, field
    head_dim = getattr(hf.config, "head_dim", None) or 16
    assert ours.args.head_size == (0 if head_dim == 16 else head_dim)  # (0: dim / n_heads)
    with torch.no_grad():
        want = hf(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), want, rtol=0, atol=1e-5)
        ours_bf16 = ours.to(torch.bfloat16)(TOKENS).float()
        hf_bf16 = hf.to(torch.bfloat16)(TOKENS).logits.float()
    ours_err, hf_err = (ours_bf16 - want).abs().max().item(), (hf_bf16 - want).abs().max().item()
    # (an MoE's bf16 routing flips a token's experts here and there, in transformers' model too)
    assert ours_err <= max(1.5 * hf_err, 0.02) and ours_err < (0.6 if ours.args.moe_experts else 0.2), (ours_err, hf_err)


def family_args(model_type: str, **kw) -> ModelArgs:
    """A model of the family as ModelArgs states it (the fields from_hf_dict fills, so that the
    config round trip compares whole)."""
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=96, norm_eps=1e-6,
                rope_theta=10000.0, max_seq_len=128, init_std=0.1)
    args = ModelArgs(**{**base, **kw})
    return dataclasses.replace(args, **FAMILIES[model_type].fixed(args))


WINDOWS = dict(sliding_window=8, layer_pattern=["local", "local", "global"], n_layers=3)
EXPORTS = {"qwen2": dict(tie_embeddings=True), "qwen3": dict(head_size=32, n_layers=3), "olmo2": dict(z_loss=1e-5),
           "qwen3_moe": dict(head_size=32, n_layers=3, moe_experts=4, moe_top_k=2, moe_hidden_dim=32,
                             moe_dense_layers=1),
           "olmo3": dict(WINDOWS, rope_local_theta=1000.0, rope_theta=500000.0, rope_scaling_factor=4.0,
                         rope_scaling_type="yarn", rope_original_max_seq_len=16, rope_yarn_attention_factor=1.2),
           "gemma3_text": dict(WINDOWS, head_size=32, query_scale_dim=24, rope_local_theta=10000.0, rope_theta=1e6,
                               tie_embeddings=True),
           "smollm3": dict(n_layers=4, nope_period=2, tie_embeddings=True),
           "gpt_oss": dict(n_layers=2, ffn_hidden_dim=32, moe_experts=4, moe_top_k=2, moe_hidden_dim=32, sliding_window=8,
                           layer_pattern=["local", "global"], rope_scaling_factor=4.0, rope_scaling_type="yarn",
                           rope_original_max_seq_len=16, rope_yarn_truncate=False, rope_local_scaling=True,
                           swiglu_limit=0.4, norm_eps=1e-5)}


@pytest.mark.parametrize("model_type", sorted(EXPORTS))
def test_export_gives_our_logits(model_type, tmp_path):
    """Ours -> to_hf_config + to_hf_state_dict -> the family's transformers class (strict load),
    saved and read back by AutoModelForCausalLM: our logits within 1e-5; the config reads back to
    the same ModelArgs (z_loss, a training setting, aside)."""
    args = family_args(model_type, **EXPORTS[model_type])
    ours = Transformer(args)
    torch.manual_seed(2)
    ours.init_weights()
    vary_norms_and_biases(ours.named_parameters(), seed=3, unit_offset=args.norm_unit_offset)
    ours.eval()
    cfg = to_hf_config(args)
    assert cfg.model_type == model_type and cfg.architectures == [FAMILIES[model_type].architecture]
    assert from_hf_config(cfg) == dataclasses.replace(args, z_loss=0.0)
    save_as_hf(ours.state_dict(), args, tmp_path)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # (every weight read, none missing or left over)
    assert type(hf).__name__ == FAMILIES[model_type].architecture
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(TOKENS).logits, ours(TOKENS), rtol=0, atol=1e-5)


def save_as_hf(state: dict, args: ModelArgs, path) -> None:
    """As `pretrain export` writes a model: config.json, and model.safetensors under the family's names
    (the experts of an MoE one by one, as the hub keeps them; transformers 5 fuses them on load)."""
    from safetensors.torch import save_file

    to_hf_config(args).save_pretrained(path)
    sd = to_hf_state_dict(state, args)
    if args.tie_embeddings:
        sd.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in sd.items()}, path / "model.safetensors")


def test_hf_to_ours_to_hf_is_bitwise(hf_dir):
    """The tensors transformers saved (an MoE's experts one by one, Gemma's norms as w - 1) -> ours
    -> the same names, every tensor bitwise."""
    from safetensors.torch import load_file

    model_type, path, hf = hf_dir
    args = hub.model_args(path)
    hf_sd = load_file(path / "model.safetensors")
    ours = load_ours(path)
    back = to_hf_state_dict(ours.state_dict(), args)
    if args.tie_embeddings:  # (saved once, as the embedding)
        back.pop("lm_head.weight")
    assert back.keys() == hf_sd.keys()
    for name, t in hf_sd.items():
        assert torch.equal(back[name], t), name


# Each family's distinctive pieces: its field, and how a table without it would read the weights
# (the piece's weights dropped, or OLMo 2's post-norms read as Llama's pre-norms).
NO_WINDOW = dict(sliding_window=0, layer_pattern=[])
PIECES = {"qwen2": ["qkv_bias"], "qwen3": ["qk_norm"], "olmo2": ["qk_norm", "norm_placement"],
          "qwen3_moe": ["qk_norm", "moe_norm_topk", "rope_scaling_factor"],
          "olmo3": ["qk_norm", "norm_placement", NO_WINDOW, "rope_local_theta", "rope_scaling_factor"],
          "gemma3_text": ["norm_unit_offset", "embed_scale", "query_scale_dim", "ffn_activation", NO_WINDOW, "norm_placement",
                          "rope_local_theta", "qk_norm"],
          "smollm3": ["nope_period"],
          "gpt_oss": ["attn_sinks", NO_WINDOW, "ffn_activation", {"swiglu_limit": 1e9}, "moe_router_bias",
                      "moe_expert_bias", "rope_scaling_factor", "qkv_bias", "attn_out_bias"]}


def as_pre_norms(name: str) -> str:
    """OLMo 2's post-norms under the names of Llama's pre-norms."""
    return name.replace("attention_out_norm.", "attention_norm.").replace("ffn_out_norm.", "ffn_norm.")


def test_each_distinctive_piece_changes_the_logits(hf_dir):
    """The parity above would catch a piece left out: with any one of them set to Llama's (its
    weights dropped, OLMo's post-norms applied as pre-norms, Gemma's (1 + w) read as w, its windows
    global, its local RoPE base the global one; Qwen3-MoE's renormalisation of the top k the other
    way) the logits are far from HF's."""
    model_type, path, hf = hf_dir
    state = load_ours(path).state_dict()
    args = hub.model_args(path)
    with torch.no_grad():
        want = hf(TOKENS).logits
        for piece in PIECES[model_type]:
            change = piece if isinstance(piece, dict) else {piece: getattr(ModelArgs(), piece)}
            if piece == "moe_norm_topk":  # (either way: the case with, the case without)
                change = {piece: not args.moe_norm_topk}
            if all(getattr(args, k) == v for k, v in change.items()):
                continue  # (a case without the piece: YaRN in one of two OLMo 3 cases)
            without = dataclasses.replace(args, **change)
            model = Transformer(without)
            post = piece == "norm_placement" and args.norm_placement == "post"
            renamed = {as_pre_norms(k): v for k, v in state.items()} if post else state
            model.load_state_dict({k: v for k, v in renamed.items() if k in model.state_dict()}, strict=True)
            assert (model.eval()(TOKENS) - want).abs().max() > 0.1, piece


def test_weights_a_table_lacks_are_refused_not_dropped(hf_dir):
    """Read with the table of a family without the piece (Llama's; Qwen3's for Gemma 3), the family's
    weights are an error naming them, as is a bias on Qwen2's o_proj (transformers' Qwen2 has none).
    (SmolLM3's piece has no weight; Qwen3-MoE's q/k norms are Qwen3's.)"""
    from safetensors.torch import load_file

    model_type, path, hf = hf_dir
    named = {"qwen2": "self_attn.q_proj.bias", "qwen3": "self_attn.q_norm.weight",
             "olmo2": "post_feedforward_layernorm.weight", "olmo3": "post_feedforward_layernorm.weight",
             "gemma3_text": "pre_feedforward_layernorm.weight"}.get(model_type)  # (Gemma 3's, by Qwen3's table)
    if named is None:
        return
    changes = {}
    for piece in PIECES[model_type]:
        if not (model_type == "gemma3_text" and piece == "qk_norm") and piece != "moe_norm_topk":
            changes.update(piece if isinstance(piece, dict) else {piece: getattr(ModelArgs(), piece)})
    llama = dataclasses.replace(hub.model_args(path), **changes)
    with pytest.raises(ValueError, match=f"unexpected state-dict keys: .*{named}"):
        from_hf_state_dict(load_file(path / "model.safetensors"), llama)
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
    pytest.param("qwen2", dict(rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e6}),
                 "RoPE scaling 'longrope'", id="qwen2-longrope"),
    pytest.param("qwen3", dict(rope_parameters=None, rope_theta=1e6, rope_scaling={"type": "dynamic", "factor": 2.0}),
                 "RoPE scaling 'dynamic'", id="qwen3-dynamic-as-4x-writes-it"),
    pytest.param("olmo2", dict(hidden_act="gelu"), "hidden_act='gelu'", id="olmo2-gelu"),
    pytest.param("qwen2", dict(layer_types=["full_attention", "sliding_attention"]),
                 "layer_types ['sliding_attention']", id="qwen2-layer-types"),
    pytest.param("qwen3_moe", dict(num_experts=4, moe_intermediate_size=32, mlp_only_layers=[1]),
                 "dense blocks [1] (mlp_only_layers=[1], decoder_sparse_step=1)", id="qwen3-moe-dense-block-1"),
    pytest.param("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
                                   num_hidden_layers=4), "dense blocks [0, 2]", id="qwen3-moe-sparse-step"),
    pytest.param("gemma3_text", dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0", id="gemma3-softcap"),
    pytest.param("gemma3_text", dict(rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "RoPE scaling 'linear'", id="gemma3-linear"),
    pytest.param("gemma3_text", dict(hidden_activation="gelu"), "hidden_act='gelu'", id="gemma3-gelu"),
    pytest.param("smollm3", dict(no_rope_layers=[0, 1, 1, 1], num_hidden_layers=4), "no_rope_layers=[0, 1, 1, 1]",
                 id="smollm3-nope-list"),
    pytest.param("smollm3", dict(use_sliding_window=True, sliding_window=16), "use_sliding_window=True",
                 id="smollm3-windows"),
    pytest.param("gpt_oss", dict(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": []}),
                 "quantization_config (weights quantized with mxfp4: load the model dequantized", id="gpt-oss-mxfp4"),
    pytest.param("gpt_oss", dict(attention_bias=False), "attention_bias=False", id="gpt-oss-unbiased"),
    pytest.param("olmo3", dict(layer_types=["full_attention", "chunked_attention"]),
                 "layer_types ['chunked_attention']", id="olmo3-chunked"),
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
    pytest.param(dict(nope_period=2, qk_norm="head"), "model.qk_norm='head', model.nope_period=2", id="nope"),
    pytest.param(dict(rope_fraction=0.5), "model.rope_fraction=0.5", id="partial-rope"),
    pytest.param(dict(attn_out_bias=True), "model.attn_out_bias=True", id="wo-bias"),
    pytest.param(dict(qkv_bias=True, qk_norm="head"), "model.qk_norm='head', model.qkv_bias=True",
                 id="qwen2-with-qwen3"),
    pytest.param(dict(norm_placement="post", qk_norm="head"), "model.norm_placement='post', model.qk_norm='head'",
                 id="olmo2-with-qwen3"),
    pytest.param(dict(qk_norm="projection", moe_experts=4), "model.qk_norm='projection' with model.moe_experts=4",
                 id="moe"),
])
def test_a_model_no_family_holds_is_refused_in_one_line(change, named):
    args = family_args("llama", **change)
    for convert in (to_hf_config, lambda a: to_hf_state_dict(Transformer(a).state_dict(), a)):
        with pytest.raises(ValueError) as e:
            convert(args)
        assert named in str(e.value) and "no Hugging Face family holds" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("model_type", sorted(set(EXPORTS) - {"qwen3_moe", "gpt_oss"}))  # (muP's rules for experts: not derived)
def test_a_completep_model_exports_folded_into_its_family(model_type):
    """CompleteP's multipliers (attention scale, residual branch, logits) fold into the weights the
    family has: into q's norm where it has one (in wq the norm would undo it) and into the
    post-norms where there are (in wo and w2 they would be undone too)."""
    args = family_args(model_type, parametrization="completep", mup_base_dim=32, mup_base_layers=1,
                       mup_base_head_dim=8, **{**EXPORTS[model_type], "query_scale_dim": 0})
    ours = Transformer(args)
    torch.manual_seed(4)
    ours.init_weights()
    vary_norms_and_biases(ours.named_parameters(), seed=5, unit_offset=args.norm_unit_offset)
    sd, sp = fold_multipliers(ours.state_dict(), args)
    hf = transformers.AutoModelForCausalLM.from_config(to_hf_config(sp)).float().eval()
    hf.load_state_dict(to_hf_state_dict(sd, sp), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours.eval()(TOKENS), rtol=0, atol=1e-5)


# The published models' config.json fields that set their sizes (from the hub; nothing is downloaded),
# and the configs of ours in their shapes (configs/): one parameter count, one family.
PUBLISHED = {
    "qwen3_0.6b.yaml": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                            tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    "qwen3_30b_a3b.yaml": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                               moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                               num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                               tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               max_position_embeddings=40960),
    "olmo3_7b.yaml": dict(model_type="olmo3", vocab_size=100278, hidden_size=4096, intermediate_size=11008,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, sliding_window=4096,
                          tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-6,
                          max_position_embeddings=65536),
    "gemma3_1b.yaml": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                           num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                           query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                           rope_theta=1000000.0, rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
                           max_position_embeddings=32768),
    "gpt_oss_20b.yaml": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                             num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                             num_local_experts=32, num_experts_per_tok=4, sliding_window=128, swiglu_limit=7.0,
                             rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                              "truncate": False, "original_max_position_embeddings": 4096,
                                              "rope_theta": 150000.0},
                             tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=131072),
    "smollm3_3b.yaml": dict(model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008,
                            num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=4, no_rope_layer_interval=4,
                            tie_word_embeddings=True, rope_theta=5000000.0, rms_norm_eps=1e-6,
                            max_position_embeddings=65536),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_size_has_transformers_parameter_count(name):
    """Each config of configs/ in a published model's shape: its parameters number what transformers
    builds from the published config.json (on the meta device), it is that model's family, and its
    blocks are the ones the config.json reads as."""
    from pathlib import Path

    from pretrain.config import load_config
    from pretrain.hf.mapping import family_of, from_hf_dict
    from pretrain.model.model import num_params

    args = load_config(Path(__file__).parents[2] / "configs" / name).model
    published = PUBLISHED[name]
    family = FAMILIES[published["model_type"]]
    cfg = getattr(transformers, family.config)(**{k: v for k, v in published.items() if k != "model_type"})
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    assert num_params(args) == sum(p.numel() for p in hf.parameters())
    assert family_of(args) is family
    read = from_hf_dict({**cfg.to_dict(), "model_type": published["model_type"]})
    fields = {f.name for f in dataclasses.fields(ModelArgs)} - {"max_seq_len", "init_std", "moe_aux_loss", "z_loss"}
    assert {f: getattr(read, f) for f in fields} == {f: getattr(args, f) for f in fields}


@pytest.mark.parametrize("change,named", [
    (dict(rope_local_theta=1000.0), "no Hugging Face family holds model.qkv_bias=True, model.attn_out_bias=True, "
                                    "model.attn_sinks=True, model.sliding_window=8, model.layer_pattern=['local', "
                                    "'global'], model.rope_local_theta=1000.0"),
    (dict(rope_local_scaling=False), "not a GPT-OSS: its layers share one RoPE"),
    (dict(moe_dense_layers=1), "model.moe_dense_layers=1 (every GPT-OSS block is MoE)"),
    (dict(moe_norm_topk=False), "GPT-OSS's router is a softmax whose top-k weights are renormalised"),
    (dict(moe_shared_experts=1), "model.moe_shared_experts=1 (GPT-OSS has no shared expert)"),
])
def test_a_model_gpt_oss_cannot_hold_is_refused_in_one_line(change, named):
    """GPT-OSS's config has one RoPE for every layer (its YaRN on the local ones too) and MoE blocks
    only, routed by the softmax of the top k logits."""
    args = family_args("gpt_oss", **{**EXPORTS["gpt_oss"], **change})
    with pytest.raises(ValueError) as e:
        to_hf_config(args)
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)
