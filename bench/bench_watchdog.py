"""What the straggler and hang watch (pretrain/faults/watchdog.py, stragglers.py) costs the training loop: the
watchdog's sampling (50 per second) and the compute clock's marks (hooks on every module that holds
parameters, as at ZeRO-3, where there are the most).

Trains the tiny model's step (forward, backward, AdamW) on this process's CPU in a loop, with a
Watchdog and a ComputeClock running and without, alternately, and prints the step times and their
ratio, plus the cost of one sample. A GPU run's host loop (kernel launches, Python) shares the GIL
with the sampler the same way; there the clock's marks are CUDA events.

    python bench/bench_watchdog.py [--steps 30] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pretrain.config import load_config
from pretrain.faults.stragglers import ComputeClock
from pretrain.faults.watchdog import Watchdog, _in_collective
from pretrain.model.model import Transformer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(Path(__file__).parent.parent / "configs" / "tiny.yaml", ["model.vocab_size=4096"])
    model = Transformer(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 4096, (4, 256))

    def steps() -> float:
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter() - start) / args.steps

    steps()  # warm-up
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            off.append(steps())
            dog = Watchdog(Path(tmp), 0, ["host"], fixed_s=3600, cap_s=7200)
            clock = ComputeClock(model, torch.device("cpu"), zero_stage=3)
            on.append(steps())
            clock.take()
            dog.close()
            clock.close()
    n = 10000
    start = time.perf_counter()
    for _ in range(n):
        _in_collective()
    sample_us = (time.perf_counter() - start) / n * 1e6
    print(f"step without the watchdog and the compute clock: {statistics.median(off) * 1e3:.1f} ms, with them: "
          f"{statistics.median(on) * 1e3:.1f} ms (medians of {args.rounds} alternating rounds of {args.steps} steps); "
          f"ratio {statistics.median(on) / statistics.median(off):.3f}; one sample {sample_us:.1f} us")


if __name__ == "__main__":
    main()
