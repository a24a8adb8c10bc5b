"""Conversion between our model and Hugging Face transformers (config and state dict), one small
table per family: Llama, Mistral, Mixtral, Qwen2 (Qwen2.5), Qwen3 and OLMo 2.

A family is data, not a model class: one ModelArgs model computes them all (litgpt keeps one model
and a registry of configs; torchtitan a state-dict adapter per family). A `Family` row holds its
model_type and transformers classes, the ModelArgs fields its architecture sets (the rest are
Llama's), the config.json fields it may set to ask for what this model lacks (refused by name on
import, written "off" on export), and its per-block weight names. Our RoPE uses HF's rotate-half
layout and our RMSNorm scales by its weight as HF's does, so weights copy across unchanged: only
names differ. Mixtral's experts, one tensor each in HF, are stacked into ours: the one transform.
A muP or CompleteP model's multipliers are folded into its weights first (`fold_multipliers`), so
the export is a plain model of its family that computes the same logits.
`transformers` is imported lazily, so the rest of the model package does not need it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from dataclasses import dataclass, field

import torch

from pretrain.model.args import RECIPE_FIELDS, ModelArgs

# Per-block weight names, ours -> HF's, under `layers.{i}.` and `model.layers.{i}.`: the pieces a
# family's table is made of.
_ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
_QKV_BIAS = {
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
}
_QK_NORM = {  # (per head in Qwen3, over the whole projection in OLMo 2: the same names)
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_MLP = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_PRE_NORMS = {  # Llama: before each sublayer
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_POST_NORMS = {  # OLMo 2: after each sublayer, on its output (the same HF name as Llama's ffn_norm)
    "attention_out_norm.weight": "post_attention_layernorm.weight",
    "ffn_out_norm.weight": "post_feedforward_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_GEMMA_NORMS = {  # Gemma's sandwich: four norms a block, each (1 + w) with w stored (model.norm_unit_offset)
    "attention_norm.weight": "input_layernorm.weight",
    "attention_out_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_out_norm.weight": "post_feedforward_layernorm.weight",
}

_SLIDING = "sliding-window attention"
_QWEN_WINDOWS = _SLIDING + " (sliding_window={sliding_window}) from block max_window_layers={max_window_layers} on"
_BIASES = "biases on q_proj, k_proj, v_proj and o_proj"
_WINDOWS = ("sliding_window", "layer_pattern", "rope_local_theta")  # a family that reads `layer_types` sets these
# model.ffn_activation -> HF's name (GPT-OSS's config says silu for its clamped SwiGLU)
_ACTIVATIONS = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "clamped_swiglu": "silu"}


@dataclass(frozen=True)
class Experts:
    """How a family names an MoE block's weights: each expert's matrices under their own names (as the
    hub's checkpoints keep them; transformers 5 fuses them on load), stacked (E, ...) in ours."""

    prefix: str  # under model.layers.{i}.
    names: dict[str, str] = field(default_factory=dict)  # our w1 (gate), w2 (down), w3 (up) -> HF's
    router: str = "gate.weight"
    # GPT-OSS's instead: every expert in one tensor, gate and up interleaved, with biases
    # (gate_up_proj (E, D, 2H), gate_up_proj_bias, down_proj (E, H, D), down_proj_bias), a biased router
    fused: bool = False


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture, as data."""

    name: str  # as messages and docs name it
    config: str  # the transformers config class
    architecture: str  # the transformers model class (config.json's `architectures`)
    block: dict[str, str]  # each block's weights: our name -> HF's (MoE experts: `experts`)
    # The ModelArgs fields its architecture fixes (the rest are Llama's, or `free`); a value may be a
    # function of the model's args (Gemma's embedding scale is sqrt(dim)).
    args: dict = field(default_factory=dict)
    free: tuple = ()  # the per-layer fields it holds at any value (sliding windows, NoPE period, ...)
    # config.json fields that ask for what this model lacks: name -> (its value when off, what it asks for)
    off: dict[str, tuple] = field(default_factory=dict)
    experts: Experts | None = None  # an MoE family: its expert weights' names
    needs: tuple = ()  # config.json fields of this family alone that it must have
    flat_rope: bool = False  # one RoPE setting for every kind of layer, its scaling too (GPT-OSS)
    # config.json <-> ModelArgs for the fields of this family alone: read(raw, refusals) -> fields;
    # write(args) -> the config class's keyword arguments
    read: object = None
    write: object = None

    def fixed(self, args: ModelArgs) -> dict:
        """The fields this family fixes, evaluated for `args`."""
        return {k: v(args) if callable(v) else v for k, v in self.args.items()}


def _mixtral_read(raw: dict, bad: list) -> dict:
    return dict(moe_experts=raw["num_local_experts"], moe_top_k=raw.get("num_experts_per_tok", 2),
                moe_hidden_dim=raw["intermediate_size"])


def _mixtral_write(args: ModelArgs) -> dict:
    return dict(num_local_experts=args.moe_experts, num_experts_per_tok=args.moe_top_k,
                router_aux_loss_coef=args.moe_aux_loss, intermediate_size=args.moe_expert_hidden_dim)


def _qwen3_moe_read(raw: dict, bad: list) -> dict:
    """Qwen3-MoE: block i is MoE unless listed in mlp_only_layers, every decoder_sparse_step-th;
    here the dense blocks are the first ones (model.moe_dense_layers)."""
    n, step = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1)
    dense = [i for i in range(n) if i in (raw.get("mlp_only_layers") or []) or (i + 1) % step]
    if dense != list(range(len(dense))):
        bad.append(f"dense blocks {dense} (mlp_only_layers={raw.get('mlp_only_layers')}, decoder_sparse_step={step}): "
                   "only the first blocks may be dense here")
    return dict(moe_experts=raw.get("num_experts") or raw.get("num_local_experts"),  # (5.x writes the latter)
                moe_top_k=raw.get("num_experts_per_tok", 8),
                moe_hidden_dim=raw["moe_intermediate_size"], moe_norm_topk=bool(raw.get("norm_topk_prob", False)),
                moe_dense_layers=len(dense))


def _qwen3_moe_write(args: ModelArgs) -> dict:
    return dict(num_experts=args.moe_experts, num_experts_per_tok=args.moe_top_k,
                moe_intermediate_size=args.moe_expert_hidden_dim, norm_topk_prob=args.moe_norm_topk,
                decoder_sparse_step=1, mlp_only_layers=list(range(args.moe_dense_layers)),
                router_aux_loss_coef=args.moe_aux_loss)


def _smollm3_read(raw: dict, bad: list) -> dict:
    """SmolLM3's no_rope_layers (1 = RoPE, 0 = none) as a period: blocks i with (i + 1) % p == 0."""
    layers = raw.get("no_rope_layers")
    if layers is None:
        return dict(nope_period=raw.get("no_rope_layer_interval", 4))
    for period in [0, *range(1, len(layers) + 1)]:
        if layers == [int(not period or (i + 1) % period != 0) for i in range(len(layers))]:
            return dict(nope_period=period)
    bad.append(f"no_rope_layers={layers} (here the blocks without RoPE are every p-th: model.nope_period)")
    return {}


def _smollm3_write(args: ModelArgs) -> dict:
    return dict(no_rope_layers=[int(args.layer_rope(i) != "") for i in range(args.n_layers)],
                no_rope_layer_interval=args.nope_period)


def _gemma3_read(raw: dict, bad: list) -> dict:
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    scalar = raw.get("query_pre_attn_scalar", head_dim)
    return dict(query_scale_dim=0 if scalar == head_dim else int(scalar))


def _gemma3_write(args: ModelArgs) -> dict:
    return dict(query_pre_attn_scalar=args.query_scale_dim or args.head_dim)


def _gpt_oss_read(raw: dict, bad: list) -> dict:
    if not raw.get("attention_bias", True):
        bad.append("attention_bias=False (GPT-OSS's attention projections are biased here)")
    return dict(moe_experts=raw["num_local_experts"], moe_top_k=raw.get("num_experts_per_tok", 4),
                moe_hidden_dim=raw["intermediate_size"], swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)))


