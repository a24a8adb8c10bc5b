"""`pretrain data prepare`: tokenize the sources once into binary token shards plus a meta.json.

A prepared directory is then a source like any other (`kind: prepared`, or found by its meta.json),
read through np.memmap with the same streams and exact resume, and no tokenizing during training.

Every input shard k (a file; a hub dataset's own shards) becomes `tokens-K.bin` (more files for a
shard of over SHARD_TOKENS tokens) and a record `parts/shard-K.json`, written after its tokens are
on disk. meta.json lists the shards' files in input order and marks a finished directory, so the
concatenated tokens are the same however the work was split:
- one process: everything, then meta.json;
- parallel over shards: a process pool, each process reading and tokenizing whole shards (with
  fewer shards than processes, the shards one after another, each read in the main process and
  tokenized by the pool in order);
- many independent tasks (`--task-index I --num-tasks N`, a Slurm job array: slurm/prepare.sbatch):
  task I takes the shards k with k % N == I and writes no meta.json; `--merge` then checks that
  every shard's record is there and writes it.
A shard whose record is already there, from the same source and tokenizer, is not redone: a killed
prepare continues where it stopped.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline.config import COMPRESSIONS, DataConfig, SourceConfig, source_names
from data_pipeline.errors import DataError
from data_pipeline.sources import META, PREPARED_FORMAT, PreparedSource, TextSource, resolve_source
from data_pipeline.tokenizer import encode_docs, eot_id, fork_safe, load_tokenizer, tokenizer_fingerprint

SHARD_TOKENS = 1 << 28  # tokens per output file at most (512 MiB as uint16)
CHUNK_DOCS = 1000  # documents per task sent to a tokenizer process
PARTS = "parts"  # the per-shard records

_worker: dict = {}  # a pool process's tokenizer, and the shared progress counters


@dataclass
class _Job:
    """One source to prepare into `dest`: what every process needs to tokenize any of its shards."""

    src: TextSource
    dest: Path
    eot: int
    dtype: str
    ident: dict  # tokenizer and source fingerprints: a shard record must match them to be kept


def _init(tok_json: str, counters=None) -> None:
    from tokenizers import Tokenizer

    _worker.update(tok=Tokenizer.from_str(tok_json), counters=counters)


def _encode(args: tuple) -> np.ndarray:
    texts, eot, dtype = args
    tokens = np.concatenate(encode_docs(_worker["tok"], texts, eot)).astype(dtype)
    _count(sum(map(len, texts)), len(tokens))
    return tokens


def _count(chars: int, tokens: int) -> None:
    counters = _worker.get("counters")
    if counters is not None:
        with counters.get_lock():
            counters[0] += chars
            counters[1] += tokens


def _chunks(job: _Job, shard: int, counts: dict):
    """The shard's non-empty documents in chunks of CHUNK_DOCS, counting documents and characters."""
    batch = []
    for _, text in job.src.docs(shard):
        if not text or text.isspace():
            counts["empty_docs"] += 1
            continue
        batch.append(text)
        if len(batch) == CHUNK_DOCS:
            counts["docs"] += len(batch)
            yield batch
            batch = []
    if batch:
        counts["docs"] += len(batch)
        yield batch


def _write_shard(job: _Job, shard: int, pool=None, procs: int = 1, tick=None) -> dict:
    """Tokenize input shard `shard` into its token files and record; return the record. With a
    pool (of `procs` processes), the documents are read here and tokenized there, in order; else
    tokenized here. `tick()` after each chunk written (the progress bar)."""
    counts = {"docs": 0, "empty_docs": 0}
    files, fh, in_file = [], None, 0

    def encoded():
        chunks = ((texts, job.eot, job.dtype) for texts in _chunks(job, shard, counts))
        if pool is None:
            yield from map(_encode, chunks)
            return
        pending = deque()  # at most 2 chunks per process in flight: Pool.imap would read ahead unbounded
        for args in chunks:
            pending.append(pool.apply_async(_encode, (args,)))
            if len(pending) >= 2 * procs:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    try:
        for tokens in encoded():
            while len(tokens):
                if fh is None:
                    name = f"tokens-{shard:05d}.bin" if not files else f"tokens-{shard:05d}-{len(files)}.bin"
                    fh, in_file = open(job.dest / f"{name}.{os.getpid()}.tmp", "wb"), 0
                    files.append({"file": name, "tokens": 0})
                piece = tokens[:SHARD_TOKENS - in_file]
                fh.write(piece.tobytes())
                in_file += len(piece)
                files[-1]["tokens"] = in_file
                tokens = tokens[len(piece):]
                if in_file == SHARD_TOKENS:
                    _close(fh, job.dest, files[-1]["file"])
                    fh = None
            if tick is not None:
                tick()
        if fh is not None:
            _close(fh, job.dest, files[-1]["file"])
            fh = None
    finally:
        if fh is not None:
            fh.close()
    record = {"shard": shard, "files": files, **counts, **job.ident, "input": _input_stamp(job.src, shard)}
    _write_json(job.dest / PARTS / f"shard-{shard:05d}.json", record)
    return record


