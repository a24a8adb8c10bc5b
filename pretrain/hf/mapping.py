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

_SLIDING = "sliding-window attention"
_QWEN_WINDOWS = _SLIDING + " (sliding_window={sliding_window}) from block max_window_layers={max_window_layers} on"
_BIASES = "biases on q_proj, k_proj, v_proj and o_proj"


@dataclass(frozen=True)
class Family:
    """One Hugging Face architecture, as data."""

    name: str  # as messages and docs name it
    config: str  # the transformers config class
    architecture: str  # the transformers model class (config.json's `architectures`)
    block: dict[str, str]  # each block's weights: our name -> HF's (Mixtral's experts: the transform below)
    args: dict = field(default_factory=dict)  # the ModelArgs fields its architecture sets (the rest are Llama's)
    # config.json fields that ask for what this model lacks: name -> (its value when off, what it asks for)
    off: dict[str, tuple] = field(default_factory=dict)
    moe: bool = False  # every block's feed-forward is a Mixtral MoE, each expert's matrices under their own names


# model_type -> its family. The first that holds a model is its export (Llama before Mistral).
FAMILIES = {
    "llama": Family("Llama", "LlamaConfig", "LlamaForCausalLM", _ATTENTION | _MLP | _PRE_NORMS,
                    off={"attention_bias": (False, _BIASES), "mlp_bias": (False, "biases in the MLP")}),
    "mistral": Family("Mistral", "MistralConfig", "MistralForCausalLM", _ATTENTION | _MLP | _PRE_NORMS,
                      off={"sliding_window": (None, _SLIDING)}),
    "mixtral": Family("Mixtral", "MixtralConfig", "MixtralForCausalLM", _ATTENTION | _PRE_NORMS, moe=True,
                      off={"sliding_window": (None, _SLIDING),
                           "router_jitter_noise": (0.0, "this router adds no noise")}),
    "qwen2": Family("Qwen2", "Qwen2Config", "Qwen2ForCausalLM", _ATTENTION | _QKV_BIAS | _MLP | _PRE_NORMS,
                    args=dict(qkv_bias=True), off={"use_sliding_window": (False, _QWEN_WINDOWS)}),
    "qwen3": Family("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", _ATTENTION | _QK_NORM | _MLP | _PRE_NORMS,
                    args=dict(qk_norm="head"),
                    off={"attention_bias": (False, _BIASES), "use_sliding_window": (False, _QWEN_WINDOWS)}),
    "olmo2": Family("OLMo 2", "Olmo2Config", "Olmo2ForCausalLM", _ATTENTION | _QK_NORM | _MLP | _POST_NORMS,
                    args=dict(norm_placement="post", qk_norm="projection"),
                    off={"attention_bias": (False, _BIASES)}),
}

# The per-layer fields (pretrain/model/args.py) that change what a block computes; a family sets some
# (Family.args) and leaves the others at Llama's. (z_loss is a training setting: every family takes it.)
_RECIPE = tuple(f for f in RECIPE_FIELDS if f != "head_size")  # (every family takes a head width of its own)
_LLAMA = ModelArgs()


def _named(fields: dict) -> str:
    return ", ".join(f"model.{k}={v!r}" for k, v in fields.items())


def family_of(args: ModelArgs) -> Family:
    """The family whose table holds the model: its per-layer fields are the family's (the first in
    FAMILIES, so Llama, not Mistral). ValueError naming the fields that no family holds."""
    recipe = {f: getattr(args, f) for f in _RECIPE if getattr(args, f) != getattr(_LLAMA, f)}
    for family in FAMILIES.values():
        if recipe == family.args and bool(args.moe_experts) == family.moe:
            return family
    held = "; ".join(f"{f.name}: {_named(f.args) or ('model.moe_experts > 0' if f.moe else 'none of these')}"
                     for t, f in FAMILIES.items() if t != "mistral")
    moe = f" with model.moe_experts={args.moe_experts}" if args.moe_experts else ""
    raise ValueError(f"no Hugging Face family holds {_named(recipe)}{moe} (what each holds: {held})")


