"""`pretrain mup check CONFIG [overrides] --widths 64,128,256,512 [--depths 2,4,8] [--steps 10]
[--seeds 8] [--batch-size 2] [--seq-len 16] [--json PATH] [--out DIR]`: the coordinate check of a parametrization (docs/mup.md).

Each width (model.dim, at the config's depth) and each depth (model.n_layers, at the config's
width) is trained `steps` steps from `seeds` seeds, with the config's optimizer and its parameter
groups (pretrain/optim/optimizer.py) at the constant rate optimizer.lr (no warmup, no clipping: the update
itself is measured). Widths grow by heads at the config's head_dim and GQA group, as the presets and
the scaling planner grow models. Every step trains on the same small batch (`batch_size` sequences
of `seq_len` tokens from the config's data), and after every step the RMS of these activations on
that batch is recorded:

- `embedding`: the token embedding's output;
- `attn_logits.I`: block I's attention logits, q.k x the softmax scale, before the causal mask;
- `block.I`: block I's output (the residual stream after it);
- `logits`: the LM head's output.

Across depths, where block indices do not line up, they are named by the relative depth of what
is measured: `block.half` and `block.last` are the outputs of blocks L/2 - 1 and L - 1 (half-way
up and the top), `attn_logits.first` and `attn_logits.half` are the logits of blocks 0 and L/2
(whose inputs sit at the bottom and half-way up). The slope of log RMS against
log width (or depth), by least squares after the last step, is ~0 for every activation when the
parametrization transfers (muP across width, CompleteP across width and depth), and grows with
width under sp (the logits first).

Why one small batch: it is what microsoft/mup's `get_coord_data` does by default (fix_data), and
it measures the update on the input it was computed from. With a fresh batch every step the
blocks drift down with width more, the more so the more tokens a batch holds (measured with
microsoft's loop on our model, bench/bench_mup_fresh_batches.py: block slopes -0.07 to -0.15 with
fresh 32-token batches, -0.10 to -0.33 with 256-token ones; docs/mup.md). So the check trains and
measures on one batch of 32 tokens by default.

Written by hand, on one process without DeepSpeed, like microsoft/mup's loop, and cross-checked
against it: its `_get_coord_data` runs our model and optimizer unchanged and gives the same slopes
(tests/test_mup.py::test_coordinate_check_agrees_with_microsofts). Ours adds the attention logits
(not a module's output, so not something its hooks can see), the depth sweep and the plots.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import torch

from pretrain.config import Config, load_config
from pretrain.errors import ConfigError, UserError
from pretrain.model.args import ModelArgs
from pretrain.model.attention import Attention
from pretrain.model.model import Transformer
from pretrain.optim.optimizer import build_optimizer, set_lr
from pretrain.parallel.parallelize import resolve_precision

log = logging.getLogger(__name__)


def _rms(x: torch.Tensor) -> float:
    return x.float().pow(2).mean().sqrt().item()


class Probe:
    """Forward hooks that record the RMS of the activations above, in `measure` only (the training
    forwards pass them by)."""

    def __init__(self, model: Transformer):
        self.sq: dict[str, float] = {}
        self.active = False
        self.handles = [model.tok_embeddings.register_forward_hook(self._keep("embedding"))]
        blocks = list(model.layers)
        for i, block in enumerate(blocks):
            self.handles.append(block.register_forward_hook(self._keep(f"block.{i}")))
            self.handles.append(block.attention.register_forward_pre_hook(self._attention(f"attn_logits.{i}")))

    def _keep(self, key: str):
        def hook(module, inputs, output):
            if self.active:
                self.sq[key] = _rms(output) ** 2
        return hook

    def _attention(self, key: str):
        def hook(module: Attention, inputs):
            if not self.active:
                return
            x, freqs_cis = inputs[0], inputs[1]
            q, k, _ = module.qkv(x, freqs_cis)
            k = k.repeat_interleave(module.n_heads // module.n_kv_heads, dim=2)  # GQA: each query head's keys
            scale = module.scale or 1 / math.sqrt(module.head_dim)
            logits = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale  # (B, H, T, T)
            self.sq[key] = logits.pow(2).mean().item()
        return hook

    def measure(self, model: Transformer, tokens: torch.Tensor) -> dict[str, float]:
        """RMS of each activation on `tokens`, also under the names by relative depth."""
        self.sq, self.active = {}, True
        with torch.no_grad():
            self.sq["logits"] = _rms(model(tokens, **_documents(model, tokens))) ** 2
        self.active = False
        n = len(model.layers)
        out = {k: math.sqrt(v) for k, v in self.sq.items()}
        if n % 2 == 0:
            out["attn_logits.first"], out["attn_logits.half"] = out["attn_logits.0"], out[f"attn_logits.{n // 2}"]
            out["block.half"], out["block.last"] = out[f"block.{n // 2 - 1}"], out[f"block.{n - 1}"]
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _documents(model: Transformer, tokens: torch.Tensor) -> dict:
    import data_pipeline as dp

    return dp.document_inputs(tokens, model.args.document_eot, model.args.document_positions)


def train_and_measure(args: ModelArgs, cfg: Config, batch: tuple[torch.Tensor, torch.Tensor], steps: int,
                      seed: int) -> list[dict[str, float]]:
    """The activations' RMS after each of `steps` steps of one model on `batch` (inputs, labels):
    one dict per step."""
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    set_lr(optimizer, cfg.optimizer.lr)
    probe, (inputs, labels), out = Probe(model), batch, []
    for _ in range(steps):
        loss = model(inputs, labels, **_documents(model, inputs))
        if not torch.isfinite(loss):
            raise UserError(f"the check diverged at model.dim={args.dim}, model.n_layers={args.n_layers} "
                            f"(loss {loss.item()}): lower optimizer.lr")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(probe.measure(model, inputs))
    probe.close()
    return out


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-30)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def sized(base: ModelArgs, name: str, size: int) -> ModelArgs:
    """The check's model of width (`dim`) or depth (`n_layers`) `size`: widths by heads of the
    base's head_dim, with its GQA group."""
    if name == "n_layers":
        args = dataclasses.replace(base, n_layers=size)
    else:
        if size % base.head_dim:
            raise ConfigError(f"--widths: {size} is not a multiple of head_dim {base.head_dim} (model.dim / "
                              "model.n_heads): widths grow by heads")
        from pretrain.scaling.plan import grown

        heads = size // base.head_dim
        group = base.n_heads // base.kv_heads
        if heads % group:
            raise ConfigError(f"--widths: {size} has {heads} heads, not a multiple of the GQA group of {group} "
                              "query heads per KV head")
        args = grown(base, base.n_layers, heads // group)  # as the scaling planner grows its family
    problems = args.problems()
    if problems:
        raise ConfigError(f"model.{name}={size}: " + "; ".join(problems))
    return args


def _sweep(name: str, sizes: list[int], base: ModelArgs, cfg: Config, batch, steps: int, seeds: int) -> dict:
    """{"sizes", "rms": {key: [[per step] per size]}, "slopes": {key: slope after the last step}}."""
    per_size = []
    for size in sizes:
        args = sized(base, name, size)
        runs = [train_and_measure(args, cfg, batch, steps, cfg.train.seed + s) for s in range(seeds)]
        per_size.append([{k: sum(r[t][k] for r in runs) / seeds for k in runs[0][t]} for t in range(steps)])
        log.info("%s=%d: %s", name, size, "  ".join(f"{k} {v:.3g}" for k, v in per_size[-1][-1].items()
                                                     if not k[-1].isdigit()))
    keys = [k for k in per_size[0][0] if k in per_size[-1][0]]
    if name == "dim":  # every block's own keys
        keys = [k for k in keys if not k.endswith((".first", ".half", ".last"))]
    else:  # blocks do not line up across depths
        keys = [k for k in keys if not k[-1].isdigit()]
    rms = {k: [[step[k] for step in steps] for steps in per_size] for k in keys}
    return {"sizes": sizes, "rms": rms, "slopes": {k: slope(sizes, [r[-1] for r in rms[k]]) for k in keys}}


def _batch(cfg: Config, batch_size: int, seq_len: int):
    """One batch of the config's data (inputs, labels), and the vocab size."""
    import data_pipeline as dp

    from pretrain.build import tokenizer_and_model_args

    tokenizer, filled = tokenizer_and_model_args(cfg)
    loader = dp.build_loader(dataclasses.replace(cfg.data, seq_len=seq_len), tokenizer, micro_batch_size=batch_size)
    batch = next(iter(loader))
    return (batch["input_ids"], batch["labels"]), filled.vocab_size


def check(config: str, overrides: list[str], widths: list[int], depths: list[int], steps: int = 10,
          seeds: int = 8, batch_size: int = 2, seq_len: int = 16) -> dict:
    cfg = load_config(config, overrides)
    # What `pretrain train` refuses on this machine (train.precision=fp16 or unemulated fp8 without CUDA,
    # fp8 without torchao) is refused by the same check: one line, exit 2. What it would run (bf16,
    # float8 matmuls), the check does not: it trains and measures in fp32 on the CPU, and says so.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (as distributed.init picks)
    precision = resolve_precision(cfg, device)
    if precision != "fp32" or cfg.train.precision == "fp8":
        log.warning("note: the check trains and measures in fp32 on the CPU, not as `pretrain train` runs "
                    "train.precision=%s here (%s)", cfg.train.precision,
                    "float8 matmuls" if cfg.train.precision == "fp8" else precision)
    if len(widths) == 1 or len(depths) == 1:
        raise UserError("--widths and --depths each need at least two sizes to fit a slope")
    if not widths and not depths:
        raise UserError("give --widths or --depths (or both)")
    if any(d % 2 for d in depths):
        raise UserError(f"--depths {','.join(map(str, depths))}: give even depths (blocks are compared half-way up)")
    if min(steps, seeds, batch_size, seq_len) < 1:
        raise UserError("--steps, --seeds, --batch-size and --seq-len must be at least 1")
    if widths and cfg.model.ffn_hidden_dim:
        raise ConfigError(f"model.ffn_hidden_dim={cfg.model.ffn_hidden_dim} fixes the SwiGLU width while --widths "
                          "varies model.dim: set it to 0 (derived from dim)")
    batch, vocab = _batch(cfg, batch_size, seq_len)
    base = dataclasses.replace(cfg.model, vocab_size=vocab)
    result = {"parametrization": base.parametrization, "mup_base_dim": base.mup_base_dim,
              "mup_base_layers": base.mup_base_layers, "dim": base.dim, "n_layers": base.n_layers,
              "lr": cfg.optimizer.lr, "steps": steps, "seeds": seeds,
              "batch_size": batch_size, "seq_len": seq_len}
    if widths:
        w = _sweep("dim", widths, base, cfg, batch, steps, seeds)
        result.update(widths=widths, rms=w["rms"], slopes=w["slopes"])
    if depths:
        d = _sweep("n_layers", depths, base, cfg, batch, steps, seeds)
        result.update(depths=depths, depth_rms=d["rms"], depth_slopes=d["slopes"])
    return result


def plot(result: dict, out_dir: Path) -> list[Path]:
    """coord_check_width.png / coord_check_depth.png: RMS against size at a few steps, one line per
    activation, as microsoft/mup draws its coordinate checks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for kind, sizes_key, rms_key, slopes_key in (("width", "widths", "rms", "slopes"),
                                                 ("depth", "depths", "depth_rms", "depth_slopes")):
        if sizes_key not in result:
            continue
        sizes, rms, slopes, steps = result[sizes_key], result[rms_key], result[slopes_key], result["steps"]
        shown = sorted({1, max(1, steps // 3), max(1, 2 * steps // 3), steps})
        fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 4.2), sharey=True, squeeze=False)
        cmap = plt.get_cmap("viridis")
        for ax, t in zip(axes[0], shown):
            for i, (key, per_size) in enumerate(rms.items()):
                ax.plot(sizes, [r[t - 1] for r in per_size], marker="o", color=cmap(i / max(1, len(rms) - 1)),
                        label=f"{key} ({slopes[key]:+.2f})" if t == steps else key)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.set_xlabel("model.dim" if kind == "width" else "model.n_layers")
            ax.set_title(f"after step {t}")
            ax.grid(alpha=0.3, which="both")
        axes[0][0].set_ylabel("activation RMS")
        axes[0][-1].legend(fontsize=7, title="slope after the last step", title_fontsize=7, loc="upper left",
                           bbox_to_anchor=(1.02, 1.0))
        fig.suptitle(f"coordinate check, {kind}: parametrization={result['parametrization']}, "
                     f"lr={result['lr']:g}, {result['seeds']} seeds")
        fig.tight_layout()
        path = out_dir / f"coord_check_{kind}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    return written


def _sizes(text: str, flag: str) -> list[int]:
    if not text:
        return []
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(f"{flag} {text}: give comma-separated integers, e.g. 64,128,256") from None
    if any(s <= 0 for s in sizes) or len(set(sizes)) != len(sizes):
        raise UserError(f"{flag} {text}: sizes must be positive and distinct")
    return sorted(sizes)


def check_cli(args) -> None:
    from pretrain.plot import png_dir

    out_dir = png_dir(args.out) if args.out else None
    result = check(args.config, args.overrides, _sizes(args.widths, "--widths"), _sizes(args.depths, "--depths"),
                   args.steps, args.seeds, args.batch_size, args.seq_len)
    for label, key in (("width", "slopes"), ("depth", "depth_slopes")):
        if key in result:
            worst = max(result[key], key=lambda k: abs(result[key][k]))
            print(f"{label} slopes (log RMS vs log {label}, after step {result['steps']}), "
                  f"parametrization={result['parametrization']}:")
            for k, v in result[key].items():
                print(f"  {k:16s} {v:+.3f}")
            print(f"  largest |slope|: {abs(result[key][worst]):.3f} ({worst})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if out_dir:
        for path in plot(result, out_dir):
            print(f"wrote {path}")