def _gpt_oss_write(args: ModelArgs) -> dict:
    return dict(num_local_experts=args.moe_experts, num_experts_per_tok=args.moe_top_k,
                intermediate_size=args.moe_expert_hidden_dim, swiglu_limit=args.swiglu_limit,
                swiglu_alpha=args.swiglu_alpha, router_aux_loss_coef=args.moe_aux_loss, attention_bias=True)


_QWEN3_BLOCK = _ATTENTION | _QK_NORM | _MLP | _PRE_NORMS
_OLMO2_BLOCK = _ATTENTION | _QK_NORM | _MLP | _POST_NORMS

# model_type -> its family. The first that holds a model is its export (Llama before Mistral).
FAMILIES = {
    "llama": Family("Llama", "LlamaConfig", "LlamaForCausalLM", _ATTENTION | _MLP | _PRE_NORMS,
                    off={"attention_bias": (False, _BIASES), "mlp_bias": (False, "biases in the MLP")}),
    "mistral": Family("Mistral", "MistralConfig", "MistralForCausalLM", _ATTENTION | _MLP | _PRE_NORMS,
                      off={"sliding_window": (None, _SLIDING)}),
    "mixtral": Family("Mixtral", "MixtralConfig", "MixtralForCausalLM", _ATTENTION | _PRE_NORMS,
                      experts=Experts("block_sparse_moe", {"w1": "w1", "w2": "w2", "w3": "w3"}),
                      off={"sliding_window": (None, _SLIDING),
                           "router_jitter_noise": (0.0, "this router adds no noise")},
                      read=_mixtral_read, write=_mixtral_write, needs=("num_local_experts",)),
    "qwen2": Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", _ATTENTION | _QKV_BIAS | _MLP | _PRE_NORMS,
                    args=dict(qkv_bias=True), off={"use_sliding_window": (False, _QWEN_WINDOWS)}),
    "qwen3": Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", _QWEN3_BLOCK, args=dict(qk_norm="head"),
                    off={"attention_bias": (False, _BIASES), "use_sliding_window": (False, _QWEN_WINDOWS)}),
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", _QWEN3_BLOCK, args=dict(qk_norm="head"),
                        experts=Experts("mlp", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
                        off={"attention_bias": (False, _BIASES), "use_sliding_window": (False, _QWEN_WINDOWS)},
                        read=_qwen3_moe_read, write=_qwen3_moe_write, needs=("moe_intermediate_size",)),
    "olmo2": Family("OLMo 2", "Olmo2Config", "Olmo2ForCausalLM", _OLMO2_BLOCK,
                    args=dict(norm_placement="post", qk_norm="projection"),
                    off={"attention_bias": (False, _BIASES)}),
    "olmo3": Family("OLMo 3", "Olmo3Config", "Olmo3ForCausalLM", _OLMO2_BLOCK,
                    args=dict(norm_placement="post", qk_norm="projection"), free=_WINDOWS,
                    off={"attention_bias": (False, _BIASES)}),
    "gemma3_text": Family("Gemma 3", "Gemma3TextConfig", "Gemma3ForCausalLM",
                          _ATTENTION | _QK_NORM | _MLP | _GEMMA_NORMS,
                          args=dict(norm_placement="sandwich", qk_norm="head", ffn_activation="gelu_tanh",
                                    norm_unit_offset=True, embed_scale=lambda a: a.dim ** 0.5),
                          free=_WINDOWS + ("query_scale_dim",),
                          off={"attention_bias": (False, _BIASES),
                               "attn_logit_softcapping": (None, "soft-capped attention logits"),
                               "final_logit_softcapping": (None, "soft-capped output logits"),
                               "use_bidirectional_attention": (False, "bidirectional attention")},
                          read=_gemma3_read, write=_gemma3_write),
    "gpt_oss": Family("GPT-OSS", "GptOssConfig", "GptOssForCausalLM",
                      _ATTENTION | _QKV_BIAS | {"attention.wo.bias": "self_attn.o_proj.bias",
                                                "attention.sinks": "self_attn.sinks"} | _PRE_NORMS,
                      args=dict(qkv_bias=True, attn_out_bias=True, attn_sinks=True, ffn_activation="clamped_swiglu",
                                moe_router_bias=True, moe_expert_bias=True),
                      free=("sliding_window", "layer_pattern", "swiglu_limit", "swiglu_alpha"),
                      experts=Experts("mlp", router="router.weight", fused=True), flat_rope=True,
                      read=_gpt_oss_read, write=_gpt_oss_write, needs=("num_local_experts",)),
    "smollm3": Family("SmolLM3", "SmolLM3Config", "SmolLM3ForCausalLM", _ATTENTION | _MLP | _PRE_NORMS,
                      free=("nope_period",),
                      off={"attention_bias": (False, _BIASES), "mlp_bias": (False, "biases in the MLP"),
                           "use_sliding_window": (False, _SLIDING)},
                      read=_smollm3_read, write=_smollm3_write),
}

