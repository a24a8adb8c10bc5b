"""Conversion to and from Hugging Face `LlamaForCausalLM` (config and state dict).

Our RoPE already uses HF's rotate-half layout, so weights copy across unchanged: only names differ.
`transformers` is imported lazily, so the rest of the model package does not need it.
"""

from __future__ import annotations

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


def to_hf_config(args: ModelArgs):
    """The `transformers.LlamaConfig` of the same architecture (vocab_size must be set)."""
    from transformers import LlamaConfig

    if not args.vocab_size:
        raise ValueError("model.vocab_size=0: set it before converting to Hugging Face")
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
        # transformers 5 moves this into rope_parameters itself; 4.x keeps the attribute.
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_embeddings,
        initializer_range=args.init_std,
        attention_bias=False,
        mlp_bias=False,
    )


def from_hf_config(cfg) -> ModelArgs:
    """ModelArgs of a `LlamaConfig`; raises ValueError for features this model lacks."""
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bad = []
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        bad.append(f"RoPE scaling {rope} (only plain RoPE is supported)")
    if head_dim * cfg.num_attention_heads != cfg.hidden_size:
        bad.append(f"head_dim={head_dim} != hidden_size / num_attention_heads")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        bad.append("attention_bias/mlp_bias (this model has no biases)")
    if cfg.hidden_act != "silu":
        bad.append(f"hidden_act={cfg.hidden_act!r} (SwiGLU needs silu)")
    if bad:
        raise ValueError("cannot convert this Llama config: " + "; ".join(bad))
    return ModelArgs(
        dim=cfg.hidden_size,
        n_layers=cfg.num_hidden_layers,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        vocab_size=cfg.vocab_size,
        ffn_hidden_dim=cfg.intermediate_size,
        norm_eps=cfg.rms_norm_eps,
        rope_theta=float(theta if theta is not None else 10000.0),
        max_seq_len=cfg.max_position_embeddings,
        tie_embeddings=bool(cfg.tie_word_embeddings),
        init_std=cfg.initializer_range,
    )


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


def to_hf_state_dict(sd: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> `LlamaForCausalLM`'s. Tensors are shared, not copied.

    With tied embeddings, `lm_head.weight` is the embedding tensor (HF's state_dict lists both).
    """
    out = _rename(sd, _TOP, _BLOCK, "layers.", "model.layers.")
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
    out = _rename(sd, {v: k for k, v in _TOP.items()}, {v: k for k, v in _BLOCK.items()},
                  "model.layers.", "layers.")
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out