def mixtral_problems(args: ModelArgs) -> list[str]:
    """What keeps an MoE model from being a transformers Mixtral (a softmax router whose k weights
    are renormalised, every block MoE, no shared expert, plain RoPE); empty when it is one."""
    out = []
    if args.moe_router != "softmax" or not args.moe_norm_topk:
        out.append(f"model.moe_router={args.moe_router} with moe_norm_topk={args.moe_norm_topk} (Mixtral's router is "
                   "a softmax whose top-k weights are renormalised)")
    if args.moe_shared_experts:
        out.append(f"model.moe_shared_experts={args.moe_shared_experts} (Mixtral has no shared expert)")
    if args.moe_dense_layers:
        out.append(f"model.moe_dense_layers={args.moe_dense_layers} (every Mixtral block is MoE)")
    if args.rope_scaling_factor:
        out.append("model.rope_scaling_factor (Mixtral's RoPE is plain)")
    return out


def to_hf_config(args: ModelArgs):
    """The transformers config of the same architecture, of the family that holds it (`family_of`:
    LlamaConfig, Qwen2Config, Qwen3Config, Olmo2Config, or MixtralConfig for an MoE model that
    Mixtral holds), with `architectures` set; vocab_size must be set. ValueError naming what no
    family holds."""
    import transformers

    if not args.vocab_size:
        raise ValueError("model.vocab_size=0: set it before converting to Hugging Face")
    if args.parametrization != "sp":
        raise ValueError(f"model.parametrization={args.parametrization}: fold its multipliers first (fold_multipliers)")
    family = family_of(args)
    moe = {}
    if family.moe:
        problems = mixtral_problems(args)
        if problems:
            raise ValueError("not a Mixtral: " + "; ".join(problems))
        moe = dict(num_local_experts=args.moe_experts, num_experts_per_tok=args.moe_top_k,
                   router_aux_loss_coef=args.moe_aux_loss)
    cfg = getattr(transformers, family.config)(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.moe_expert_hidden_dim if family.moe else args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,  # (Qwen2's and OLMo 2's classes read it too, though their configs do not list it)
        hidden_act="silu",
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        # transformers 5 moves these into rope_parameters itself; 4.x keeps the attributes.
        rope_theta=args.rope_theta,
        rope_scaling=rope_scaling(args),
        tie_word_embeddings=args.tie_embeddings,
        initializer_range=args.init_std,
        **moe,
        **{key: value for key, (value, _) in family.off.items()},
    )
    cfg.architectures = [family.architecture]
    return cfg