def _close(fh, dest: Path, name: str) -> None:
    fh.flush()
    os.fsync(fh.fileno())
    fh.close()
    os.replace(dest / f"{name}.{os.getpid()}.tmp", dest / name)


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _shard_in_pool(args: tuple) -> dict:
    job, shard = args
    # the source as this process opened it first: `datasets` resolves the files once per process
    job.src = _worker.setdefault("sources", {}).setdefault(job.src.fingerprint, job.src)
    return _write_shard(job, shard)


def _record(job: _Job, shard: int) -> dict | None:
    """The shard's record if it is finished for this source and tokenizer (its files all there)."""
    try:
        record = json.loads((job.dest / PARTS / f"shard-{shard:05d}.json").read_text())
    except (OSError, ValueError):
        return None
    if any(record.get(k) != v for k, v in job.ident.items()) or record.get("input") != _input_stamp(job.src, shard):
        return None
    ok = all(os.path.exists(job.dest / f["file"]) and
             os.path.getsize(job.dest / f["file"]) == f["tokens"] * np.dtype(job.dtype).itemsize
             for f in record["files"])
    return record if ok else None


def _input_stamp(src: TextSource, shard: int) -> list | None:
    """A local shard's file size and modification time: a file changed since is prepared again
    (the source fingerprint has names and sizes only, so that a copied data directory is the same)."""
    if src.kind == "hub" or len(src.files) != src.n_shards:
        return None
    stat = os.stat(src.files[shard])
    return [stat.st_size, stat.st_mtime_ns]


def _progress_total(src: TextSource, shards: list[int]) -> tuple[int, str, list[int]]:
    """What the bar counts: input bytes for uncompressed local files (one file a shard), else shards."""
    if (src.kind != "hub" and len(src.files) == src.n_shards
            and not any(f.lower().endswith(COMPRESSIONS) for f in src.files)):
        sizes = [os.path.getsize(src.files[k]) for k in shards]
        return sum(sizes), "B", sizes
    return len(shards), "shard", [1] * len(shards)


def _prepare_shards(job: _Job, shards: list[int], procs: int, tok_json: str, progress: bool, what: str) -> None:
    """Write `shards` of the job's source (skipping finished ones), with a progress bar: input read
    (bytes or shards), tokens/s, ETA."""
    from tqdm import tqdm

    todo = [k for k in shards if _record(job, k) is None]
    if len(todo) < len(shards):
        print(f"{what}: {len(shards) - len(todo)} of {len(shards)} shards already prepared, kept")
    if not todo:
        return
    total, unit, sizes = _progress_total(job.src, todo)
    counters = mp.Array("q", 2)  # characters read and tokens written, by every process
    bar = tqdm(total=total, unit=unit, unit_scale=True, desc=what, disable=not progress, dynamic_ncols=True,
               mininterval=0.5 if os.isatty(2) else 30)
    done, started = 0, time.perf_counter()

    def refresh(finished_units: int | None = None) -> None:
        nonlocal done
        chars, tokens = counters[0], counters[1]
        if finished_units is not None:
            done += finished_units
        n = done if unit == "shard" else min(total, max(done, chars))
        bar.update(n - bar.n)
        bar.set_postfix_str(f"{tokens / max(time.perf_counter() - started, 1e-9):,.0f} tok/s, {tokens:,} tokens",
                            refresh=False)

    procs = max(1, procs)
    try:
        if procs == 1:
            _init(tok_json, counters)
            for k, size in zip(todo, sizes):
                _write_shard(job, k, tick=refresh)
                refresh(size)
        elif len(todo) >= procs:  # whole shards in parallel: reading and parsing too
            with fork_safe():
                pool = mp.Pool(procs, initializer=_init, initargs=(tok_json, counters))
            try:
                pending = {pool.apply_async(_shard_in_pool, ((job, k),)): size for k, size in zip(todo, sizes)}
                while pending:
                    for result in [r for r in pending if r.ready()]:
                        result.get()  # raises a worker's error here
                        refresh(pending.pop(result))
                    refresh()
                    time.sleep(0.2)
            finally:
                pool.terminate()
                pool.join()
        else:  # fewer shards than processes: read here, tokenize in the pool, shard after shard
            _init(tok_json, counters)
            with fork_safe():
                pool = mp.Pool(procs, initializer=_init, initargs=(tok_json, counters))
            try:
                for k, size in zip(todo, sizes):
                    _write_shard(job, k, pool, procs, tick=refresh)
                    refresh(size)
            finally:
                pool.terminate()
                pool.join()
    finally:
        _worker.pop("counters", None)
        refresh()
        bar.close()


