"""Peak memory and time of the output projection + cross-entropy: all logits at once (cast to fp32)
against the model's chunked loss (LMHead), forward and backward, in bf16.

    python bench/bench_loss.py                              # 8192 tokens, vocab 32000, dim 2048
    python bench/bench_loss.py --tokens 8192 --vocab 128256 --device cuda

Each variant runs in a fresh process; memory is the peak over a pass minus the memory before it
(GPU: torch's peak allocated, second pass; CPU: the process's peak RSS over the first pass, the
time from the second). The variants alternate over --rounds.
Prints a table; --json writes it. Figures go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def one_pass(kind: str, tokens: int, vocab: int, dim: int, device: str, chunk: int) -> dict:
    import resource

    import torch
    import torch.nn.functional as F

    from pretrain.model.model import LMHead

    dev = torch.device(device)
    torch.manual_seed(0)
    head = LMHead(dim, vocab, bias=False).to(dev, torch.bfloat16)
    h = torch.randn(tokens, 1, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (tokens, 1), device=dev)
    import psutil

    peaks, times = [], []
    for _ in range(2):  # memory from the first pass (the process's peak RSS only grows), time from the second
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            before = psutil.Process().memory_info().rss
        t0 = time.perf_counter()
        if kind == "full":
            loss = F.cross_entropy(head(h).float().flatten(0, 1), y.flatten())
        else:
            loss = head(h, y, chunk)
        loss.backward()
        loss = loss.item()
        times.append(time.perf_counter() - t0)
        peaks.append((torch.cuda.max_memory_allocated() if dev.type == "cuda"
                      else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - before)
        h.grad = head.weight.grad = None
    peak, seconds = (peaks[-1] if dev.type == "cuda" else peaks[0]), times[-1]
    return {"loss": loss, "peak_gib": peak / 2**30, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=0, help="tokens per chunk (0 = the model's default rule)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one_pass(a.one, a.tokens, a.vocab, a.dim, a.device, a.chunk)))
        return
    got = {"full": [], "chunked": []}
    for r in range(a.rounds):
        for kind in (("full", "chunked") if r % 2 == 0 else ("chunked", "full")):
            out = subprocess.run([sys.executable, __file__, "--one", kind, "--tokens", str(a.tokens), "--vocab",
                                  str(a.vocab), "--dim", str(a.dim), "--device", a.device, "--chunk", str(a.chunk)],
                                 check=True, capture_output=True, text=True)
            got[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
    summary = {k: {m: statistics.median(x[m] for x in v) for m in ("peak_gib", "seconds", "loss")}
               for k, v in got.items()}
    full, chunked = summary["full"], summary["chunked"]
    print(f"{a.tokens} tokens x vocab {a.vocab} (dim {a.dim}, bf16, {a.device}); logits alone would be "
          f"{a.tokens * a.vocab * 2 / 2**30:.2f} GiB in bf16, {a.tokens * a.vocab * 4 / 2**30:.2f} GiB in fp32")
    print("| loss | peak memory over the pass | forward + backward | loss value |")
    print("|---|---|---|---|")
    for k, v in summary.items():
        print(f"| {k} | {v['peak_gib']:.2f} GiB | {v['seconds']:.2f} s | {v['loss']:.6f} |")
    print(f"memory saved: {full['peak_gib'] - chunked['peak_gib']:.2f} GiB ({1 - chunked['peak_gib'] / full['peak_gib']:.0%});"
          f" time ratio chunked / full {chunked['seconds'] / full['seconds']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "summary": summary, "rounds": got}, indent=1))


if __name__ == "__main__":
    main()