# The per-layer fields (pretrain/model/args.py) that change what a block computes; a family sets some
# (Family.args) and leaves the others at Llama's. (z_loss is a training setting: every family takes it.)
_RECIPE = tuple(f for f in RECIPE_FIELDS if f != "head_size")  # (every family takes a head width of its own)
_LLAMA = ModelArgs()


def _named(fields: dict) -> str:
    return ", ".join(f"model.{k}={v!r}" for k, v in fields.items())


def _holds(family: Family, args: ModelArgs) -> bool:
    fixed = family.fixed(args)
    return (bool(args.moe_experts) == bool(family.experts)
            and all(getattr(args, f) == fixed.get(f, getattr(_LLAMA, f)) for f in _RECIPE if f not in family.free))


def family_of(args: ModelArgs) -> Family:
    """The family whose table holds the model: its per-layer fields are the family's (the first in
    FAMILIES, so Llama, not Mistral). ValueError naming the fields that no family holds."""
    for family in FAMILIES.values():
        if _holds(family, args):
            return family
    recipe = {f: getattr(args, f) for f in _RECIPE if getattr(args, f) != getattr(_LLAMA, f)}

    def holds(f: Family) -> str:
        fixed = {k: "sqrt(dim)" if callable(v) else v for k, v in f.args.items()}
        return " ".join(filter(None, [_named(fixed) or "Llama's blocks", "+ model.moe_experts > 0" if f.experts else "",
                                      f"(any {', '.join(f.free)})" if f.free else ""]))
    held = "; ".join(f"{f.name}: {holds(f)}" for t, f in FAMILIES.items() if t != "mistral")
    moe = f" with model.moe_experts={args.moe_experts}" if args.moe_experts else ""
    raise ValueError(f"no Hugging Face family holds {_named(recipe) or 'these blocks'}{moe} (what each holds: {held})")