def _merge(job: _Job, tok_spec: str, label: str) -> dict:
    """meta.json over every shard's record, in input order; refuses while one is missing."""
    records = [_record(job, k) for k in range(job.src.n_shards)]
    missing = [k for k, r in enumerate(records) if r is None]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise DataError(f"{job.dest}: {len(missing)} of {job.src.n_shards} shards of {label!r} are not prepared "
                        f"(shards {shown}): run the tasks that own them (shard k belongs to task k % --num-tasks) "
                        "before --merge")
    shards = [f for r in records for f in r["files"]]
    listed = {f["file"] for f in shards}
    for stale in job.dest.glob("tokens-*.bin"):  # from an earlier prepare of other data
        if stale.name not in listed:
            stale.unlink()
    for stale in [*job.dest.glob("*.tmp"), *(job.dest / PARTS).glob("*.tmp")]:  # of killed processes
        stale.unlink(missing_ok=True)
    meta = {
        "format": PREPARED_FORMAT, "tokenizer": tok_spec, "tokenizer_fingerprint": job.ident["tokenizer_fingerprint"],
        "eot_id": job.eot, "vocab_size": job.ident["vocab_size"], "dtype": np.dtype(job.dtype).name,
        "tokens": sum(f["tokens"] for f in shards), "docs": sum(r["docs"] for r in records),
        "empty_docs": sum(r["empty_docs"] for r in records),
        "source": {"path": job.src.label, "kind": job.src.kind, "fingerprint": job.src.fingerprint},
        "shards": shards,
    }
    _write_json(job.dest / META, meta)
    return meta


def prepare(data_cfg: DataConfig, out_dir: str | os.PathLike, num_proc: int = 0, task_index: int = 0,
            num_tasks: int = 1, merge: bool = False, progress: bool = True) -> list[Path]:
    """Tokenize data_cfg.sources (and data_cfg.validation) into `out_dir` with `num_proc` processes
    (0 = all cores). One source goes to out_dir itself, several to out_dir/source-J; validation
    sources to out_dir/validation-J. With num_tasks > 1 this is task `task_index`'s share of the
    shards and no meta.json is written; `merge` writes it once every task has finished (see the
    module doc). Returns the directories (finished ones, or all of them for a task)."""
    if num_tasks < 1 or not 0 <= task_index < num_tasks:
        raise DataError(f"--task-index {task_index} --num-tasks {num_tasks}: need 0 <= task index < tasks")
    tok = load_tokenizer(data_cfg.tokenizer)
    eot = eot_id(tok, data_cfg.eot_token)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32).str
    tok_json, tok_fp = tok.to_str(), tokenizer_fingerprint(tok)
    out = Path(out_dir).absolute()
    jobs = [(s, out if len(data_cfg.sources) == 1 else out / f"source-{j}") for j, s in enumerate(data_cfg.sources)]
    jobs += [(s, out / f"validation-{j}") for j, s in enumerate(data_cfg.validation)]
    procs = num_proc if num_proc > 0 else (os.cpu_count() or 1)
    written = []
    for cfg, dest in jobs:
        src = resolve_source(cfg)
        if isinstance(src, PreparedSource):
            raise DataError(f"data source {cfg.path!r} is already prepared: list the raw text source instead")
        job = _Job(src, dest, eot, dtype, {"tokenizer_fingerprint": tok_fp, "eot_id": eot, "vocab_size": vocab,
                                          "source_fingerprint": src.fingerprint})
        try:
            if not merge:
                (dest / PARTS).mkdir(parents=True, exist_ok=True)
                # meta.json marks a finished directory: gone while its shards are being (re)written
                (dest / META).unlink(missing_ok=True)
                mine = [k for k in range(src.n_shards) if k % num_tasks == task_index]
                what = cfg.path if num_tasks == 1 else f"{cfg.path} (task {task_index} of {num_tasks})"
                _prepare_shards(job, mine, procs, tok_json, progress, what)
            if merge or num_tasks == 1:
                meta = _merge(job, data_cfg.tokenizer, cfg.path)
                print(f"wrote {dest}: {meta['tokens']:,} tokens ({meta['dtype']}) from {meta['docs']:,} documents "
                      f"of {cfg.path} ({meta['empty_docs']:,} empty skipped), {len(meta['shards'])} files")
        except OSError as e:
            raise DataError(f"could not prepare {cfg.path} into {dest} ({type(e).__name__}: {e}): check the "
                            "input files, the output path and its free space") from None
        written.append(dest)
    if merge or num_tasks == 1:
        print(config_snippet(data_cfg, jobs))
    return written


def config_snippet(data_cfg: DataConfig, jobs: list[tuple[SourceConfig, Path]]) -> str:
    """The data section that trains on what was written (weights and labels kept)."""
    train = jobs[:len(data_cfg.sources)]
    names = source_names(data_cfg.sources)
    lines = ["", "# train on it: put this in your run config (the tokenizer must stay the same)", "data:",
             f"  tokenizer: {data_cfg.tokenizer}"]
    if data_cfg.eot_token:
        lines.append(f"  eot_token: {json.dumps(data_cfg.eot_token)}")
    lines.append("  sources:")
    for (cfg, dest), name in zip(train, names):
        lines += [f"    - path: {dest}", f"      weight: {cfg.weight:g}", f"      label: {name}"]
    if data_cfg.validation:
        lines.append("  validation:")
        lines += [f"    - path: {dest}" for _, dest in jobs[len(data_cfg.sources):]]
    return "\n".join(lines)
