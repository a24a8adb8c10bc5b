"""FP8 matmuls in the blocks' linear layers (train.precision=fp8), through torchao's float8 training.

Each eligible `nn.Linear` of the blocks (attention's wq/wk/wv/wo, the SwiGLU's w1/w2/w3, an MoE's
shared experts) becomes torchao's `Float8Linear`, which holds the same Parameter object: the
optimizer, ZeRO's partitioning (the conversion runs after the model is built, and partitioned under
ZeRO-3), checkpoints and the Hugging Face mapping see the same weights under the same names. Its
forward casts the input and the weight to float8 e4m3 with dynamic scales (one per tensor:
`tensorwise`; one per row: `rowwise`) and multiplies them in float8; backward casts the output's
gradient to e5m2 (tensorwise) or e4m3 (rowwise). Master weights, gradients and everything around
the matmuls stay as they were (bf16 weights, fp32 master copies).

Kept in bf16, said once in the log:
- the output head (LMHead) and the MoE router (Router): subclasses of nn.Linear, not converted, as
  torchtitan keeps its output layer; the router computes in fp32 either way;
- an MoE's routed experts: stacked 3-D weights under grouped matmuls, not nn.Linear;
- layers whose dimensions are not multiples of 16, which the float8 GEMM (torch._scaled_mm)
  cannot take.

`emulate=True` runs the same scaled-float8 arithmetic (the casts, scales and rounding) with the
matmul in high precision: on a CPU, for tests and numerics. torchao is an optional dependency
(`pip install -e '.[fp8]'`), imported only here."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

from torch import nn

RECIPES = ("tensorwise", "rowwise")  # train.fp8_recipe
ALIGN = 16  # torch._scaled_mm: both dimensions of each float8 operand a multiple of 16

log = logging.getLogger(__name__)


def import_torchao() -> SimpleNamespace:
    """torchao's float8 training API (convert_to_float8_training, Float8LinearConfig, Float8Linear),
    imported quietly: torchao warns about every optional CUDA kernel library it cannot load, torch
    about a deprecated enum registration. ImportError when torchao is missing."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    return SimpleNamespace(convert_to_float8_training=convert_to_float8_training,
                           Float8LinearConfig=Float8LinearConfig, Float8Linear=Float8Linear)


def eligible(module: nn.Module) -> bool:
    """A plain nn.Linear (not the head or the router, its subclasses) whose dimensions the float8
    GEMM takes."""
    return type(module) is nn.Linear and module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


def kept_in_bf16(model: nn.Module) -> list[str]:
    """What the conversion leaves in bf16, by kind, for the log: ["output head", "router (2 layers)", ...]."""
    from pretrain.model.model import LMHead
    from pretrain.model.moe import Experts, Router

    named = {LMHead: "output head", Router: "router", Experts: "routed experts (grouped matmuls)"}
    kinds: dict[str, int] = {}
    for m in model.modules():
        kind = named.get(type(m))
        if kind is None and type(m) is nn.Linear and not eligible(m):
            kind = f"dimensions not multiples of {ALIGN}"
        if kind:
            kinds[kind] = kinds.get(kind, 0) + 1
    return [f"{k} ({n} layer{'s' * (n > 1)})" for k, n in sorted(kinds.items())]


def convert(model: nn.Module, recipe: str, emulate: bool) -> int:
    """Swap the eligible linears of `model` for Float8Linear in place; the number swapped. Logs once
    what stays in bf16."""
    float8 = import_torchao()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    before = sum(eligible(m) for m in model.modules())
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, _fqn: eligible(m))
    n = sum(isinstance(m, float8.Float8Linear) for m in model.modules())
    assert n == before, (n, before)
    log.info("fp8 (%s%s): %d linear layers compute in float8; kept in bf16: %s", recipe,
             ", emulated" if emulate else "", n, ", ".join(kept_in_bf16(model)) or "nothing")
    return n


def converted(model: nn.Module) -> int:
    """How many Float8Linear layers `model` holds (0 without torchao)."""
    try:
        float8 = import_torchao()
    except ImportError:
        return 0
    return sum(isinstance(m, float8.Float8Linear) for m in model.modules())
