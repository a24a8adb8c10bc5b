"""The trainer against a plain PyTorch loop: the same model, data, batch, AdamW and clipping, no
DeepSpeed, no trainer. The gap is what DeepSpeed and the trainer cost per step.

    python bench/bench_step.py                                   # configs/tiny.yaml, 1 process
    python bench/bench_step.py distributed.zero_stage=0          # any overrides, applied to both
    python bench/bench_step.py --rounds 4 --steps 40 --json out.json
    python bench/bench_step.py --ab train.compile=true           # the trainer against itself with
    python bench/bench_step.py --ab distributed.zero_stage=3     #   these overrides added (B / A)

Each round runs `pretrain train` and the plain loop (or, with --ab, the trainer with the extra
overrides) once each, in fresh processes, in alternating order, so machine noise hits both alike;
tokens/s is measured over the steps after --warmup. Prints a table and the per-round ratio;
--json writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.yaml"


def plain_loop(config: str, overrides: list[str], steps: int, warmup: int) -> float:
    """Tokens/s of a textbook loop over the same model and data (runs in its own process)."""
    import torch
    import torch.nn.functional as F

    import data_pipeline as dp
    from pretrain.build import tokenizer_and_model_args
    from pretrain.config import load_config
    from pretrain.model.model import Transformer
    from pretrain.optim.optimizer import param_groups

    from pretrain.parallel.distributed import keep_freed_memory

    keep_freed_memory()  # the trainer's allocator setting on CPU: the loop gets it too
    cfg = load_config(config, overrides, world_size=1)
    tok, args = tokenizer_and_model_args(cfg)
    torch.manual_seed(cfg.train.seed)
    model = Transformer(args)
    model.init_weights()
    if cfg.train.compile:
        model.compile()
    o = cfg.optimizer
    opt = torch.optim.AdamW(param_groups(model, o), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    accum = cfg.grad_accum(1)
    data = iter(dp.build_loader(cfg.data, tok, 0, 1, cfg.train.micro_batch_size))
    t0 = None
    for step in range(steps):
        if step == warmup:
            t0 = time.perf_counter()
        for _ in range(accum):
            batch = next(data)
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten()) / accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return (steps - warmup) * cfg.global_batch(1) * cfg.data.seq_len / (time.perf_counter() - t0)


def trainer(config: str, overrides: list[str], steps: int, warmup: int) -> float:
    """Tokens/s of `pretrain train` over the steps after `warmup` (its log records, one per `warmup`
    steps, each with the window's mean step time; the first window is the warm-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "pretrain", "train", config, *overrides, f"train.max_steps={steps}",
                f"logging.log_every={warmup}", "logging.wandb=disabled", "logging.progress=false", f"train.run_dir={tmp}",
                "train.eval_every=0", "data.validation=[]"]
        subprocess.run(args, check=True, cwd=REPO, capture_output=True)
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "perf/step_time_s" in r]
    times = [r["perf/step_time_s"] for r in train][1:]
    return train[-1]["tokens_seen"] // steps * len(times) / sum(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("overrides", nargs="*", help="config overrides for both")
    p.add_argument("--config", default=str(TINY))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps; --steps must be a multiple of it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--ab", nargs="+", metavar="OVERRIDE", help="compare the trainer with these overrides added")
    p.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)  # the child process
    a = p.parse_args()
    if a.plain:
        print(plain_loop(a.config, a.overrides, a.steps, a.warmup))
        return
    base, other = ("trainer", "plain") if not a.ab else ("A", "B")
    rounds = []
    for i in range(a.rounds):
        got = {}
        for name in ((base, other) if i % 2 == 0 else (other, base)):
            if name in ("trainer", "A"):
                got[name] = trainer(a.config, a.overrides, a.steps, a.warmup)
            elif name == "B":
                got[name] = trainer(a.config, a.overrides + a.ab, a.steps, a.warmup)
            else:
                out = subprocess.run([sys.executable, __file__, "--plain", "--config", a.config,
                                      "--steps", str(a.steps), "--warmup", str(a.warmup), *a.overrides],
                                     check=True, capture_output=True, text=True, cwd=REPO)
                got[name] = float(out.stdout.strip().splitlines()[-1])
        got["ratio"] = got[base] / got[other] if not a.ab else got["B"] / got["A"]
        rounds.append(got)
        print(f"round {i + 1}: {base} {got[base]:9,.0f} tok/s | {other} {got[other]:9,.0f} tok/s | "
              f"ratio {got['ratio']:.3f}", flush=True)
    ratios = [r["ratio"] for r in rounds]
    what = "trainer / plain" if not a.ab else f"B ({' '.join(a.ab)}) / A"
    print(f"median ratio {what}: {statistics.median(ratios):.3f} (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}) over {a.rounds} rounds; overrides: {' '.join(a.overrides) or '-'}")
    if a.json:
        import torch

        Path(a.json).write_text(json.dumps({
            "bench": "step", "overrides": a.overrides, "ab": a.ab, "rounds": rounds, "median_ratio": statistics.median(ratios),
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "torch": torch.__version__}}, indent=1))


if __name__ == "__main__":
    main()
