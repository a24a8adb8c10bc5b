"""Forward+backward throughput of our Transformer against transformers' LlamaForCausalLM.

Both models get the same shape and the same (converted) weights; each iteration is
logits -> cross-entropy -> backward, timed alternately in one process so that machine noise
hits both alike. Prints tokens/s for each and the ratio (ours / HF; above 1 means ours is faster).

    python bench/bench_model.py --dim 256 --n-layers 4 --seq-len 256 --batch 8 --vocab 4096
    python bench/bench_model.py --iters 30 --keep-freed-memory --json model.json
    python bench/bench_model.py --iters 30 --warmup 5 --compile --keep-freed-memory
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pretrain.hf.mapping import to_hf_config, to_hf_state_dict
from pretrain.model.args import ModelArgs
from pretrain.model.model import Transformer


def step(model, tokens: torch.Tensor, hf: bool) -> None:
    logits = model(tokens).logits if hf else model(tokens)  # (B, T, V)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations per model")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per model")
    p.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention implementation")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="the trainer's CPU allocator setting (pretrain.parallel.distributed.keep_freed_memory)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.keep_freed_memory:
        from pretrain.parallel.distributed import keep_freed_memory

        keep_freed_memory()

    args = ModelArgs(dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads,
                     vocab_size=a.vocab, max_seq_len=a.seq_len)
    ours = Transformer(args)
    torch.manual_seed(0)
    ours.init_weights()
    from transformers import LlamaForCausalLM

    cfg = to_hf_config(args)
    cfg._attn_implementation = a.hf_attn
    hf = LlamaForCausalLM(cfg).float()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), args), strict=True)
    ours.train(), hf.train()
    if a.compile:
        ours.compile()
        hf.compile()
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq_len))

    for _ in range(a.warmup):
        step(ours, tokens, hf=False)
        step(hf, tokens, hf=True)
    # Alternate which model goes first each round; the per-round ratio cancels slow drifts in load.
    times = {"ours": [], "hf": []}
    for i in range(a.iters):
        order = (("ours", ours), ("hf", hf)) if i % 2 == 0 else (("hf", hf), ("ours", ours))
        for name, model in order:
            t0 = time.perf_counter()
            step(model, tokens, hf=name == "hf")
            times[name].append(time.perf_counter() - t0)

    n_tok = a.batch * a.seq_len
    rate = {k: n_tok / statistics.median(v) for k, v in times.items()}
    best = {k: n_tok / min(v) for k, v in times.items()}  # least disturbed by other load
    ratio = statistics.median(h / o for o, h in zip(times["ours"], times["hf"]))
    print(f"shape: {vars(a)}  torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}")
    print(f"ours : {rate['ours']:7.0f} tokens/s median, {best['ours']:7.0f} best of {a.iters}")
    print(f"HF   : {rate['hf']:7.0f} tokens/s median, {best['hf']:7.0f} best (LlamaForCausalLM, attn={a.hf_attn})")
    print(f"ratio ours/HF: {ratio:.3f} (median over rounds of HF time / our time)")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "torch": torch.__version__, "threads": torch.get_num_threads(),
                                            "tokens_per_s_median": rate, "tokens_per_s_best": best,
                                            "ratio_ours_over_hf": ratio}, indent=1))


if __name__ == "__main__":
    main()