def rope_scaling(args: ModelArgs) -> dict | None:
    """HF's `rope_scaling` of the model (None without scaling)."""
    if not args.rope_scaling_factor:
        return None
    return {"rope_type": "llama3", "factor": args.rope_scaling_factor, "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len}


# model_type -> why it does not load (any other model_type that FAMILIES lacks: "not a family this model holds")
_REFUSED = {"gemma": "a different norm and MLP", "gemma2": "soft-capping and sliding windows",
            "qwen2_moe": "shared experts with a gate", "qwen3_moe": "a mixture of experts with q/k norms",
            "phi3": "fused projections"}
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
                           "intermediate_size") if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}, which a {family.name} config has")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    values = collections.defaultdict(lambda: "?", raw)  # (for the `off` descriptions that quote other fields)
    bad = [f"{key}={raw[key]!r} ({why.format_map(values)})" for key, (_, why) in family.off.items() if raw.get(key)]
    if (raw.get("num_local_experts") or raw.get("num_experts")) and not family.moe:
        bad.append("a mixture of experts")
    if rope_type not in ("default", "llama3"):
        bad.append(f"RoPE scaling {rope_type!r} (plain RoPE and llama3 load)")
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        bad.append("partial_rotary_factor (RoPE on part of each head)")
    local = sorted({t for t in raw.get("layer_types") or [] if t != "full_attention"})
    if local:
        bad.append(f"layer_types {local} (every block here attends to the full context)")
    if raw.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={raw['hidden_act']!r} (SwiGLU needs silu)")
    if bad:
        raise ValueError(f"not supported: {family.name} with " + "; ".join(bad))
    scaling = {}
    if rope_type == "llama3":
        lacking = [k for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                   if k not in rope]
        if lacking:
            raise ValueError(f"llama3 RoPE scaling without {', '.join(lacking)} (rope_scaling needs factor, "
                             "low_freq_factor, high_freq_factor and original_max_position_embeddings)")
        scaling = dict(rope_scaling_factor=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
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
        rope_theta=float(theta if theta is not None else 10000.0),
        max_seq_len=raw.get("max_position_embeddings", 2048),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        init_std=raw.get("initializer_range", 0.02),
        **scaling,
        **family.args,
        **({"moe_experts": raw["num_local_experts"], "moe_top_k": raw.get("num_experts_per_tok", 2),
            "moe_hidden_dim": raw["intermediate_size"]} if family.moe else {}),
    )
    problems = args.problems()  # (a shape the model cannot take: one line naming config.json's fields)
    if problems:
        named = "; ".join(problems)
        for ours, theirs in _CONFIG_KEYS.items():
            named = named.replace(f"model.{ours}=", f"{theirs}=")
        raise ValueError(f"config.json: {named}")
    return args


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
        if name.endswith(q_names):
            w = w * q_scale
        elif name.endswith(branch_names):
            w = w * branch
        out[name] = w
    out["output.weight"] = sd.get("output.weight", sd["tok_embeddings.weight"]) * args.logit_scale
    sp = dataclasses.replace(args, parametrization="sp", mup_base_dim=0, mup_base_layers=0, mup_base_head_dim=0,
                             tie_embeddings=args.tie_embeddings and args.logit_scale == 1.0)
    return out, sp


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> that of the family that holds the model (`family_of`), under its names. An
    MoE model's: `MixtralForCausalLM`'s, each expert's matrices under their own name,
    `block_sparse_moe.experts.{e}.w1.weight`, as transformers 4.x names them and 5.x reads them.
    Tensors are shared, not copied. ValueError naming any key the family's table lacks.

    With tied embeddings, `lm_head.weight` is the embedding tensor (HF's state_dict lists both).
    """
    family = family_of(args)
    sd = dict(sd)
    moe = _mixtral_experts_to_hf(sd) if family.moe else {}
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
    moe = _mixtral_experts_from_hf(sd, args.moe_experts) if family.moe else {}
    out = {**_rename(sd, {v: k for k, v in _TOP.items()}, {v: k for k, v in family.block.items()},
                     "model.layers.", "layers."), **moe}
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# Mixtral's one transform: each expert's matrices under their own names in HF, stacked (E, ...) in ours.
def _mixtral_experts_to_hf(sd: dict) -> dict:
    """Pops our MoE weights from `sd`; returns them under Mixtral's names (the routers' expert_bias,
    which Mixtral has no place for, is dropped: export refuses a non-zero one)."""
    out = {}
    for name in [n for n in sd if re.fullmatch(r"layers\.\d+\.feed_forward\.(router\.weight|experts\.w[123]|expert_bias)", n)]:
        layer, what = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(.+)", name).groups()
        tensor, prefix = sd.pop(name), f"model.layers.{layer}.block_sparse_moe."
        if what == "router.weight":
            out[prefix + "gate.weight"] = tensor
        elif what.startswith("experts."):
            for e, w in enumerate(tensor.unbind(0)):
                out[f"{prefix}experts.{e}.{what.split('.')[1]}.weight"] = w
    return out


def _mixtral_experts_from_hf(sd: dict, n_experts: int) -> dict:
    """Pops Mixtral's router and expert weights from `sd`; returns ours, each layer's experts stacked
    (as a list where the values are names: LazyWeights)."""
    out, experts = {}, {}
    pattern = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(?:gate\.weight|experts\.(\d+)\.(w[123])\.weight)")
    for name in [n for n in sd if pattern.fullmatch(n)]:
        layer, e, w = pattern.fullmatch(name).groups()
        if e is None:
            out[f"layers.{layer}.feed_forward.router.weight"] = sd.pop(name)
        else:
            experts.setdefault(f"layers.{layer}.feed_forward.experts.{w}", {})[int(e)] = sd.pop(name)
    for key, parts in experts.items():
        if sorted(parts) != list(range(n_experts)):
            raise ValueError(f"{key}: experts {sorted(parts)} of {n_experts}")
        ordered = [parts[e] for e in range(n_experts)]
        out[key] = torch.stack(ordered) if isinstance(ordered[0], torch.Tensor) else ordered
    return out