def moe_problems(args: ModelArgs, family: Family | None = None) -> list[str]:
    """What keeps an MoE model from being its family's (Mixtral, GPT-OSS: a softmax router whose k
    weights are renormalised, every block MoE; Qwen3-MoE: a softmax router, the first blocks may be
    dense; none has a shared expert; Mixtral's RoPE is plain); empty when it is one."""
    family = family or family_of(args)
    out = []
    renormalised = family.name in ("Mixtral", "GPT-OSS")  # (GPT-OSS: the softmax of the top k logits, the same)
    if args.moe_router != "softmax" or (renormalised and not args.moe_norm_topk):
        out.append(f"model.moe_router={args.moe_router} with moe_norm_topk={args.moe_norm_topk} ({family.name}'s router "
                   "is a softmax" + (" whose top-k weights are renormalised)" if renormalised else ")"))
    if args.moe_shared_experts:
        out.append(f"model.moe_shared_experts={args.moe_shared_experts} ({family.name} has no shared expert)")
    if args.moe_dense_layers and family.name != "Qwen3-MoE":
        out.append(f"model.moe_dense_layers={args.moe_dense_layers} (every {family.name} block is MoE)")
    if args.rope_scaling_factor and family.name == "Mixtral":
        out.append("model.rope_scaling_factor (Mixtral's RoPE is plain)")
    return out


def _layer_types(args: ModelArgs) -> list[str]:
    return ["sliding_attention" if args.layer_kind(i) == "local" else "full_attention" for i in range(args.n_layers)]


def to_hf_config(args: ModelArgs):
    """The transformers config of the same architecture, of the family that holds it (`family_of`),
    with `architectures` set; vocab_size must be set. ValueError naming what no family holds."""
    import transformers

    if not args.vocab_size:
        raise ValueError("model.vocab_size=0: set it before converting to Hugging Face")
    if args.parametrization != "sp":
        raise ValueError(f"model.parametrization={args.parametrization}: fold its multipliers first (fold_multipliers)")
    family = family_of(args)
    if family.experts:
        problems = moe_problems(args, family)
        if problems:
            raise ValueError(f"not a {family.name}: " + "; ".join(problems))
    rope = dict(rope_theta=args.rope_theta, rope_scaling=rope_scaling(args))
    local_scaled = args.rope_local_scaling and rope_scaling(args)
    if family.flat_rope and args.local_rope_table:
        raise ValueError(f"not a {family.name}: its layers share one RoPE (model.rope_local_theta="
                         f"{args.rope_local_theta}, rope_local_scaling={args.rope_local_scaling})")
    if family.flat_rope:
        rope.update(sliding_window=args.sliding_window or None, layer_types=_layer_types(args))
    elif "sliding_window" in family.free:  # per layer kind: `layer_types`, each kind its RoPE
        scaling = rope_scaling(args) or {"rope_type": "default"}
        rope = dict(sliding_window=args.sliding_window or None, layer_types=_layer_types(args), rope_parameters={
            "full_attention": {**scaling, "rope_theta": args.rope_theta},
            "sliding_attention": {**(scaling if local_scaled else {"rope_type": "default"}),
                                  "rope_theta": args.rope_local_theta or args.rope_theta}})
    activation = {"hidden_activation" if family.name == "Gemma 3" else "hidden_act": _ACTIVATIONS[args.ffn_activation]}
    kwargs = dict(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,  # (Qwen2's and OLMo 2's classes read it too, though their configs do not list it)
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        # transformers 5 moves these into rope_parameters itself; 4.x keeps the attributes.
        **rope,
        tie_word_embeddings=args.tie_embeddings,
        initializer_range=args.init_std,
        pad_token_id=None,
        **activation,
        **{key: value for key, (value, _) in family.off.items()},
    )
    kwargs.update(family.write(args) if family.write else {})
    cfg = getattr(transformers, family.config)(**kwargs)
    cfg.architectures = [family.architecture]
    return cfg


