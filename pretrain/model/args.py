"""The model's description: a plain dataclass, apart from the code that builds it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelArgs:
    preset: str = ""  # name from PRESETS applied before the fields set here ("" = none)
    dim: int = 256  # residual stream width (hidden size)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads; head_dim = dim // n_heads
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
    rope_original_max_seq_len: int = 8192  # llama3 scaling: the context the model was pretrained at
    max_seq_len: int = 2048  # longest sequence in tokens (RoPE table and KV-cache size)
    tie_embeddings: bool = False  # share the token embedding and the LM head weights
    init_std: float = 0.02  # std of normal init; output projections use init_std / sqrt(2 * n_layers)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 * 4 * dim, scaled, rounded up to `multiple_of` (Llama rule)."""
        if self.ffn_hidden_dim:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

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
        if self.dim % self.n_heads:
            out.append(f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                       f"pick n_heads dividing dim")
        elif self.head_dim % 2:
            out.append(f"head_dim = dim/n_heads = {self.head_dim} is odd; RoPE needs an even head_dim")
        if self.n_heads % self.kv_heads:
            out.append(f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads="
                       f"{self.n_kv_heads}: use a divisor of n_heads (e.g. {_divisor_hint(self.n_heads)})")
        if self.rope_scaling_factor and (self.rope_scaling_factor < 1 or self.rope_original_max_seq_len <= 0
                                         or not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor):
            out.append("model.rope_scaling_factor must be 0 (none) or >= 1, with 0 < rope_low_freq_factor < "
                       "rope_high_freq_factor and rope_original_max_seq_len > 0")
        if self.init_std <= 0:
            out.append(f"model.init_std={self.init_std} must be positive")
        return out


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
