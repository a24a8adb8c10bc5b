"""Data sources: a SourceConfig resolved to numbered shards of documents.

Text sources are read through HF `datasets` streaming: local txt/json/parquet files through its own
builders (`load_dataset("json", data_files=..., streaming=True)`), hub datasets by name. Documents are
read as Arrow tables, so the rows a stream skips (those of other streams) cost no Python objects.
A `prepare`d directory (meta.json + binary token shards) is read through np.memmap instead.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from data_pipeline.config import COMPRESSIONS, EXT_KINDS, SourceConfig
from data_pipeline.errors import DataError

KINDS = ("auto", "hub", "text", "json", "parquet", "prepared", "builtin")
SAMPLE_BY = ("line", "paragraph", "document")
META = "meta.json"
PREPARED_FORMAT = "pretrain-tokens/1"  # meta.json "format" of a prepared directory this version reads
READ_ROWS = 256  # rows per Arrow table read from a shard
SHARED_BYTES = 64 << 20  # Arrow tables of a shard kept for the other streams of a process to read


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _file_kind(path: str) -> str | None:
    name = path.lower()
    for c in COMPRESSIONS:
        name = name.removesuffix(c)
    return EXT_KINDS.get(os.path.splitext(name)[1])


def _looks_like_hub(path: str) -> bool:
    # "org/name" or "name", no known file extension: a typo'd local path should say "does not exist"
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", path)) and _file_kind(path) is None


class TextSource:
    """Documents from files or a hub dataset, read one shard at a time (a shard = a file for local data,
    `IterableDataset.n_shards` for the hub)."""

    def __init__(self, cfg: SourceConfig, kind: str, files: list[str], label: str | None = None,
                 holdout: float = 0.0, held_out_part: bool = False):
        self.label = label or cfg.path  # the path as the user wrote it, for messages
        # Local files only: this fraction of each file's documents is the held-out part (chosen by a
        # hash of the file name and row); held_out_part=True reads only it, False skips it.
        self.holdout, self.held_out_part = holdout, held_out_part
        self._salts = [int(hashlib.sha256(os.path.basename(f).encode()).hexdigest()[:10], 16) for f in files]
        self.kind = kind  # hub | text | json | parquet
        self.path = cfg.path
        self.files = files  # local files (empty for the hub)
        self.name, self.split, self.sample_by = cfg.name, cfg.split, cfg.sample_by
        self.text_field = "text" if kind == "text" else cfg.text_field
        if kind == "text" and cfg.sample_by not in SAMPLE_BY:
            raise DataError(f"data source {self.label!r} has sample_by={cfg.sample_by!r}: use one of "
                            + ", ".join(SAMPLE_BY))
        self._ds = None
        self._shared = None  # shard -> _SharedShard, the shards read lately in this process
        self._shared_pid = None  # that process (a forked worker starts its own)
        self.n_shards = self.open().n_shards
        if self.n_shards < 1:
            raise DataError(f"data source {self.label!r} has no shards: check the path or dataset name")
        ident = {"kind": kind, "field": self.text_field}
        if kind == "hub":
            ident.update(path=cfg.path, name=cfg.name, split=cfg.split)
        else:  # names and sizes, not absolute paths or mtimes: a copied data dir is the same data
            ident["files"] = [[os.path.basename(f), os.path.getsize(f)] for f in files]
        if kind == "text":
            ident["sample_by"] = cfg.sample_by
        if holdout:
            ident.update(holdout=holdout, held_out_part=held_out_part)
        self.fingerprint = _digest(ident)

    def __getstate__(self):  # worker processes open their own dataset object
        return {**self.__dict__, "_ds": None, "_shared": None}

    def open(self):
        if self._ds is None:
            import datasets

            try:
                if self.kind == "hub":
                    self._ds = datasets.load_dataset(self.path, self.name or None, split=self.split,
                                                     streaming=True)
                else:
                    kw = {"sample_by": self.sample_by, "encoding_errors": "replace"} if self.kind == "text" else {}
                    self._ds = datasets.load_dataset(self.kind, data_files=self.files, split="train",
                                                     streaming=True, **kw)
            except DataError:
                raise
            except Exception as e:
                where = "hub dataset" if self.kind == "hub" else "data source"
                raise DataError(f"could not open {where} {self.label!r} ({_first_line(e)}): check the "
                                "path or name (hub datasets need the network), its split and config") from None
        return self._ds

    def _where(self, shard: int) -> str:
        if self.kind != "hub" and len(self.files) == self.n_shards:
            return f"data source {self.label!r} (file {self.files[shard]})"
        return f"data source {self.label!r} (shard {shard})"

    def _column(self, table, shard: int):
        import pyarrow as pa

        if self.text_field not in table.column_names:
            raise DataError(f"{self._where(shard)} has no field {self.text_field!r} (columns: "
                            f"{', '.join(table.column_names)}): set text_field to the column holding the text")
        col = table.column(self.text_field)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_null(col.type)):
            raise DataError(f"{self._where(shard)}: field {self.text_field!r} holds {col.type}, not text: "
                            "set text_field to a text column")
        return col

    def tables(self, shard: int, parsed: list | None = None) -> Iterator[tuple[int, object]]:
        """(first row, Arrow table) of `shard`, in order. The streams of a process that read the same
        shard at about the same time share one parse of it (see _SharedShard). `parsed[0]` counts
        the rows this caller had parsed (not those it found already parsed by another stream)."""
        if self._shared is None or self._shared_pid != os.getpid():  # never a reader of another process
            self._shared, self._shared_pid = {}, os.getpid()
        reader = self._shared.get(shard)
        if reader is None:
            reader = self._shared[shard] = _SharedShard(self, shard)
            # Keep the readers of the shards read lately, up to SHARED_BYTES of tables in all, so a
            # stream that comes to a shard after another stream has finished it still shares its parse.
            while len(self._shared) > 1 and sum(r.bytes for r in self._shared.values()) > SHARED_BYTES:
                del self._shared[next(iter(self._shared))]
        t = 0
        while True:
            before = reader.rows
            got = reader.table(t)
            if parsed is not None:
                parsed[0] += reader.rows - before
            if got is _EVICTED:  # this stream lags too far behind the others: parse again on its own
                reader = self._shared[shard] = _SharedShard(self, shard)
                continue
            if got is None:
                return
            yield got
            t += 1

    def docs(self, shard: int, start: int = 0, step: int = 1, phase: int = 0,
             parsed: list | None = None) -> Iterator[tuple[int, str]]:
        """(row, text) for the rows >= start of `shard` with row % step == phase, in order.
        Missing (null) texts come as "". `parsed[0]` counts the rows parsed for it (see tables)."""
        try:
            for row, table in self.tables(shard, parsed):
                n = table.num_rows
                first = max(start, row)
                r = first + (phase - first) % step
                if r < row + n:
                    col = self._column(table, shard)
                    idx = list(range(r - row, n, step))
                    if self.holdout:
                        held = _held_out(np.asarray(idx, dtype=np.uint64) + np.uint64(row), self._salts[shard],
                                         self.holdout)
                        idx = [k for k, h in zip(idx, held) if h == self.held_out_part]
                        if not idx:
                            continue
                    texts = col.to_pylist() if len(idx) == n else col.take(idx).to_pylist()
                    for k, text in zip(idx, texts):
                        yield row + k, text or ""
        except DataError:
            raise
        except Exception as e:
            raise DataError(_read_error(self._where(shard), e)) from None

    def check(self) -> None:
        """Fail early, in the main process, on a missing text field, a source with no documents, or
        one whose first documents are binary data rather than text."""
        for shard in range(self.n_shards):
            sample = []
            for _, text in self.docs(shard):
                if text.strip():
                    sample.append(text)
                    if sum(map(len, sample)) >= BINARY_SAMPLE:
                        break
            self._shared = None  # the streams parse (and count) for themselves
            if sample:
                _check_text("\n".join(sample), self._where(shard))
                return
            if self.kind == "hub":
                break  # do not read a whole hub dataset looking for a row
        part = " (its held-out part)" if self.holdout and self.held_out_part else ""
        raise DataError(f"data source {self.label!r}{part} is empty (no documents): check the path and split")


BINARY_SAMPLE = 1 << 16  # bytes of each text file (or characters of a document) looked at
# A "text" with more undecodable bytes than this share (and at least MIN_UNDECODABLE of them) is
# binary data; a few stray bytes in a real text file become U+FFFD and are kept.
MAX_UNDECODABLE, MIN_UNDECODABLE = 0.05, 16


def _check_text(text: str, where: str) -> None:
    """Refuse binary data read as text: NUL characters, or many U+FFFD (bytes that are not UTF-8)."""
    sample = text[:BINARY_SAMPLE]
    if "\x00" in sample:
        raise DataError(f"{where} looks binary, not text (it contains NUL bytes): give text files, or the right "
                        "kind (json, parquet) for structured data")
    count = sample.count("\ufffd")
    bad = count / max(1, len(sample))
    if bad > MAX_UNDECODABLE and count >= MIN_UNDECODABLE:
        raise DataError(f"{where} looks binary, not text ({bad:.0%} of its first characters are not UTF-8): "
                        "give UTF-8 text files, or the right kind (json, parquet) for structured data")


def _check_text_file(path: str, where: str) -> None:
    """The same check on a text file's first bytes (decompressed), before `datasets` reads it."""
    opener = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}.get(os.path.splitext(path)[1].lower())
    try:
        if opener:
            import importlib

            with importlib.import_module(opener).open(path, "rb") as f:
                head = f.read(BINARY_SAMPLE)
        elif path.lower().endswith(COMPRESSIONS):
            return  # .zst/.lz4: left to the document check
        else:
            with open(path, "rb") as f:
                head = f.read(BINARY_SAMPLE)
    except OSError as e:
        raise DataError(f"{where} could not be read ({_first_line(e)}): fix or remove it") from None
    if b"\x00" in head:
        raise DataError(f"{where} looks binary, not text (it contains NUL bytes): give text files, or the right "
                        "kind (json, parquet) for structured data")
    _check_text(head[:BINARY_SAMPLE - 4].decode("utf-8", errors="replace"), where)