def rope_scaling(args: ModelArgs) -> dict | None:
    """HF's `rope_scaling` of the model (None without scaling): llama3 or yarn."""
    scaling = args.rope_scaling
    if scaling is None:
        return None
    if scaling["kind"] == "yarn":
        out = {"rope_type": "yarn", "factor": args.rope_scaling_factor, "beta_fast": args.rope_yarn_beta_fast,
               "beta_slow": args.rope_yarn_beta_slow, "truncate": args.rope_yarn_truncate,
               "original_max_position_embeddings": args.rope_original_max_seq_len}
        return {**out, "attention_factor": args.rope_yarn_attention_factor} if args.rope_yarn_attention_factor else out
    return {"rope_type": "llama3", "factor": args.rope_scaling_factor, "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len}


def _scaling_from_hf(rope: dict) -> dict:
    """ModelArgs' RoPE scaling fields from HF's llama3 or yarn parameters (ValueError naming what lacks)."""
    kind = rope.get("rope_type", rope.get("type"))
    needs = {"llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings")}[kind]
    lacking = [k for k in needs if rope.get(k) is None]
    if lacking:
        raise ValueError(f"{kind} RoPE scaling without {', '.join(lacking)} (rope_scaling needs {', '.join(needs)})")
    out = dict(rope_scaling_factor=float(rope["factor"]),
               rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
    if kind == "llama3":
        return {**out, "rope_low_freq_factor": float(rope["low_freq_factor"]),
                "rope_high_freq_factor": float(rope["high_freq_factor"])}
    return {**out, "rope_scaling_type": "yarn", "rope_yarn_beta_fast": float(rope.get("beta_fast") or 32),
            "rope_yarn_beta_slow": float(rope.get("beta_slow") or 1),
            "rope_yarn_truncate": bool(rope.get("truncate", True)),
            "rope_yarn_attention_factor": float(rope.get("attention_factor") or 0.0)}


# model_type -> why it does not load (any other model_type that FAMILIES lacks: "not a family this model holds")
_REFUSED = {"gemma": "a different norm and MLP", "gemma2": "soft-capping and sliding windows",
            "gemma3": "Gemma 3's image-text model: its text model (model_type gemma3_text, as Gemma 3 1B) loads",
            "qwen2_moe": "shared experts with a gate", "phi3": "fused projections"}
_LOADS = ", ".join(f.name for f in list(FAMILIES.values())[:-1]) + f" and {list(FAMILIES.values())[-1].name}"


def from_hf_config(cfg) -> ModelArgs:
    """ModelArgs of a transformers config object (see from_hf_dict)."""
    return from_hf_dict(cfg.to_dict())


def from_hf_dict(raw: dict) -> ModelArgs:
    """ModelArgs from a `config.json` as a dict, written by transformers 4.x (`rope_theta`,
    `rope_scaling`) or 5.x (`rope_parameters`), of a family in FAMILIES (by its `model_type`).
    Raises ValueError naming every feature this model lacks, in one line."""
    model_type = raw.get("model_type", "llama")
    family = FAMILIES.get(model_type)
    if family is None:  # (first: another architecture names its fields otherwise)
        raise ValueError(f"not supported: model_type {model_type!r} "
                         f"({_REFUSED.get(model_type, 'not a family this model holds')}); {_LOADS} load")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                           "intermediate_size", *family.needs) if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}, which a {family.name} config has")
    if "sliding_window" in family.free and raw.get("layer_types") is None:
        import transformers  # (its config class knows the family's default pattern)

        raw = {**raw, "layer_types": getattr(transformers, family.config)(**raw).layer_types}
    rope, local_rope = _rope_parameters(raw, "full_attention"), _rope_parameters(raw, "sliding_attention")
    if family.flat_rope:  # (GPT-OSS: one RoPE for every layer)
        local_rope = rope
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    values = collections.defaultdict(lambda: "?", raw)  # (for the `off` descriptions that quote other fields)
    bad = [f"{key}={raw[key]!r} ({why.format_map(values)})" for key, (_, why) in family.off.items() if raw.get(key)]
    quantized = raw.get("quantization_config")
    if quantized:  # (GPT-OSS's hub checkpoints keep the experts in MXFP4)
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        bad.append(f"quantization_config (weights quantized with {method}: load the model dequantized and save it, "
                   "e.g. transformers' Mxfp4Config(dequantize=True) then save_pretrained, and start from that)")
    if (raw.get("num_local_experts") or raw.get("num_experts")) and not family.experts:
        bad.append("a mixture of experts")
    if rope_type not in ("default", "llama3", "yarn"):
        bad.append(f"RoPE scaling {rope_type!r} (plain RoPE, llama3 and yarn load)")
    elif rope_type == "yarn" and (rope.get("mscale") or rope.get("mscale_all_dim")):
        bad.append("yarn RoPE scaling with mscale and mscale_all_dim (DeepSeek's attention factor)")
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        bad.append("partial_rotary_factor (RoPE on part of each head)")
    kinds = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
    windows = {}
    if "sliding_window" in family.free:
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            bad.append(f"layer_types {unknown} (full_attention and sliding_attention load)")
        elif "sliding_attention" in kinds:
            local_type = local_rope.get("rope_type", "default")
            scaled = local_type != "default"
            if scaled and {k: v for k, v in local_rope.items() if k != "rope_theta"} != \
                    {k: v for k, v in rope.items() if k != "rope_theta"}:
                bad.append(f"RoPE scaling {local_type!r} in the sliding-window layers, not the global layers'")
            local_theta = float(local_rope.get("rope_theta", rope.get("rope_theta", 10000.0)))
            windows = dict(sliding_window=raw.get("sliding_window") or 0, layer_pattern=_pattern(kinds),
                           rope_local_theta=0.0 if local_theta == rope.get("rope_theta", 10000.0) else local_theta,
                           rope_local_scaling=bool(scaled and rope_type != "default"))
    elif set(kinds) - {"full_attention"}:
        bad.append(f"layer_types {sorted(set(kinds) - {'full_attention'})} (every {family.name} block here attends "
                   "to the full context)")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    wanted = family.args.get("ffn_activation", "silu")
    if activation != _ACTIVATIONS[wanted]:
        bad.append(f"hidden_act={activation!r} ({family.name} here gates with {_ACTIVATIONS[wanted]})")
    own = family.read(raw, bad) if family.read else {}
    if bad:
        raise ValueError(f"not supported: {family.name} with " + "; ".join(bad))
    scaling = _scaling_from_hf(rope) if rope_type != "default" else {}
    head_dim = raw.get("head_dim") or 0  # (0: hidden_size / num_attention_heads, ours as theirs)
    args = ModelArgs(
        dim=hidden,
        n_layers=raw["num_hidden_layers"],
        n_heads=heads,
        head_size=0 if head_dim * heads == hidden else head_dim,
        n_kv_heads=raw.get("num_key_value_heads") or heads,
        vocab_size=raw["vocab_size"],
        ffn_hidden_dim=raw["intermediate_size"],
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        max_seq_len=raw.get("max_position_embeddings", 2048),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        init_std=raw.get("initializer_range", 0.02),
        **scaling,
        **windows,
        **own,
    )
    args = dataclasses.replace(args, **family.fixed(args))
    problems = args.problems()  # (a shape the model cannot take: one line naming config.json's fields)
    if problems:
        named = "; ".join(problems)
        for ours, theirs in _CONFIG_KEYS.items():
            named = named.replace(f"model.{ours}=", f"{theirs}=")
        raise ValueError(f"config.json: {named}")
    return args


