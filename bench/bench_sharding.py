"""Read amplification and throughput of the streaming loader at W ranks x K DataLoader workers.

One corpus (tinyshakespeare paragraphs, or the builtin Python docs, repeated to --copies), written
twice: as --files jsonl files (at least as many as streams: each stream reads its own files) and as
one file (fewer shards than streams: every reader parses all of it). For each layout and each W x K,
W rank processes (no process group: the loader needs none) each take --batches micro-batches; the
rounds alternate the layouts. Reported per run:
  amplification  rows parsed by all readers / documents used (the loaders' own `stats()`)
  tokens/s       window tokens delivered by all ranks / wall time of the slowest rank (from the
                 loader's creation: worker start and the first blocks included)

    python bench/bench_sharding.py --layouts 1x1,2x2,4x2 --rounds 2 --json sharding.json
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
sys.path.insert(0, str(REPO / "bench"))

from bench_data import corpus_docs  # noqa: E402


def rank_main(args) -> None:
    """One rank: iterate its loader, print its accounting as JSON."""
    import data_pipeline as dp
    from data_pipeline.config import DataConfig, SourceConfig

    cfg = DataConfig(sources=[SourceConfig(path=args.path)], tokenizer=args.tokenizer, seq_len=args.seq_len,
                     num_streams=args.streams, num_workers=args.workers, shuffle_blocks=args.blocks)
    t0 = time.perf_counter()
    loader = dp.build_loader(cfg, None, rank=args.rank, world_size=args.world, micro_batch_size=args.micro_batch)
    it = iter(loader)
    for _ in range(args.batches):
        next(it)
    seconds = time.perf_counter() - t0
    stats = loader.stats()
    del it
    print(json.dumps({"parsed": stats["parsed_docs"], "used": stats["docs"] + stats["empty_docs"],
                      "tokens": args.batches * args.micro_batch * (args.seq_len + 1), "seconds": seconds}))


def run(path: Path, world: int, workers: int, args) -> dict:
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--rank-of", str(world), "--rank", str(r), "--path", str(path),
         "--workers", str(workers), "--batches", str(args.batches), "--seq-len", str(args.seq_len),
         "--streams", str(args.streams), "--micro-batch", str(args.micro_batch), "--blocks", str(args.blocks),
         "--tokenizer", args.tokenizer],
        stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        for r in range(world)]
    outs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"rank failed (exit {p.returncode})")
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return {"amplification": sum(o["parsed"] for o in outs) / sum(o["used"] for o in outs),
            "tokens_per_s": sum(o["tokens"] for o in outs) / max(o["seconds"] for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="1x1,2x2,4x2", help="W x K pairs, comma-separated")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--files", type=int, default=32)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=150, help="micro-batches per rank")
    ap.add_argument("--blocks", type=int, default=16, help="data.shuffle_blocks")
    ap.add_argument("--tokenizer", default="builtin:python-docs-bpe")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rank-of", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_of:
        args.world = args.rank_of
        return rank_main(args)

    docs, name = corpus_docs(args.copies)
    layouts = [tuple(map(int, x.split("x"))) for x in args.layouts.split(",")]
    results = {f"{w}x{k}": {"files": [], "one file": []} for w, k in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        many, one = Path(tmp) / "many", Path(tmp) / "one.jsonl"
        many.mkdir()
        lines = [json.dumps({"text": d}) + "\n" for d in docs]
        per = -(-len(lines) // args.files)
        for f in range(args.files):
            (many / f"part-{f:03d}.jsonl").write_text("".join(lines[f * per:(f + 1) * per]))
        one.write_text("".join(lines))
        for r in range(args.rounds):
            for w, k in layouts:
                for layout, path in (("files", many), ("one file", one)):
                    got = run(path, w, k, args)
                    results[f"{w}x{k}"][layout].append(got)
                    print(f"round {r + 1} {w}x{k} {layout:8s}: amplification {got['amplification']:.2f}, "
                          f"{got['tokens_per_s']:,.0f} tokens/s", flush=True)
    print(f"\n{name}: {len(docs):,} documents, {args.files} files or one; {args.streams} streams, seq_len "
          f"{args.seq_len}, {args.batches} micro-batches of {args.micro_batch} per rank; {os.cpu_count()} cores")
    print("| W x K | files: amplification | files: tokens/s | one file: amplification | one file: tokens/s |")
    print("|---|---|---|---|---|")
    summary = {}
    for key, r in results.items():
        med = {lay: {m: statistics.median(x[m] for x in r[lay]) for m in ("amplification", "tokens_per_s")}
               for lay in r}
        summary[key] = {"median": med, "rounds": r}
        print(f"| {key} | {med['files']['amplification']:.2f} | {med['files']['tokens_per_s']:,.0f} | "
              f"{med['one file']['amplification']:.2f} | {med['one file']['tokens_per_s']:,.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"corpus": name, "documents": len(docs), "args": vars(args),
                                               "machine": platform.processor() or platform.machine(),
                                               "cpus": os.cpu_count(), "results": summary}, indent=1))


if __name__ == "__main__":
    main()
