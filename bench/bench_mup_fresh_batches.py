"""The coordinate check with a fresh batch every step, run by microsoft/mup's own loop
(`mup.coord_check._get_coord_data`, fix_data=False) on our model and optimizer groups: the slopes of
log RMS against log width of the embedding, block and logit outputs after `--steps` steps, for
batches of `--batch` x `--seq-len` tokens. `pretrain mup check` trains on one fixed batch; this
measures what fresh batches add (docs/mup.md).

    python bench/bench_mup_fresh_batches.py --batch 2 --seq-len 16      # 32 tokens a step
    python bench/bench_mup_fresh_batches.py --batch 16 --seq-len 16     # 256 tokens a step
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("overrides", nargs="*", default=["model.parametrization=mup", "model.mup_base_dim=64",
                                                    "model.mup_base_head_dim=32"])
    p.add_argument("--widths", default="64,128,256,512")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=16)
    a = p.parse_args()

    import torch
    from mup.coord_check import _get_coord_data

    import data_pipeline as dp
    from pretrain.build import tokenizer_and_model_args
    from pretrain.config import load_config
    from pretrain.model.model import Transformer
    from pretrain.mup import sized, slope
    from pretrain.optim.optimizer import build_optimizer, set_lr

    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs" / "tiny.yaml", a.overrides)
    tokenizer, filled = tokenizer_and_model_args(cfg)
    base = dataclasses.replace(cfg.model, vocab_size=filled.vocab_size)
    data = dataclasses.replace(cfg.data, seq_len=a.seq_len)
    loader = iter(dp.build_loader(data, tokenizer, micro_batch_size=a.batch))
    # the same fresh batches for every width and seed: (inputs, labels flattened for its cross-entropy)
    batches = [(b["input_ids"], b["labels"].reshape(-1)) for b in (next(loader) for _ in range(a.steps + 1))]
    widths = [int(w) for w in a.widths.split(",")]

    def lazy(width):
        def build():
            model = Transformer(sized(base, "dim", width))
            model.init_weights()
            return model
        return build

    def optimizer(model):
        opt = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
        set_lr(opt, cfg.optimizer.lr)
        return opt

    names = {"tok_embeddings": "embedding", **{f"layers.{i}": f"block.{i}" for i in range(base.n_layers)},
             "output": "logits"}
    df = _get_coord_data({w: lazy(w) for w in widths}, batches, optimizer, nsteps=a.steps + 1, fix_data=False,
                         flatten_output=True, cuda=False, nseeds=a.seeds, show_progress=False,
                         filter_module_by_name=lambda n: n in names,
                         output_fdict={"rms": lambda x: x.float().pow(2).mean().sqrt()})
    # step steps + 1's forward sees the weights after `steps` updates (each on its own batch)
    last = df[df.t == a.steps + 1].groupby(["module", "width"])["rms"].mean()
    print(f"{' '.join(a.overrides) or 'sp'}: fresh {a.batch} x {a.seq_len} batches, {a.steps} steps, {a.seeds} seeds, "
          f"widths {a.widths}")
    for module, key in names.items():
        print(f"  {key:10s} {slope(widths, [last[(module, w)] for w in widths]):+.3f}")


if __name__ == "__main__":
    main()
