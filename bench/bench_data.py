"""Data pipeline throughput against the raw tokenizer, and the prepared (memmap) loader.

On one corpus (tinyshakespeare paragraphs, or the builtin Python docs, repeated to --copies), in one
process run, one after the other:
  raw       Tokenizer.encode_batch on 1000 documents a call (its own threads), main process only
  pipeline  build_loader over a jsonl copy of the corpus: read + tokenize + pack + block-shuffle in
            --workers DataLoader workers, batches collated in the main process, one whole epoch
  prepare   `prepare` with all cores (tokens/s written)
  prepared  build_loader over the prepared dir (memmap, permuted windows), --prepared-batches batches
Tokens are counted as delivered window tokens (seq_len+1 per sequence) against tokens encoded.

    python bench/bench_data.py --copies 4 --workers 2 --seq-len 1024
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"


def corpus_docs(copies: int) -> tuple[list[str], str]:
    path = SHARED / "tinyshakespeare.txt"
    if path.exists():
        docs = [p for p in path.read_text().split("\n\n") if p.strip()]
        name = "tinyshakespeare paragraphs"
    else:
        from data_pipeline.builtin import python_docs

        docs, name = python_docs(), "builtin python-docs"
    return docs * copies, f"{name} x{copies}"


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (loader workers), all threads."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def raw_rate(spec: str, data: Path) -> tuple[int, float, float]:
    """encode_batch over the corpus, 1000 documents a call, in a fresh process (its tokenizer threads
    are never forked into loader workers). Returns (tokens incl. one EOT per doc, tokens/s, CPU s)."""
    code = ("import sys,time,json;from data_pipeline import load_tokenizer;"
            f"tok=load_tokenizer({spec!r});docs=[json.loads(l)['text'] for l in open({str(data)!r})];"
            "t=time.perf_counter();c=time.process_time();n=0\n"
            "for i in range(0,len(docs),1000): n+=sum(len(e.ids)+1 for e in tok.encode_batch(docs[i:i+1000]))\n"
            "print(n, time.perf_counter()-t, time.process_time()-c)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    n, dt, cpu = out.split()
    return int(n), int(n) / float(dt), float(cpu)


def pipeline_rate(cfg, tok, micro_batch: int, n_tokens: int):
    """One epoch through build_loader, timed from iter() (worker start-up included)."""
    from data_pipeline import build_loader

    loader = build_loader(cfg, tok, 0, 1, micro_batch)
    per_batch = micro_batch * (cfg.seq_len + 1)
    n_batches = int(n_tokens * 0.95) // per_batch  # about one epoch: every stream still in epoch 0
    c0, t0 = cpu_seconds(), time.perf_counter()
    it = iter(loader)
    next(it)
    t1 = time.perf_counter()
    for _ in range(n_batches - 1):
        next(it)
    t2 = time.perf_counter()
    del it  # stops and joins the workers, so that their CPU time is counted
    cpu = cpu_seconds() - c0
    return (n_batches * per_batch / (t2 - t0), (n_batches - 1) * per_batch / (t2 - t1), t1 - t0,
            loader.num_workers, cpu * n_tokens / (n_batches * per_batch))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=4, help="corpus repetitions")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of the pipeline")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--num-streams", type=int, default=8)
    p.add_argument("--tokenizer", default="", help="default: the shared GPT-2 tokenizer, else builtin")
    p.add_argument("--prepared-batches", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3, help="raw/pipeline measurements, alternated")
    args = p.parse_args()

    from data_pipeline import build_loader, load_tokenizer, prepare
    from data_pipeline.config import DataConfig, SourceConfig

    gpt2 = SHARED / "gpt2-tokenizer.json"
    spec = args.tokenizer or (str(gpt2) if gpt2.exists() else "builtin:python-docs-bpe")
    tok = load_tokenizer(spec)
    docs, name = corpus_docs(args.copies)
    print(f"corpus: {name}, {len(docs)} docs, {sum(map(len, docs)) / 1e6:.1f} MB; tokenizer {spec}; "
          f"{os.cpu_count()} cores; python {platform.python_version()}, torch {torch.__version__}")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "corpus.jsonl"
        with open(data, "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")

        # Raw and pipeline alternate, so that load from other processes on the machine hits both alike.
        cfg = DataConfig(sources=[SourceConfig(path=str(data))], tokenizer=spec, seq_len=args.seq_len,
                         num_streams=args.num_streams, num_workers=args.workers, shuffle_blocks=16)
        # CPU seconds per epoch tell the cost apart from other processes' load on a shared machine.
        ratios, cpu_ratios = [], []
        for r in range(args.rounds):
            n_tokens, raw, raw_cpu = raw_rate(spec, data)
            total, steady, first, workers, cpu = pipeline_rate(cfg, tok, args.micro_batch, n_tokens)
            ratios.append(total / raw)
            cpu_ratios.append(raw_cpu / cpu)
            print(f"round {r}: raw encode_batch {raw / 1e6:5.2f} M tokens/s, {raw_cpu:.2f} CPU s | pipeline "
                  f"({workers} workers) {total / 1e6:5.2f} M = {total / raw:.0%} of raw (after the first batch "
                  f"at {first:.1f} s: {steady / 1e6:.2f} M = {steady / raw:.0%}), {cpu:.2f} CPU s an epoch")
        print(f"median of {args.rounds}: pipeline/raw tokens/s {statistics.median(ratios):.0%}; raw CPU/pipeline "
              f"CPU {statistics.median(cpu_ratios):.0%} ({n_tokens} tokens an epoch, one EOT per doc included)")

        t0 = time.perf_counter()
        [pdir] = prepare(cfg, tmp / "prepared", num_proc=0)
        dt = time.perf_counter() - t0
        meta = json.loads((pdir / "meta.json").read_text())
        print(f"prepare, all cores:    {meta['tokens'] / dt / 1e6:6.2f} M tokens/s  ({meta['dtype']})")

        for seq_len in sorted({256, args.seq_len, 2048}):
            pcfg = DataConfig(sources=[SourceConfig(path=str(pdir))], tokenizer=spec, seq_len=seq_len,
                              num_streams=args.num_streams, shuffle_blocks=16)
            loader = build_loader(pcfg, tok, 0, 1, args.micro_batch)
            it = iter(loader)
            next(it)
            t0 = time.perf_counter()
            for _ in range(args.prepared_batches):
                next(it)
            dt = time.perf_counter() - t0
            rate = args.prepared_batches * args.micro_batch * (seq_len + 1) / dt
            print(f"prepared, seq_len {seq_len:4d}: {rate / 1e6:6.1f} M tokens/s  "
                  f"({args.prepared_batches * args.micro_batch / dt:.0f} sequences/s, micro-batch "
                  f"{args.micro_batch}, int64 input_ids + labels)")


if __name__ == "__main__":
    main()