def _held_out(rows: np.ndarray, salt: int, fraction: float) -> np.ndarray:
    """Whether each row (uint64 array) of the file with `salt` is in the held-out part: splitmix64 of
    (salt, row) below `fraction`. Stateless and independent of how streams split the rows."""
    with np.errstate(over="ignore"):
        x = rows + np.uint64(salt << 24)
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


_EVICTED = object()


class _SharedShard:
    """One parse of a shard for all the streams of a process: each stream keeps 1/num_streams of the
    rows, and the streams of a worker move through a shard at about the same pace, so they read the
    same Arrow tables. The latest tables are kept up to SHARED_BYTES; a stream asking for an older one
    gets _EVICTED and parses the shard again itself (exact either way, only slower)."""

    def __init__(self, src: TextSource, shard: int):
        ds = src.open()
        if src.n_shards > 1:
            ds = ds.shard(num_shards=src.n_shards, index=shard)
        self._it = iter(ds.with_format("arrow").iter(batch_size=READ_ROWS))
        self._tables = {}  # table index -> (first row, table)
        self._count, self.rows, self.bytes, self._done, self._error = 0, 0, 0, False, None

    def table(self, t: int):
        if self._error is not None:  # every stream reading this shard fails, none sees it end early
            raise self._error
        while self._count <= t and not self._done:
            try:
                table = next(self._it, None)
            except Exception as e:
                self._error = e
                raise
            if table is None:
                self._done = True
                break
            self._tables[self._count] = (self.rows, table)
            self._count += 1
            self.rows += table.num_rows  # parsed so far
            self.bytes += table.nbytes
            while self.bytes > SHARED_BYTES and len(self._tables) > 1:
                self.bytes -= self._tables.pop(min(self._tables))[1].nbytes
        if t >= self._count:
            return None
        return self._tables.get(t, _EVICTED)


