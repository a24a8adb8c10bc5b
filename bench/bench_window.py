"""Sliding-window attention against full causal: one layer's attention, timed alternately in one run.

    python bench/bench_window.py                                   # CUDA: bf16, forward + backward
    python bench/bench_window.py --device cpu --threads 1 --clock cpu   # CPU: fp32 (docs/performance.md)
    python bench/bench_window.py --seq-lens 4096 --windows 1024 --json $OUT/window.json

For each sequence length T and window W, two pairs, each timed A, B, A, B ... (--repeats of each,
the medians compared, after one untimed call of each that compiles):
- layers: what the model runs for a global layer (SDPA, is_causal: flash attention) against what it
  runs for a local one (Attention.attend: FlexAttention with the cached block mask on CUDA, compiled;
  elsewhere SDPA with the dense boolean window mask), forward + backward;
- flex: FlexAttention compiled, the causal block mask against the window's: the same kernel, so
  the ratio is the blocks the mask skips. On CUDA forward + backward; on CPU forward only, since
  torch 2.13's FlexAttention refuses backward on CPU (even compiled).
Printed per row: time per layer call of each side, the measured ratio (local / global), the ratio
of the blocks the two block masks keep (what a block-skipping kernel computes), and the FLOP ratio
the model counts (flops_per_token: twice the causal band, 2 W - W (W - 1) / T keys per query, against T).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

from pretrain.model import attention
from pretrain.model.args import ModelArgs
from pretrain.model.attention import Attention, _structured_block_mask
from pretrain.model.model import flops_per_token, matmul_params


def attention_flops(args: ModelArgs, T: int) -> int:
    """The attention term of flops_per_token (12 H hd x keys per query, summed over layers)."""
    return flops_per_token(args, T) - 6 * matmul_params(args)


def kept_blocks(T: int, window: int, device: torch.device) -> int:
    """Blocks (query block x key block) the block mask computes, partial and full."""
    m = _structured_block_mask(T, window, device)
    full = m.full_kv_num_blocks.sum().item() if m.full_kv_num_blocks is not None else 0
    return m.kv_num_blocks.sum().item() + full


def timed(fn, sync, clock) -> float:
    sync()
    t0 = clock()
    fn()
    sync()
    return clock() - t0


def measure(a, T: int, W: int, dev: torch.device, dtype: torch.dtype, flex) -> list[dict]:
    """Both pairs at sequence length T and window W: their medians, ratios and counted figures."""
    shape = dict(dim=a.heads * a.head_dim, n_heads=a.heads, n_kv_heads=a.kv_heads, max_seq_len=T, n_layers=1,
                 vocab_size=256)
    full_args = ModelArgs(**shape)
    local_args = ModelArgs(**shape, sliding_window=W, layer_pattern=["local"])
    glob, local = Attention(full_args).to(dev), Attention(local_args).to(dev)
    assert local.window == W and glob.window == 0
    torch.manual_seed(0)
    q = torch.randn(a.batch, T, a.heads, a.head_dim, device=dev, dtype=dtype, requires_grad=True)  # (B, T, H, hd)
    k = torch.randn(a.batch, T, a.kv_heads, a.head_dim, device=dev, dtype=dtype, requires_grad=True)  # (B, T, KV, hd)
    v = torch.randn_like(k, requires_grad=True)
    grad = torch.randn_like(q)
    gqa = a.heads != a.kv_heads

    def train(layer):
        def run():
            layer.attend(q, k, v).backward(grad)
            q.grad = k.grad = v.grad = None
        return run

    def flex_call(window: int, backward: bool):
        mask = _structured_block_mask(T, window, dev)

        def run():
            # (B, H, T, hd) views, as Attention.attend hands them to the kernel
            qt, kt, vt = (x.transpose(1, 2) if backward else x.detach().transpose(1, 2) for x in (q, k, v))
            out = flex(qt, kt, vt, block_mask=mask, enable_gqa=gqa)
            if backward:
                out.backward(grad.transpose(1, 2))
                q.grad = k.grad = v.grad = None
        return run

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    flex_backward = dev.type == "cuda"
    local_kernel = "FlexAttention, block mask" if dev.type in attention.FLEX_DEVICES else "SDPA, dense mask"
    pairs = [("layers", "fwd+bwd", ("SDPA causal", train(glob)), (local_kernel, train(local))),
             ("flex", "fwd+bwd" if flex_backward else "fwd only", ("FlexAttention causal", flex_call(0, flex_backward)),
              ("FlexAttention window", flex_call(W, flex_backward)))]
    flop_ratio = attention_flops(local_args, T) / attention_flops(full_args, T)
    block_ratio = kept_blocks(T, W, dev) / kept_blocks(T, 0, dev)
    rows = []
    for name, passes, (g_kernel, g_fn), (l_kernel, l_fn) in pairs:
        with torch.no_grad() if passes == "fwd only" else torch.enable_grad():
            first = {"global": timed(g_fn, sync, clock), "local": timed(l_fn, sync, clock)}  # (compiles)
            times = {"global": [], "local": []}
            for i in range(a.repeats):
                order = (("global", g_fn), ("local", l_fn))
                for side, fn in order if i % 2 == 0 else order[::-1]:  # A, B, then B, A
                    times[side].append(timed(fn, sync, clock))
        g, loc = statistics.median(times["global"]), statistics.median(times["local"])
        row = {"seq_len": T, "window": W, "pair": name, "pass": passes, "global_kernel": g_kernel,
               "local_kernel": l_kernel, "global_ms": 1e3 * g, "local_ms": 1e3 * loc, "ratio": loc / g,
               "block_ratio": block_ratio, "flop_ratio": flop_ratio, "first_call_s": first,
               "times_s": times}
        rows.append(row)
        print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "times_s"}), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-lens", default="4096,8192", help="sequence lengths T, comma-separated")
    p.add_argument("--windows", default="512,1024", help="windows W in tokens, comma-separated")
    p.add_argument("--dtype", default="", help="bfloat16 | float32 (default: bfloat16 on CUDA, float32 elsewhere)")
    p.add_argument("--batch", type=int, default=0, help="sequences (default: 4 on CUDA, 1 elsewhere)")
    p.add_argument("--heads", type=int, default=0, help="query heads (default: 16 on CUDA, 2 elsewhere)")
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: heads / 2)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=0, help="timed calls of each side (default: 10 on CUDA, 3 elsewhere)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="wall time, or this process's CPU time (a CPU shared with other jobs: with --threads 1, "
                        "the work done and not the wait for a core)")
    p.add_argument("--json", help="write every figure here")
    a = p.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    a.batch, a.heads = a.batch or (4 if cuda else 1), a.heads or (16 if cuda else 2)
    a.kv_heads, a.repeats = a.kv_heads or max(a.heads // 2, 1), a.repeats or (10 if cuda else 3)
    if a.clock == "cpu" and cuda:
        p.error("--clock cpu times CPU work: not a GPU's")
    if a.threads:
        torch.set_num_threads(a.threads)
    # the model's own compiled FlexAttention on CUDA (its compilations shared with the local layer's);
    # on a CPU the model runs FlexAttention eager (scores materialised): compiled here for the forward
    flex = attention._flex_attention(dev) if cuda else torch.compile(flex_attention)
    name = torch.cuda.get_device_name() if cuda else f"{os.cpu_count()}-core CPU"
    device = f"{name}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}"
    threads = f", {torch.get_num_threads()} thread(s)" if not cuda else ""
    print(f"{device}{threads}; batch {a.batch}, {a.heads} heads ({a.kv_heads} KV) of {a.head_dim}; "
          f"{a.clock} clock, median of {a.repeats}", flush=True)
    rows = []
    for T in map(int, a.seq_lens.split(",")):
        for W in map(int, a.windows.split(",")):
            rows += measure(a, T, W, dev, dtype, flex)
            if a.json:  # after every row: a run cut short keeps what it measured
                Path(a.json).write_text(json.dumps({"device": device, "args": vars(a), "results": rows}, indent=1))
    print("\n| T | W | pass | global layer | ms | local layer | ms | measured local/global | blocks kept "
          "local/global | FLOPs local/global |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq_len']:,} | {r['window']:,} | {r['pass']} | {r['global_kernel']} | {r['global_ms']:,.1f} | "
              f"{r['local_kernel']} | {r['local_ms']:,.1f} | {r['ratio']:.2f} | {r['block_ratio']:.2f} | "
              f"{r['flop_ratio']:.3f} |")


if __name__ == "__main__":
    main()
