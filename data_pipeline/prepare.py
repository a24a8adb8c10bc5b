"""`pretrain data prepare`: tokenize the sources once into binary token shards plus a meta.json.

A prepared directory is then a source like any other (`kind: prepared`, or found by its meta.json),
read through np.memmap with the same streams and exact resume, and no tokenizing during training.
Documents are read in order in the main process and tokenized by a pool of processes, results
written back in order, so the token file is the same for any number of processes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections import deque
from pathlib import Path

import numpy as np

from data_pipeline.config import DataConfig
from data_pipeline.errors import DataError
from data_pipeline.sources import META, PREPARED_FORMAT, PreparedSource, TextSource, resolve_source
from data_pipeline.tokenizer import encode_docs, eot_id, fork_safe, load_tokenizer, tokenizer_fingerprint

SHARD_TOKENS = 1 << 28  # tokens per output file (512 MiB as uint16)
CHUNK_DOCS = 1000  # documents per task sent to a tokenizer process

_worker = {}  # the tokenizer of a pool process


def _init(tok_json: str, eot: int, dtype: str) -> None:
    from tokenizers import Tokenizer

    _worker.update(tok=Tokenizer.from_str(tok_json), eot=eot, dtype=np.dtype(dtype))


def _encode(texts: list[str]) -> np.ndarray:
    arrays = encode_docs(_worker["tok"], texts, _worker["eot"])
    return np.concatenate(arrays).astype(_worker["dtype"])


def _ordered(fn, items, procs: int, initargs: tuple):
    """fn over items in a process pool, results in input order, at most 2 tasks per process in flight
    (Pool.imap would read the whole source ahead into memory)."""
    if procs <= 1:
        _init(*initargs)
        yield from map(fn, items)
        return
    with fork_safe():
        pool = mp.Pool(procs, initializer=_init, initargs=initargs)
    try:
        pending = deque()
        for item in items:
            pending.append(pool.apply_async(fn, (item,)))
            if len(pending) >= 2 * procs:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
    finally:
        pool.terminate()
        pool.join()


def prepare(data_cfg: DataConfig, out_dir: str | os.PathLike, num_proc: int = 0) -> list[Path]:
    """Tokenize data_cfg.sources (and data_cfg.validation) into `out_dir` with `num_proc` processes
    (0 = all cores). One source goes to out_dir itself, several to out_dir/source-J; validation
    sources to out_dir/validation-J. Returns the directories written."""
    tok = load_tokenizer(data_cfg.tokenizer)
    eot = eot_id(tok, data_cfg.eot_token)
    out = Path(out_dir)
    jobs = [(s, out if len(data_cfg.sources) == 1 else out / f"source-{j}") for j, s in enumerate(data_cfg.sources)]
    jobs += [(s, out / f"validation-{j}") for j, s in enumerate(data_cfg.validation)]
    procs = num_proc if num_proc > 0 else (os.cpu_count() or 1)
    written = []
    for cfg, dest in jobs:
        src = resolve_source(cfg)
        if isinstance(src, PreparedSource):
            raise DataError(f"data source {cfg.path!r} is already prepared: list the raw text source instead")
        meta = _prepare_one(src, tok, eot, dest, procs, data_cfg.tokenizer)
        print(f"wrote {dest}: {meta['tokens']} tokens ({meta['dtype']}) from {meta['docs']} documents "
              f"of {cfg.path} ({meta['empty_docs']} empty skipped)")
        written.append(dest)
    return written


def _prepare_one(src: TextSource, tok, eot: int, dest: Path, procs: int, tok_spec: str) -> dict:
    dest.mkdir(parents=True, exist_ok=True)
    # meta.json marks a finished directory: remove it first, so a crash leaves no half-valid source
    (dest / META).unlink(missing_ok=True)
    for old in dest.glob("tokens-*.bin"):
        old.unlink()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    counts = {"docs": 0, "empty": 0}

    def chunks():
        batch = []
        for shard in range(src.n_shards):
            for _, text in src.docs(shard):
                if not text or text.isspace():
                    counts["empty"] += 1
                    continue
                batch.append(text)
                if len(batch) == CHUNK_DOCS:
                    counts["docs"] += len(batch)
                    yield batch
                    batch = []
        if batch:
            counts["docs"] += len(batch)
            yield batch

    shards, fh, in_file = [], None, 0
    try:
        for tokens in _ordered(_encode, chunks(), procs, (tok.to_str(), eot, dtype.str)):
            while len(tokens):
                if fh is None:
                    name = f"tokens-{len(shards):05d}.bin"
                    fh, in_file = open(dest / name, "wb"), 0
                    shards.append({"file": name, "tokens": 0})
                piece = tokens[:SHARD_TOKENS - in_file]
                fh.write(piece.tobytes())
                in_file += len(piece)
                shards[-1]["tokens"] = in_file
                tokens = tokens[len(piece):]
                if in_file == SHARD_TOKENS:
                    fh.close()
                    fh = None
    finally:
        if fh is not None:
            fh.close()
    meta = {
        "format": PREPARED_FORMAT, "tokenizer": tok_spec, "tokenizer_fingerprint": tokenizer_fingerprint(tok),
        "eot_id": eot, "vocab_size": vocab, "dtype": dtype.name,
        "tokens": sum(s["tokens"] for s in shards), "docs": counts["docs"], "empty_docs": counts["empty"],
        "source": {"path": src.label, "kind": src.kind, "fingerprint": src.fingerprint}, "shards": shards,
    }
    tmp = dest / f"{META}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, dest / META)
    return meta