def _read_error(where: str, e: Exception) -> str:
    try:
        from datasets.table import CastError
    except ImportError:  # pragma: no cover
        CastError = ()
    if isinstance(e, CastError):
        return (f"{where} has columns {e.table_column_names} unlike the first file's "
                f"{e.requested_column_names}: give every file the same columns")
    if isinstance(e, UnicodeDecodeError):
        return f"{where} is not valid UTF-8 ({e.reason} at byte {e.start}): re-encode it as UTF-8"
    return f"{where} could not be read ({_first_line(e)}): fix or remove it"


class PreparedSource:
    """Token shards written by `prepare`, read through np.memmap. The windows are the concatenated
    token array cut into chunks of seq_len+1 (the last partial chunk is dropped)."""

    kind = "prepared"

    def __init__(self, label: str, directory: Path):
        self.label = label
        self.dir = directory
        try:
            self.meta = json.loads((directory / META).read_text())
            self.dtype = np.dtype(self.meta["dtype"])
            self.files = [str(directory / s["file"]) for s in self.meta["shards"]]
            counts = [int(s["tokens"]) for s in self.meta["shards"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"prepared source {label!r}: {directory / META} is unreadable ({_first_line(e)}): "
                            "re-run `pretrain data prepare`") from None
        if self.meta.get("format") != PREPARED_FORMAT:
            raise DataError(f"prepared source {label!r} has format {self.meta.get('format')!r}, this pretrain reads "
                            f"{PREPARED_FORMAT!r}: re-run `pretrain data prepare` with this version")
        for f, n in zip(self.files, counts):
            if not os.path.exists(f) or os.path.getsize(f) != n * self.dtype.itemsize:
                raise DataError(f"prepared source {label!r}: shard {f} is missing or has the wrong size: "
                                "re-run `pretrain data prepare`")
        self.starts = np.cumsum([0] + counts)  # token offset of each shard in the concatenated array
        self.n_tokens = int(self.starts[-1])
        keys = ("tokenizer_fingerprint", "source", "tokens", "shards")
        self.fingerprint = _digest({k: self.meta.get(k) for k in keys})
        self._maps = None
        self._perms = {}

    def __getstate__(self):  # memmaps are reopened in each process
        return {**self.__dict__, "_maps": None, "_perms": {}}

    def check(self) -> None:
        if self.n_tokens == 0:
            raise DataError(f"prepared source {self.label!r} has no tokens: prepare a non-empty source")

    def window(self, w: int, length: int) -> np.ndarray:
        """Window w: tokens [w*length, (w+1)*length) of the concatenated shards, in the file's dtype
        (a view of the memmap where it lies in one file)."""
        if self._maps is None:  # plain ndarray views: slicing an np.memmap costs a Python __array_finalize__
            self._maps = [np.memmap(f, dtype=self.dtype, mode="r").view(np.ndarray) for f in self.files]
        a = w * length
        f = int(np.searchsorted(self.starts, a, side="right")) - 1 if len(self.files) > 1 else 0
        lo = a - int(self.starts[f])
        piece = self._maps[f][lo:lo + length]
        if len(piece) == length:
            return piece
        parts, need = [piece], length - len(piece)  # a window across shard files
        while need:
            f += 1
            parts.append(self._maps[f][:need])
            need -= len(parts[-1])
        return np.concatenate(parts)

    def permutation(self, key: tuple, n: int) -> np.ndarray:
        """Seeded permutation of n window indices. The last two are cached: the streams of a worker
        share them, and near an epoch's end some streams are already in the next one."""
        perm = self._perms.get((key, n))
        if perm is None:
            perm = np.random.default_rng(list(key)).permutation(n)
            self._perms = {**dict(list(self._perms.items())[-1:]), (key, n): perm}
        return perm


def resolve_source(cfg: SourceConfig) -> TextSource | PreparedSource:
    """Turn a SourceConfig into a source: find its files and kind, open it, check it has documents
    and the text field. Every user-fixable problem raises DataError naming the path."""
    from data_pipeline import builtin

    path, kind = cfg.path, cfg.kind
    if kind not in KINDS:
        raise DataError(f"data source {path!r} has kind={kind!r}: use one of " + ", ".join(KINDS))
    if not path:
        raise DataError("a data source has no path: set path to a local file, hub dataset or builtin:NAME")
    if cfg.holdout and (path.startswith("builtin:") or kind in ("builtin", "hub")):
        raise DataError(f"data source {path!r} has holdout={cfg.holdout}: holdout is for local files; "
                        "builtin and hub datasets have their own splits (split: validation)")
    if path.startswith("builtin:") or kind == "builtin":
        files = builtin.dataset_files(path.removeprefix("builtin:"), cfg.split)
        cfg = SourceConfig(**{**cfg.__dict__, "text_field": "text"})
        src = TextSource(cfg, "json", files)
        src.check()
        return src
    if kind == "hub":
        src = TextSource(cfg, "hub", [])
        src.check()
        return src

    local = os.path.expanduser(path)
    if any(c in local for c in "*?["):
        files = sorted(f for f in glob.glob(local, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"data source {path!r} matches no files: fix the pattern")
    elif os.path.isdir(local):
        if kind in ("auto", "prepared") and os.path.exists(os.path.join(local, META)):
            if cfg.split != "train" or cfg.holdout:
                raise DataError(f"data source {path!r} is prepared: it has no splits (split: {cfg.split}, "
                                f"holdout: {cfg.holdout}); `pretrain data prepare` writes validation sources "
                                "to their own directories")
            src = PreparedSource(path, Path(local))
            src.check()
            return src
        if os.path.isdir(os.path.join(local, "parts")) and glob.glob(os.path.join(local, "tokens-*.bin")):
            raise DataError(f"data source {path!r} is a prepared directory without its {META}: its "
                            "`pretrain data prepare` has not finished (with --num-tasks: run every task, then "
                            "--merge)")
        if kind == "prepared":
            raise DataError(f"data source {path!r} has no {META}: run `pretrain data prepare` into it first")
        files = sorted(str(f) for f in Path(local).rglob("*")
                       if f.is_file() and (_file_kind(str(f)) if kind == "auto" else _file_kind(str(f)) == kind))
        if not files:
            raise DataError(f"data source {path!r} is a directory with no .txt/.json/.jsonl/.parquet files: "
                            "point it at the data files")
    elif os.path.isfile(local):
        files = [local]
    elif kind == "auto" and _looks_like_hub(path):
        src = TextSource(cfg, "hub", [])
        src.check()
        return src
    else:
        raise DataError(f"data source {path!r} does not exist: fix the path "
                        "(or set kind: hub for a Hugging Face dataset)")
    if kind == "prepared":
        raise DataError(f"data source {path!r} is not a prepared directory: run `pretrain data prepare` first")
    if kind == "auto":
        kinds = {_file_kind(f) for f in files}
        if None in kinds:
            bad = next(f for f in files if _file_kind(f) is None)
            raise DataError(f"data source {path!r}: cannot tell the format of {bad}: "
                            "set kind to text, json or parquet")
        if len(kinds) > 1:
            raise DataError(f"data source {path!r} mixes {', '.join(sorted(kinds))} files: "
                            "make one source per format")
        kind = kinds.pop()
    # An empty file has no documents (and makes datasets' schema inference fail): leave it out.
    files = [f for f in files if os.path.getsize(f) > 0]
    if not files:
        raise DataError(f"data source {path!r} is empty (its files have no data): check the path")
    if cfg.split not in ("train", "validation"):
        raise DataError(f"data source {path!r} has split={cfg.split!r}: local files have the splits train and "
                        "validation (with holdout set)")
    if cfg.split == "validation" and not cfg.holdout:
        raise DataError(f"data source {path!r} has split: validation, but local files have no validation split "
                        "of their own: set holdout (e.g. 0.01) on it and on the training source of the same "
                        "files, or give separate validation files (split: train)")
    if kind == "text":
        for f in files:
            _check_text_file(f, f"data source {path!r} (file {f})")
    src = TextSource(cfg, kind, files, holdout=cfg.holdout, held_out_part=cfg.split == "validation")
    src.check()
    return src
