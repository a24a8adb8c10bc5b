"""Conversion to and from Hugging Face `LlamaForCausalLM` (config and state dict).

Our RoPE already uses HF's rotate-half layout, so weights copy across unchanged: only names differ.
A muP or CompleteP model's multipliers are folded into its weights first (`fold_multipliers`), so
the export is a plain Llama that computes the same logits.
`transformers` is imported lazily, so the rest of the model package does not need it.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from pretrain.model.args import ModelArgs

# Per-block names: ours -> HF, under `layers.{i}.` and `model.layers.{i}.`.
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


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
    """The `transformers.LlamaConfig` of the same architecture, or `MixtralConfig` for an MoE model
    that Mixtral holds (vocab_size must be set)."""
    from transformers import LlamaConfig, MixtralConfig

    if not args.vocab_size:
        raise ValueError("model.vocab_size=0: set it before converting to Hugging Face")
    if args.parametrization != "sp":
        raise ValueError(f"model.parametrization={args.parametrization}: fold its multipliers first (fold_multipliers)")
    if args.moe_experts:
        problems = mixtral_problems(args)
        if problems:
            raise ValueError("not a Mixtral: " + "; ".join(problems))
        return MixtralConfig(
            vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.moe_expert_hidden_dim,
            num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim, hidden_act="silu", max_position_embeddings=args.max_seq_len,
            rms_norm_eps=args.norm_eps, rope_theta=args.rope_theta, tie_word_embeddings=args.tie_embeddings,
            initializer_range=args.init_std, num_local_experts=args.moe_experts, num_experts_per_tok=args.moe_top_k,
            router_aux_loss_coef=args.moe_aux_loss, sliding_window=None)
    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        # transformers 5 moves these into rope_parameters itself; 4.x keeps the attributes.
        rope_theta=args.rope_theta,
        rope_scaling=rope_scaling(args),
        tie_word_embeddings=args.tie_embeddings,
        initializer_range=args.init_std,
        attention_bias=False,
        mlp_bias=False,
    )


def rope_scaling(args: ModelArgs) -> dict | None:
    """HF's `rope_scaling` of the model (None without scaling)."""
    if not args.rope_scaling_factor:
        return None
    return {"rope_type": "llama3", "factor": args.rope_scaling_factor, "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len}


# model_type -> why it does not load (anything else but llama and mistral: "not a Llama architecture")
_REFUSED = {"qwen2": "attention biases", "qwen3": "q/k norms", "gemma": "a different norm and MLP",
            "gemma2": "soft-capping and sliding windows", "qwen2_moe": "shared experts with a gate", "phi3": "fused projections", "olmo2": "q/k norms"}


def from_hf_config(cfg) -> ModelArgs:
    """ModelArgs of a transformers config object (see from_hf_dict)."""
    return from_hf_dict(cfg.to_dict())


def from_hf_dict(raw: dict) -> ModelArgs:
    """ModelArgs from a `config.json` as a dict, written by transformers 4.x (`rope_theta`,
    `rope_scaling`) or 5.x (`rope_parameters`). Raises ValueError naming every feature this model
    lacks: only Llama-architecture models (llama; mistral without a sliding window) and Mixtral load."""
    model_type = raw.get("model_type", "llama")
    if model_type not in ("llama", "mistral", "mixtral"):  # (first: another architecture names its fields otherwise)
        raise ValueError(f"not supported: model_type {model_type!r} "
                         f"({_REFUSED.get(model_type, 'not a Llama architecture')}); Llama, Mistral and Mixtral load")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                           "intermediate_size") if k not in raw]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}, which a Llama config has")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or hidden // heads
    bad = []
    if raw.get("sliding_window") and raw.get("use_sliding_window", True):
        bad.append(f"sliding-window attention (sliding_window={raw['sliding_window']})")
    if (raw.get("num_local_experts") or raw.get("num_experts")) and model_type != "mixtral":
        bad.append("a mixture of experts")
    if model_type == "mixtral" and raw.get("router_jitter_noise"):
        bad.append(f"router_jitter_noise={raw['router_jitter_noise']} (this router adds no noise)")
    if rope_type not in ("default", "llama3"):
        bad.append(f"RoPE scaling {rope_type!r} (plain RoPE and llama3 load)")
    if head_dim * heads != hidden:
        bad.append(f"head_dim={head_dim} != hidden_size / num_attention_heads")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        bad.append("attention_bias/mlp_bias (this model has no biases)")
    if raw.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={raw['hidden_act']!r} (SwiGLU needs silu)")
    if bad:
        raise ValueError("not supported: " + "; ".join(bad))
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
    args = ModelArgs(
        dim=hidden,
        n_layers=raw["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=raw.get("num_key_value_heads") or heads,
        vocab_size=raw["vocab_size"],
        ffn_hidden_dim=raw["intermediate_size"],
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta if theta is not None else 10000.0),
        max_seq_len=raw.get("max_position_embeddings", 2048),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        init_std=raw.get("initializer_range", 0.02),
        **scaling,
        **({"moe_experts": raw["num_local_experts"], "moe_top_k": raw.get("num_experts_per_tok", 2),
            "moe_hidden_dim": raw["intermediate_size"]} if model_type == "mixtral" else {}),
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
                "moe_hidden_dim": "intermediate_size"}


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
    the attention scale's ratio to 1/sqrt(head_dim) goes into wq (RoPE is a rotation, so scaling q
    before it is the same), CompleteP's residual multiplier into wo and w2, and the logit
    multiplier into the LM head, which is then untied from the embedding. sp: returned as is."""
    if args.parametrization == "sp":
        return sd, args
    q_scale, branch = args.attn_scale * math.sqrt(args.head_dim), args.residual_scale
    out = {}
    for name, w in sd.items():
        if name.endswith("attention.wq.weight"):
            w = w * q_scale
        elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
            w = w * branch
        out[name] = w
    out["output.weight"] = sd.get("output.weight", sd["tok_embeddings.weight"]) * args.logit_scale
    sp = dataclasses.replace(args, parametrization="sp", mup_base_dim=0, mup_base_layers=0, mup_base_head_dim=0,
                             tie_embeddings=args.tie_embeddings and args.logit_scale == 1.0)
    return out, sp


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> `LlamaForCausalLM`'s (an MoE model's: `MixtralForCausalLM`'s, each expert's
    matrices under its own name, `block_sparse_moe.experts.{e}.w1.weight`, as transformers 4.x
    names them and 5.x reads them). Tensors are shared, not copied.

    With tied embeddings, `lm_head.weight` is the embedding tensor (HF's state_dict lists both).
    """
    sd, moe = dict(sd), {}
    for name in [n for n in sd if re.fullmatch(r"layers\.\d+\.feed_forward\.(router\.weight|experts\.w[123]|expert_bias)", n)]:
        layer, what = re.fullmatch(r"layers\.(\d+)\.feed_forward\.(.+)", name).groups()
        tensor, prefix = sd.pop(name), f"model.layers.{layer}.block_sparse_moe."
        if what == "router.weight":
            moe[prefix + "gate.weight"] = tensor
        elif what.startswith("experts."):  # (the bias has no place in Mixtral: export refuses a non-zero one)
            for e, w in enumerate(tensor.unbind(0)):
                moe[f"{prefix}experts.{e}.{what.split('.')[1]}.weight"] = w
    out = {**_rename(sd, _TOP, _BLOCK, "layers.", "model.layers."), **moe}
    if args.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """`LlamaForCausalLM`'s state dict -> ours. Tensors are shared, not copied.

    With tied embeddings, `output.weight` is the embedding tensor, whether or not the input has
    `lm_head.weight` (checkpoints saved by HF omit it). Rotary buffers, if present, are dropped:
    ours are recomputed from args.
    """
    sd = {k: v for k, v in sd.items() if not k.endswith("rotary_emb.inv_freq")}
    if args.tie_embeddings:
        sd.pop("lm_head.weight", None)
    moe, experts = {}, {}  # Mixtral's: each expert's matrices under their own names, stacked here
    pattern = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(?:gate\.weight|experts\.(\d+)\.(w[123])\.weight)")
    for name in [n for n in sd if pattern.fullmatch(n)]:
        layer, e, w = pattern.fullmatch(name).groups()
        if e is None:
            moe[f"layers.{layer}.feed_forward.router.weight"] = sd.pop(name)
        else:
            experts.setdefault(f"layers.{layer}.feed_forward.experts.{w}", {})[int(e)] = sd.pop(name)
    for key, parts in experts.items():
        if sorted(parts) != list(range(args.moe_experts)):
            raise ValueError(f"{key}: experts {sorted(parts)} of {args.moe_experts}")
        ordered = [parts[e] for e in range(args.moe_experts)]
        moe[key] = torch.stack(ordered) if isinstance(ordered[0], torch.Tensor) else ordered  # (names: LazyWeights)
    out = {**_rename(sd, {v: k for k, v in _TOP.items()}, {v: k for k, v in _BLOCK.items()},
                     "model.layers.", "layers."), **moe}
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
