"""The model's description: a plain dataclass, apart from the code that builds it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ModelArgs:
    preset: str = ""  # name from PRESETS applied before the fields set here ("" = none)
    dim: int = 256  # residual stream width (hidden size)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads
    head_size: int = 0  # width of each attention head (0 = dim // n_heads; Qwen3, Gemma 3 set their own)
    n_kv_heads: int = 0  # key/value heads for grouped-query attention (0 = n_heads, i.e. MHA)
    vocab_size: int = 0  # embedding rows (0 = from the tokenizer, rounded up to vocab_multiple_of)
    vocab_multiple_of: int = 128  # padding of a tokenizer-derived vocab, for fast matmuls
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float = 0.0  # scales the SwiGLU hidden size (0 = 1.0, Llama convention)
    ffn_hidden_dim: int = 0  # explicit SwiGLU hidden size; overrides the rule above (0 = derive)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling_factor: float = 0.0  # Llama 3.1 ("llama3") RoPE scaling: low frequencies slowed this much (0 = none)
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original/low_freq_factor are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original/high_freq_factor are kept
    rope_original_max_seq_len: int = 8192  # llama3 and yarn scaling: the context the model was pretrained at
    rope_scaling_type: str = "llama3"  # what rope_scaling_factor does: llama3 (Llama 3.1) | yarn (YaRN: Qwen3, OLMo 3, GPT-OSS)
    rope_yarn_beta_fast: float = 32.0  # yarn: dimensions turning more than this often in the original context keep their frequency
    rope_yarn_beta_slow: float = 1.0  # yarn: those turning less often than this are interpolated fully (the ramp between)
    rope_yarn_truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions (GPT-OSS: false)
    rope_yarn_attention_factor: float = 0.0  # yarn: cos and sin multiplied by this (0 = 0.1 ln(factor) + 1)
    rope_local_scaling: bool = False  # the RoPE scaling applies to the local layers too (GPT-OSS); else global only (Gemma 3, OLMo 3)
    max_seq_len: int = 2048  # longest sequence in tokens (RoPE table and KV-cache size)
    document_mask: bool = False  # each token attends only to its own document of a packed sequence (docs/long_context.md)
    document_positions: bool = False  # with document_mask: RoPE positions restart at 0 at each document
    eot_id: int = -1  # the token that separates packed documents (-1 = the tokenizer's, data.eot_token)
    tie_embeddings: bool = False  # share the token embedding and the LM head weights
    # The per-layer description (docs/model.md, "One model, many recipes"); the defaults are Llama's.
    norm_placement: str = "pre"  # pre: x + f(norm(x)) (Llama) | post: x + norm(f(x)) (OLMo 2) | sandwich: both (Gemma)
    qk_norm: str = "none"  # RMSNorm of queries and keys before RoPE: none | head (each head: Qwen3, Gemma 3) | projection (all heads at once: OLMo 2)
    qkv_bias: bool = False  # biases on wq, wk, wv (Qwen2)
    attn_out_bias: bool = False  # a bias on wo (GPT-OSS)
    attn_sinks: bool = False  # a learned sink logit per query head, a key of value zero every query sees (GPT-OSS)
    sliding_window: int = 0  # tokens a local layer's query sees, itself included (0 = no local layers)
    layer_pattern: list[str] = field(default_factory=list)  # attention kinds of blocks 0, 1, ..., repeated: global | local (empty = all global)
    rope_local_theta: float = 0.0  # RoPE base of the local layers (0 = rope_theta; Gemma 3: 10k local, 1M global)
    nope_period: int = 0  # blocks i with (i + 1) % nope_period == 0 have no RoPE (SmolLM3: 4; 0 = all have RoPE)
    rope_fraction: float = 1.0  # share of each head's dimensions RoPE rotates, the first ones (partial rotary)
    ffn_activation: str = "silu"  # the feed-forward gate's activation: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma) | clamped_swiglu (GPT-OSS)
    swiglu_limit: float = 7.0  # clamped_swiglu: the gate clamped above at this, the up projection to [-this, this]
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate) * (up + 1)
    embed_scale: float = 1.0  # multiplier of the token embeddings (Gemma: sqrt(dim))
    norm_unit_offset: bool = False  # every RMSNorm scales by (1 + weight), the weight starting at 0 (Gemma)
    query_scale_dim: int = 0  # attention logits scaled by 1/sqrt(this) (0 = head_dim; Gemma 3's query_pre_attn_scalar)
    z_loss: float = 0.0  # output z-loss coefficient: loss += z_loss x mean logsumexp(logits)^2 (PaLM; OLMo 2: 1e-5)
    init_std: float = 0.02  # std of normal init; output projections use init_std / sqrt(2 * n_layers)
    parametrization: str = "sp"  # sp (standard) | mup (width transfer) | completep (width and depth): docs/mup.md
    mup_base_dim: int = 0  # mup/completep: the width whose hyperparameters were tuned (m = dim / this)
    mup_base_layers: int = 0  # completep: the depth whose hyperparameters were tuned (m_L = n_layers / this)
    mup_base_head_dim: int = 0  # mup/completep: the base's head_dim (needed when dim != mup_base_dim; 0 = this one)
    mup_base_hidden_dim: int = 0  # mup/completep: the base's SwiGLU hidden size (0 = hidden_dim's rule at mup_base_dim)
    # Mixture-of-Experts (docs/moe.md): 0 experts is the dense model.
    moe_experts: int = 0  # routed experts in each MoE block (0 = dense)
    moe_top_k: int = 2  # experts each token is routed to
    moe_hidden_dim: int = 0  # each expert's SwiGLU width (0 = hidden_dim; smaller = fine-grained experts)
    moe_shared_experts: int = 0  # experts every token also goes through (one SwiGLU this many expert widths wide)
    moe_dense_layers: int = 0  # the first this many blocks keep a dense feed-forward
    moe_router: str = "softmax"  # softmax | sigmoid (DeepSeek-V3)
    moe_norm_topk: bool = True  # renormalise each token's k weights to sum to 1
    moe_aux_loss: float = 0.01  # coefficient of the load-balancing loss (Switch/GShard form, per MoE block)
    moe_z_loss: float = 0.0  # coefficient of the router z-loss (ST-MoE)
    moe_bias_rate: float = 0.0  # DeepSeek-V3's auxiliary-loss-free balancing: bias update per step (0 = off)
    moe_router_bias: bool = False  # a learned bias on the router's logits (GPT-OSS; it weights, unlike moe_bias_rate's)
    moe_expert_bias: bool = False  # biases on each expert's w1, w3 and w2 (GPT-OSS)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def rope_scaling(self) -> dict | None:
        """The global layers' RoPE scaling for rope.precompute_freqs_cis (None without one)."""
        if not self.rope_scaling_factor:
            return None
        if self.rope_scaling_type == "yarn":
            return dict(kind="yarn", factor=self.rope_scaling_factor, original=self.rope_original_max_seq_len,
                        beta_fast=self.rope_yarn_beta_fast, beta_slow=self.rope_yarn_beta_slow,
                        truncate=self.rope_yarn_truncate,
                        attention_factor=self.rope_yarn_attention_factor or 0.1 * math.log(self.rope_scaling_factor) + 1)
        return dict(kind="llama3", factor=self.rope_scaling_factor, low=self.rope_low_freq_factor,
                    high=self.rope_high_freq_factor, original=self.rope_original_max_seq_len)

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (even): head_dim x rope_fraction."""
        return 2 * int(self.head_dim * self.rope_fraction / 2)

    def layer_kind(self, i: int) -> str:
        """Block i's attention: "global" (full causal) or "local" (a sliding window)."""
        return self.layer_pattern[i % len(self.layer_pattern)] if self.layer_pattern else "global"

    def layer_window(self, i: int) -> int:
        """Block i's window in tokens (0 = full causal attention)."""
        return self.sliding_window if self.layer_kind(i) == "local" else 0

    def layer_rope(self, i: int) -> str:
        """Which RoPE table block i reads: "global", "local" (its own base), or "" (no RoPE)."""
        if self.nope_period and (i + 1) % self.nope_period == 0:
            return ""
        return "local" if self.layer_kind(i) == "local" and self.local_rope_table else "global"

    @property
    def local_rope_table(self) -> bool:
        """Whether local layers read a RoPE table of their own: a base of their own, or the global
        layers' without its scaling (unless model.rope_local_scaling)."""
        unscaled = self.rope_scaling_factor and not self.rope_local_scaling
        return bool(self.rope_local_theta or unscaled) and "local" in self.layer_pattern

    @property
    def windows(self) -> list[int]:
        """The distinct windows of the blocks (0 = full), in block order."""
        return list(dict.fromkeys(self.layer_window(i) for i in range(self.n_layers)))

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 * 4 * dim, scaled, rounded up to `multiple_of` (Llama rule)."""
        return self.ffn_hidden_dim or self._llama_hidden(self.dim)

    @property
    def moe_expert_hidden_dim(self) -> int:
        """Each expert's SwiGLU width: moe_hidden_dim, else the dense hidden_dim."""
        return self.moe_hidden_dim or self.hidden_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether block i's feed-forward is a Mixture-of-Experts."""
        return self.moe_experts > 0 and i >= self.moe_dense_layers

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def _llama_hidden(self, dim: int) -> int:
        hidden = int(2 * 4 * dim / 3)
        if self.ffn_dim_multiplier:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    # muP (Yang et al. 2022, Tensor Programs V) and CompleteP (Dey et al. 2025, depth-muP with
    # alpha = 1): the multipliers the model applies. All are 1 (and unused) under sp, and at the base
    # shape, so the base model is the same function in every parametrization. The optimizer's rules
    # are in pretrain/optim/optimizer.py.
    @property
    def document_eot(self) -> int | None:
        """The separator whose documents the attention keeps apart (model.document_mask), else None:
        what callers give data_pipeline.document_inputs for the model's `documents` and `positions`."""
        return self.eot_id if self.document_mask else None

    @property
    def width_mult(self) -> float:
        """m = dim / mup_base_dim (1 under sp)."""
        return self.dim / self.mup_base_dim if self.parametrization != "sp" else 1.0

    @property
    def ffn_width_mult(self) -> float:
        """w2's own width multiplier: its fan-in (hidden_dim) over the base's SwiGLU hidden size
        (1 under sp). Not m: `multiple_of` rounding (or an explicit ffn_hidden_dim) breaks the
        ratio, e.g. 1408 / 192 = 7.33 at dim 512 from base 64 with multiple_of 64, where m = 8."""
        if self.parametrization == "sp":
            return 1.0
        return self.hidden_dim / (self.mup_base_hidden_dim or self._llama_hidden(self.mup_base_dim))

    @property
    def depth_mult(self) -> float:
        """m_L = n_layers / mup_base_layers (1 except under completep)."""
        return self.n_layers / self.mup_base_layers if self.parametrization == "completep" else 1.0

    @property
    def attn_scale(self) -> float | None:
        """Softmax scale of the attention logits: None (1/sqrt(head_dim)) under sp, or
        1/sqrt(query_scale_dim) where set; under mup and
        completep 1/head_dim, times sqrt(base head_dim) so that the base model keeps 1/sqrt(head_dim).
        Models that grow by heads at a fixed head_dim (the presets, the scaling planner) keep
        1/sqrt(head_dim) at every width."""
        if self.parametrization == "sp":
            return self.query_scale_dim ** -0.5 if self.query_scale_dim else None
        return math.sqrt(self.mup_base_head_dim or self.head_dim) / self.head_dim

    @property
    def residual_scale(self) -> float:
        """Multiplier of each residual branch: 1 / m_L under completep, else 1."""
        return 1.0 / self.depth_mult

    @property
    def logit_scale(self) -> float:
        """Multiplier of the output logits: 1 / m under mup and completep, else 1."""
        return 1.0 / self.width_mult

    @property
    def hidden_init_std(self) -> float:
        """Init std of the hidden matrices (wq, wk, wv, w1, w3): init_std / sqrt(m)."""
        return self.init_std / math.sqrt(self.width_mult)

    @property
    def out_init_std(self) -> float:
        """Init std of the attention's output projection wo: the hidden std / sqrt(2 L); L is the
        base depth under completep, whose residual multiplier does the scaling in depth."""
        return self.hidden_init_std / math.sqrt(2 * self._init_layers)

    @property
    def ffn_out_init_std(self) -> float:
        """Init std of w2: as wo's, with its own fan-in multiplier (ffn_width_mult) for m."""
        return self.init_std / math.sqrt(self.ffn_width_mult) / math.sqrt(2 * self._init_layers)

    @property
    def _init_layers(self) -> int:
        return self.mup_base_layers if self.parametrization == "completep" else self.n_layers

    def parametrization_spec(self) -> dict:
        """What the multipliers depend on besides the shape; checkpoints record it (a muP model's
        weights mean another function under sp)."""
        out: dict = {"parametrization": self.parametrization}
        if self.parametrization != "sp":
            out.update(mup_base_dim=self.mup_base_dim, mup_base_head_dim=self.mup_base_head_dim or self.head_dim)
        if self.parametrization == "completep":
            out["mup_base_layers"] = self.mup_base_layers
        return out

    def problems(self) -> list[str]:
        """Every impossible combination, each with its fix (empty when the shape is valid)."""
        out = []
        for name in ("dim", "n_layers", "n_heads", "max_seq_len", "multiple_of", "vocab_multiple_of"):
            if getattr(self, name) <= 0:
                out.append(f"model.{name}={getattr(self, name)} must be positive")
        if self.n_kv_heads < 0 or self.vocab_size < 0 or self.ffn_hidden_dim < 0:
            out.append("model.n_kv_heads, model.vocab_size and model.ffn_hidden_dim must be >= 0")
        if out:
            return out
        if self.head_size < 0:
            out.append(f"model.head_size={self.head_size} must be >= 0 (0 = dim / n_heads)")
        elif not self.head_size and self.dim % self.n_heads:
            out.append(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                       f"pick n_heads dividing dim, or set model.head_size")
        elif self.head_dim % 2:
            out.append(f"head_dim = {self.head_dim} is odd; RoPE needs an even head_dim")
        if self.n_heads % self.kv_heads:
            out.append(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads="
                       f"{self.n_kv_heads}: use a divisor of n_heads (e.g. {_divisor_hint(self.n_heads)})")
        if self.rope_scaling_factor and (self.rope_scaling_factor < 1 or self.rope_original_max_seq_len <= 0
                                         or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            out.append("model.rope_scaling_factor must be 0 (none) or >= 1, with 0 < rope_low_freq_factor < "
                       "rope_high_freq_factor and rope_original_max_seq_len > 0")
        _choice(out, "rope_scaling_type", self.rope_scaling_type, ("llama3", "yarn"))
        if not (self.rope_yarn_beta_fast > 0 and self.rope_yarn_beta_slow > 0 and self.rope_yarn_attention_factor >= 0):
            out.append("model.rope_yarn_beta_fast and rope_yarn_beta_slow must be > 0, rope_yarn_attention_factor >= 0")
        if self.init_std <= 0:
            out.append(f"model.init_std={self.init_std} must be positive")
        # (vocab_size 0 is filled from the tokenizer: Config.validate checks the resolved model again)
        if self.eot_id < -1 or self.vocab_size and self.eot_id >= self.vocab_size:
            vocab = f" (model.vocab_size={self.vocab_size})" if self.vocab_size else ""
            out.append(f"model.eot_id={self.eot_id} is not a token of the vocabulary{vocab}: give a token id from 0 "
                       "to vocab_size - 1, or -1 for the tokenizer's end-of-text token (data.eot_token)")
        if self.document_positions and not self.document_mask:
            out.append("model.document_positions=true restarts positions per document, which only means something "
                       "with model.document_mask=true: set both")
        out += self._recipe_problems()
        out += self._parametrization_problems()
        out += self._moe_problems()
        return out

    def _recipe_problems(self) -> list[str]:
        """The per-layer description's own checks."""
        out = []
        _choice(out, "norm_placement", self.norm_placement, NORM_PLACEMENTS)
        _choice(out, "qk_norm", self.qk_norm, QK_NORMS)
        _choice(out, "ffn_activation", self.ffn_activation, ("silu", "gelu_tanh", "clamped_swiglu"))
        if not (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            out.append("model.swiglu_limit and model.swiglu_alpha must be > 0")
        if (self.moe_router_bias or self.moe_expert_bias) and not self.moe_experts:
            out.append("model.moe_router_bias and model.moe_expert_bias are an MoE's (model.moe_experts is 0)")
        if not isinstance(self.layer_pattern, list) or any(k not in LAYER_KINDS for k in self.layer_pattern):
            out.append(f"model.layer_pattern={self.layer_pattern!r}: each entry is one of {', '.join(LAYER_KINDS)} "
                       "(e.g. [local, local, local, global]; empty = every block global)")
        elif "local" in self.layer_pattern and self.sliding_window <= 0:
            out.append("model.layer_pattern has local layers but model.sliding_window is 0: give the window in tokens")
        if self.sliding_window < 0 or self.sliding_window > self.max_seq_len:
            out.append(f"model.sliding_window={self.sliding_window} must be between 0 and model.max_seq_len="
                       f"{self.max_seq_len} (a window past the context is full attention: use 0 and global layers)")
        elif self.sliding_window and "local" not in self.layer_pattern:
            out.append(f"model.sliding_window={self.sliding_window} with no local layer in model.layer_pattern: "
                       "name the local layers (e.g. model.layer_pattern=[local,global]) or set the window to 0")
        if self.rope_local_theta < 0 or self.nope_period < 0:
            out.append("model.rope_local_theta and model.nope_period must be >= 0")
        if not 0 < self.rope_fraction <= 1 or not self.rotary_dim:
            out.append(f"model.rope_fraction={self.rope_fraction} must be in (0, 1] and leave RoPE at least 2 of "
                       f"head_dim={self.head_dim} dimensions")
        if self.query_scale_dim < 0 or self.query_scale_dim and self.parametrization != "sp":
            out.append(f"model.query_scale_dim={self.query_scale_dim} must be >= 0, and 0 under "
                       f"model.parametrization={self.parametrization} (muP sets the attention scale itself)")
        if not self.embed_scale > 0 or self.z_loss < 0:
            out.append(f"model.embed_scale={self.embed_scale} must be > 0 and model.z_loss={self.z_loss} >= 0")
        return out

    def _moe_problems(self) -> list[str]:
        if not self.moe_experts:
            return []
        if self.moe_experts < 0:
            return [f"model.moe_experts={self.moe_experts} must be >= 0 (0 = dense)"]
        out = []
        if not 1 <= self.moe_top_k <= self.moe_experts:
            out.append(f"model.moe_top_k={self.moe_top_k} must be between 1 and model.moe_experts={self.moe_experts}")
        if self.moe_router not in ("softmax", "sigmoid"):
            out.append(f"model.moe_router={self.moe_router!r} is not one of softmax, sigmoid")
        if self.moe_router_bias and self.moe_router == "sigmoid":
            out.append("model.moe_router_bias with model.moe_router=sigmoid: a learned router bias is GPT-OSS's, whose "
                       "router is a softmax (DeepSeek-V3's selection bias is model.moe_bias_rate)")
        if self.moe_hidden_dim < 0 or self.moe_shared_experts < 0:
            out.append("model.moe_hidden_dim and model.moe_shared_experts must be >= 0")
        if not 0 <= self.moe_dense_layers < self.n_layers:
            out.append(f"model.moe_dense_layers={self.moe_dense_layers} must be >= 0 and leave at least one of "
                       f"model.n_layers={self.n_layers} blocks to the experts")
        if not all(0 <= x < math.inf for x in (self.moe_aux_loss, self.moe_z_loss, self.moe_bias_rate)):  # (not NaN)
            out.append("model.moe_aux_loss, model.moe_z_loss and model.moe_bias_rate must be finite and >= 0")
        if self.parametrization != "sp":
            out.append(f"model.parametrization={self.parametrization} with model.moe_experts: muP's rules for experts "
                       "are not derived here; use model.parametrization=sp")
        return out

    def _parametrization_problems(self) -> list[str]:
        p = self.parametrization
        if p not in PARAMETRIZATIONS:
            return [f"model.parametrization={p!r} is not one of {', '.join(PARAMETRIZATIONS)}"]
        if self.mup_base_dim < 0 or self.mup_base_layers < 0 or self.mup_base_head_dim < 0:
            return ["model.mup_base_dim, model.mup_base_layers and model.mup_base_head_dim must be >= 0"]
        if p == "sp":
            return []
        out = []
        if not self.mup_base_dim:
            out.append(f"model.parametrization={p} needs model.mup_base_dim: the width whose hyperparameters "
                       f"you tuned (model.dim={self.dim} if it is this one)")
        if self.mup_base_dim and self.dim != self.mup_base_dim and not self.mup_base_head_dim:
            # (0 meant "this model's head_dim": a family that grows head_dim silently got sp's attention scale)
            out.append(f"model.parametrization={p} at model.dim={self.dim} (not the base's {self.mup_base_dim}) needs "
                       f"model.mup_base_head_dim: the base's head_dim (model.mup_base_head_dim={self.head_dim} if the "
                       "family grows by heads at this head_dim)")
        if self.mup_base_hidden_dim < 0:
            out.append(f"model.mup_base_hidden_dim={self.mup_base_hidden_dim} must be >= 0")
        if p == "completep" and not self.mup_base_layers:
            out.append(f"model.parametrization=completep needs model.mup_base_layers: the depth whose "
                       f"hyperparameters you tuned (model.n_layers={self.n_layers} if it is this one)")
        return out


PARAMETRIZATIONS = ("sp", "mup", "completep")
NORM_PLACEMENTS = ("pre", "post", "sandwich")
QK_NORMS = ("none", "head", "projection")
LAYER_KINDS = ("global", "local")


def _choice(out: list[str], name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        out.append(f"model.{name}={value!r} is not one of {', '.join(allowed)}")

# The fields that only set the RoPE table, which no weight depends on: fine-tuning may change them
# (continuing a checkpoint at a longer context: docs/long_context.md), and `pretrain eval` may score
# a model under other values.
ROPE_FIELDS = ("max_seq_len", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_scaling_type", "rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_truncate",
               "rope_yarn_attention_factor", "rope_local_scaling",
               "rope_original_max_seq_len")


# The fields that set which tokens attend to which across packed documents, no weight: a Hugging Face
# model's config.json does not hold them, so continuing one keeps the run config's (the id is the
# tokenizer's, data.eot_token, unless set).
MASK_FIELDS = ("document_mask", "document_positions", "eot_id")

# An MoE's balancing during training, no weight: a Mixtral's config.json does not hold ours (its
# router_aux_loss_coef is a training setting too), so continuing one keeps the run config's.
MOE_TRAINING_FIELDS = ("moe_aux_loss", "moe_z_loss", "moe_bias_rate")

# The per-layer description's fields that change what the model computes (the checkpoint's resume
# checks, the Hugging Face families and a start from a Hugging Face model all read this list; a new
# field goes here). z_loss is a loss weight: LOSS_FIELDS, kept from the run config like MoE's balancing.
RECIPE_FIELDS = ("head_size", "norm_placement", "qk_norm", "qkv_bias", "attn_out_bias", "attn_sinks", "sliding_window",
                 "layer_pattern", "rope_local_theta", "nope_period", "rope_fraction", "ffn_activation", "embed_scale",
                 "norm_unit_offset", "query_scale_dim", "swiglu_limit", "swiglu_alpha", "moe_router_bias", "moe_expert_bias")
LOSS_FIELDS = MOE_TRAINING_FIELDS + ("z_loss",)


def _divisor_hint(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# Llama-style shapes. Sizes are total parameters with a 32k vocabulary; "tiny" trains on a CPU in seconds.
PRESETS: dict[str, dict] = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=64, max_seq_len=256),
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, multiple_of=256, max_seq_len=2048),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, multiple_of=256, max_seq_len=2048),
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, multiple_of=256, max_seq_len=2048,
               ffn_hidden_dim=8192),
    "7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, multiple_of=256, max_seq_len=4096,
               ffn_hidden_dim=14336, rope_theta=500000.0),
}