def _rope_parameters(raw: dict, kind: str) -> dict:
    """The RoPE settings of one kind of layer (full_attention, sliding_attention), with its
    rope_theta: transformers 5 writes `rope_parameters` (per kind where kinds differ), 4.x
    `rope_theta` and `rope_scaling` (Gemma 3 also `rope_local_base_freq`)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if {"full_attention", "sliding_attention"} & set(params):
        params = params.get(kind) or {}
    elif kind == "sliding_attention":  # (4.x: the scaling is the global layers')
        params = {"rope_theta": raw.get("rope_local_base_freq", params.get("rope_theta", raw.get("rope_theta")))}
    params = dict(params)
    if params.get("rope_theta") is None:
        params["rope_theta"] = raw.get("rope_theta") if raw.get("rope_theta") is not None else 10000.0
    return params


def _pattern(kinds: list[str]) -> list[str]:
    """layer_types as model.layer_pattern: its shortest repeating prefix, in our kinds."""
    ours = ["local" if k == "sliding_attention" else "global" for k in kinds]
    period = next(p for p in range(1, len(ours) + 1) if all(ours[i] == ours[i % p] for i in range(len(ours))))
    return ours[:period]


# ModelArgs' fields as config.json names them (in from_hf_dict's refusals)
_CONFIG_KEYS = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                "n_kv_heads": "num_key_value_heads", "vocab_size": "vocab_size", "ffn_hidden_dim": "intermediate_size",
                "max_seq_len": "max_position_embeddings", "init_std": "initializer_range",
                "moe_experts": "num_local_experts", "moe_top_k": "num_experts_per_tok",
                "moe_hidden_dim": "intermediate_size", "head_size": "head_dim"}


def _rename(sd: dict[str, torch.Tensor], top: dict[str, str], block: dict[str, str],
            src_prefix: str, dst_prefix: str) -> dict[str, torch.Tensor]:
    out, unknown = {}, []
    pattern = re.compile(re.escape(src_prefix) + r"(\d+)\.(.+)")
    for name, tensor in sd.items():
        m = pattern.fullmatch(name)
        if name in top:
            out[top[name]] = tensor
        elif m and m.group(2) in block:
            out[f"{dst_prefix}{m.group(1)}.{block[m.group(2)]}"] = tensor
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"unexpected state-dict keys: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    return out


def fold_multipliers(sd: dict[str, torch.Tensor], args: ModelArgs) -> tuple[dict[str, torch.Tensor], ModelArgs]:
    """(state dict, args) of the standard-parametrization model that computes what this one does:
    the attention scale's ratio to 1/sqrt(head_dim) goes into q (RoPE is a rotation, so scaling q
    before it is the same): into the q norm's weight where there is one (a norm after wq would undo
    it), else into wq and its bias; CompleteP's residual multiplier into each branch's last weights
    (the post-norms where there are, else wo and w2, and wo's bias), and the logit multiplier into
    the LM head, which is then untied from the embedding. sp: returned as is."""
    if args.parametrization == "sp":
        return sd, args
    q_scale, branch = args.attn_scale * math.sqrt(args.head_dim), args.residual_scale
    q_names = ("attention.q_norm.weight",) if args.qk_norm != "none" else ("attention.wq.weight", "attention.wq.bias")
    branch_names = (("attention_out_norm.weight", "ffn_out_norm.weight") if args.norm_placement != "pre"
                    else ("attention.wo.weight", "attention.wo.bias", "feed_forward.w2.weight"))
    out = {}
    for name, w in sd.items():
        scale = q_scale if name.endswith(q_names) else branch if name.endswith(branch_names) else 1.0
        if scale != 1.0:  # (a norm of gain 1 + w: (1 + w) x scale - 1)
            w = (1 + w) * scale - 1 if args.norm_unit_offset and name.endswith("norm.weight") else w * scale
        out[name] = w
    out["output.weight"] = sd.get("output.weight", sd["tok_embeddings.weight"]) * args.logit_scale
    sp = dataclasses.replace(args, parametrization="sp", mup_base_dim=0, mup_base_layers=0, mup_base_head_dim=0,
                             tie_embeddings=args.tie_embeddings and args.logit_scale == 1.0)
    return out, sp


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> that of the family that holds the model (`family_of`), under its names. An
    MoE model's experts each under their own names (Mixtral's `block_sparse_moe.experts.{e}.w1.weight`,
    Qwen3-MoE's `mlp.experts.{e}.gate_proj.weight`), as the hub's checkpoints and transformers 4.x
    name them and 5.x reads them.
    Tensors are shared, not copied. ValueError naming any key the family's table lacks.

    With tied embeddings, `lm_head.weight` is the embedding tensor (HF's state_dict lists both).
    """
    family = family_of(args)
    sd = dict(sd)
    moe = {}
    if family.experts:
        moe = (_fused_experts_to_hf if family.experts.fused else _experts_to_hf)(sd, family.experts)
    out = {**_rename(sd, _TOP, family.block, "layers.", "model.layers."), **moe}
    if args.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The state dict of the family that holds `args` (as from_hf_dict made them) -> ours. Tensors
    are shared, not copied; values may also be names (LazyWeights maps names). ValueError naming
    any key the family's table lacks: a weight is never dropped.

    With tied embeddings, `output.weight` is the embedding tensor, whether or not the input has
    `lm_head.weight` (checkpoints saved by HF omit it). Rotary buffers, if present, are dropped:
    ours are recomputed from args.
    """
    family = family_of(args)
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if args.tie_embeddings:
        sd.pop("lm_head.weight", None)
    moe = {}
    if family.experts:
        moe = _fused_experts_from_hf(sd) if family.experts.fused else _experts_from_hf(sd, family.experts, args.moe_experts)
    out = {**_rename(sd, {v: k for k, v in _TOP.items()}, {v: k for k, v in family.block.items()},
                     "model.layers.", "layers."), **moe}
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# The MoE families' one transform: each expert's matrices under their own names in HF, stacked (E, ...) in ours.
def _experts_to_hf(sd: dict, experts: Experts) -> dict:
    """Pops our MoE weights from `sd`; returns them under the family's names (the routers' expert_bias,
    which neither family has a place for, is dropped: export refuses a non-zero one)."""
    out = {}
    for name in [n for n in sd if re.fullmatch(r"layers\.\d+\.feed_forward\.(router\.weight|experts\.w[123]|expert_bias)", n)]:
        layer, what = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(.+)", name).groups()
        tensor, prefix = sd.pop(name), f"model.layers.{layer}.{experts.prefix}."
        if what == "router.weight":
            out[prefix + experts.router] = tensor
        elif what.startswith("experts."):
            for e, w in enumerate(tensor.unbind(0)):
                out[f"{prefix}experts.{e}.{experts.names[what.split('.')[1]]}.weight"] = w
    return out


def _experts_from_hf(sd: dict, experts: Experts, n_experts: int) -> dict:
    """Pops the family's router and expert weights from `sd`; returns ours, each layer's experts
    stacked (as a list where the values are names: LazyWeights)."""
    out, stacks = {}, {}
    ours = {v: k for k, v in experts.names.items()}
    pattern = re.compile(rf"model\.layers\.(\d+)\.{re.escape(experts.prefix)}\.(?:{re.escape(experts.router)}|"
                         rf"experts\.(\d+)\.({'|'.join(map(re.escape, ours))})\.weight)")
    for name in [n for n in sd if pattern.fullmatch(n)]:
        layer, e, w = pattern.fullmatch(name).groups()
        if e is None:
            out[f"layers.{layer}.feed_forward.router.weight"] = sd.pop(name)
        else:
            stacks.setdefault(f"layers.{layer}.feed_forward.experts.{ours[w]}", {})[int(e)] = sd.pop(name)
    for key, parts in stacks.items():
        if sorted(parts) != list(range(n_experts)):
            raise ValueError(f"{key}: experts {sorted(parts)} of {n_experts}")
        ordered = [parts[e] for e in range(n_experts)]
        out[key] = torch.stack(ordered) if isinstance(ordered[0], torch.Tensor) else ordered
    return out


# GPT-OSS's experts: one tensor for all of a layer's experts, HF's (in, out) layout, gate and up
# interleaved (gate_up_proj[..., 0::2] is the gate). Ours -> HF stacks and interleaves; HF -> ours takes
# strided views (values may be names: LazyWeights reads a `Part` when it needs the tensor).
@dataclass(frozen=True)
class Part:
    """Our tensor as a view of one HF tensor (named, or the tensor itself): `take(hf_tensor)`."""

    source: object
    take: object  # hf tensor -> ours


def _gate(t: torch.Tensor) -> torch.Tensor:
    return t[..., 0::2].transpose(-2, -1) if t.dim() == 3 else t[..., 0::2]


def _up(t: torch.Tensor) -> torch.Tensor:
    return t[..., 1::2].transpose(-2, -1) if t.dim() == 3 else t[..., 1::2]


def _down(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-2, -1) if t.dim() == 3 else t


_FUSED = {"gate_up_proj": (("w1", _gate), ("w3", _up)), "gate_up_proj_bias": (("b1", _gate), ("b3", _up)),
          "down_proj": (("w2", _down),), "down_proj_bias": (("b2", _down),)}


def _fused_experts_to_hf(sd: dict, experts: Experts) -> dict:
    """Pops our MoE weights (router and its bias, experts and their biases) from `sd`; returns
    GPT-OSS's (the routers' expert_bias, which it has no place for, is dropped: export refuses a
    non-zero one)."""
    out = {}
    first = (re.fullmatch(r"layers\.(\d+)\.feed_forward\.experts\.w1", n) for n in sd)
    for i in sorted(int(m.group(1)) for m in first if m):
        ours, theirs = f"layers.{i}.feed_forward.", f"model.layers.{i}.mlp."
        w1, w2, w3 = (sd.pop(f"{ours}experts.w{k}") for k in (1, 2, 3))
        out[theirs + "experts.gate_up_proj"] = torch.stack((w1.transpose(-2, -1), w3.transpose(-2, -1)), -1).flatten(-2)
        out[theirs + "experts.down_proj"] = w2.transpose(-2, -1)
        if ours + "experts.b1" in sd:
            b1, b2, b3 = (sd.pop(f"{ours}experts.b{k}") for k in (1, 2, 3))
            out[theirs + "experts.gate_up_proj_bias"] = torch.stack((b1, b3), -1).flatten(-2)
            out[theirs + "experts.down_proj_bias"] = b2
        for what in ("router.weight", "router.bias"):
            if ours + what in sd:
                out[theirs + what] = sd.pop(ours + what)
        sd.pop(ours + "expert_bias", None)
    return out


def _fused_experts_from_hf(sd: dict) -> dict:
    """Pops GPT-OSS's router and experts from `sd`; returns ours, as views (or `Part`s of names)."""
    out = {}
    pattern = re.compile(r"model\.layers\.(\d+)\.mlp\."
                         r"(router\.(?:weight|bias)|experts\.(?:gate_up_proj|down_proj)(?:_bias)?)")
    for name in [n for n in sd if pattern.fullmatch(n)]:
        layer, what = pattern.fullmatch(name).groups()
        value, prefix = sd.pop(name), f"layers.{layer}.feed_forward."
        if what.startswith("router."):
            out[prefix + what] = value
            continue
        for ours, take in _FUSED[what.split(".")[1]]:
            out[prefix + "experts." + ours] = take(value) if isinstance(value, torch.Tensor) else Part(value, take)
    return out
