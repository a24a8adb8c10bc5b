"""The model: its description (`args`), its code (`model`, and `moe` for Mixture-of-Experts blocks), sampling (`generate`)."""

from pretrain.model.args import PRESETS, ModelArgs
from pretrain.model.attention import KVCache
from pretrain.model.model import Transformer, flops_per_token, num_params

__all__ = ["PRESETS", "KVCache", "ModelArgs", "Transformer", "flops_per_token", "num_params"]
