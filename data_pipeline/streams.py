"""Streams: independent, deterministic, resumable iterators of token windows.

Every source is split into `num_streams` streams. A text stream owns whole shards (every N-th of the
shards of all epochs in order) when the source has at least N shards, so each shard is read once;
else the documents at (shard position p, row i) with (p + i) % N == s. It packs its documents (each
followed by the end-of-text token) and cuts windows of seq_len+1 tokens. Its position is a cursor
(epoch, p, i, token offset) of the first token not yet emitted, so it resumes by reopening one shard,
not by replaying the stream. Windows are shuffled in blocks: the block is rebuilt from its starting
cursor on resume, so no buffer is saved.
A prepared stream takes every num_streams-th window of a seeded permutation of all windows.

A stream's state is a small JSON-able dict; `next()` returns (window, state after this window).
"""

from __future__ import annotations

import bisect
from typing import Iterator

import numpy as np

from data_pipeline.errors import DataError
from data_pipeline.sources import PreparedSource, TextSource
from data_pipeline.tokenizer import encode_docs

ENCODE_DOCS = 256  # documents per encode_batch call
MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A stateless 64-bit hash (splitmix64's finaliser): counter -> uniform bits."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class Mixture:
    """Which source global sequence g comes from: a hash of (seed, g) against the cumulative
    normalised weights. Stateless, so any process can compute it for any g."""

    def __init__(self, weights: list[float], seed: int):
        total = float(sum(weights))
        self.cum = list(np.cumsum([w / total for w in weights]))
        self.key = splitmix64(seed & MASK64)

    def source_of(self, g: int) -> int:
        if len(self.cum) == 1:
            return 0
        u = splitmix64(self.key ^ g) / 2.0**64
        return min(bisect.bisect_right(self.cum, u), len(self.cum) - 1)


def shard_order(n: int, seed: int, source: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Shard positions -> shard indices for one epoch (the same in every stream and process)."""
    if not shuffle or n == 1:
        return np.arange(n)
    return np.random.default_rng([seed, source, epoch]).permutation(n)


class TextStream:
    """Stream `s` of text source `j`. State: the cursor at the start of the current shuffle block
    (epoch, shard_pos, doc, offset, and the documents used, empty documents skipped and rows parsed
    before it), the block index and the windows already taken from the block.

    Which documents are its own: with at least as many shards as streams (`owns_shards`), whole
    shards: number the shards of all epochs in order (position p of epoch e is e * n_shards + p) and
    stream s takes those numbered s, s+N, s+2N, ...; each shard is read by one stream in an epoch,
    and every stream gets one shard in N however many shards there are. With fewer shards, row
    (p, i) of every shard with (p + i) % N == s, so every stream reads every shard (and skips the
    others' rows)."""

    STATE = ("epoch", "shard_pos", "doc", "offset", "docs", "empty", "parsed")

    def __init__(self, src: TextSource, tok, eot: int, j: int, s: int, n_streams: int, seq_len: int,
                 seed: int, block: int, shuffle_shards: bool, state: dict | None = None):
        self.src, self.tok, self.eot, self.j, self.s = src, tok, eot, j, s
        self.n, self.length, self.seed, self.B = n_streams, seq_len + 1, seed, block
        self.shuffle_shards = shuffle_shards
        self.owns_shards = src.n_shards >= n_streams
        state = state or {}
        self.start = tuple(int(state.get(k, 0)) for k in self.STATE)
        self.block = int(state.get("block", 0))
        self.taken = int(state.get("taken", 0))
        self._raw = None
        self._windows = None  # the current block, in emit order

    def state(self) -> dict:
        """The position (STATE, block, taken), and for accounting only (not read back): `windows`
        emitted, and `read`: [documents, empty documents, rows parsed] up to the end of the current
        block, the documents its windows came from and what it took to find them."""
        end = self._next_start if self._windows is not None else self.start
        return {**dict(zip(self.STATE, self.start)), "block": self.block, "taken": self.taken,
                "windows": self.block * self.B + self.taken, "read": list(end[4:])}

    def next(self) -> tuple[np.ndarray, dict]:
        if self._windows is None:
            if self._raw is None:
                self._raw = self._packed(self.start)
            ws = []
            for _ in range(self.B):
                w, after = next(self._raw)
                ws.append(w)
            self._next_start = after
            if self.B > 1:  # seeded by the block index: the same permutation when the block is rebuilt
                order = np.random.default_rng([self.seed, self.j, self.s, self.block]).permutation(self.B)
                ws = [ws[k] for k in order]
            self._windows = ws
        w = self._windows[self.taken]
        self.taken += 1
        if self.taken == self.B:
            self.start, self.block, self.taken, self._windows = self._next_start, self.block + 1, 0, None
        return w, self.state()

    def _packed(self, cursor: tuple) -> Iterator[tuple[np.ndarray, tuple]]:
        """Windows of `length` tokens from `cursor` on, each with the cursor just after it."""
        epoch, p, i, off, ndocs, nempty, nparsed = cursor
        n, length, src = self.n, self.length, self.src
        parsed = [nparsed]  # rows parsed for this stream, counted by the source as it reads
        parts, have = [], 0  # pending tokens (array views), not yet emitted, and how many
        shards_dry = 0  # shards read since the last window (whole-shard streams)
        drop = (p, i, off)  # tokens of the first document already emitted before the cursor
        while True:
            fresh = p == 0 and i == 0 and off == 0  # a whole epoch read from its start
            epoch_tokens = 0
            order = shard_order(src.n_shards, self.seed, self.j, epoch, self.shuffle_shards)
            if self.owns_shards:  # whole shards: position p of epoch e is number e * n_shards + p, this
                # stream's if that is s mod N, so every stream gets one shard in N, over the epochs too
                positions = range(p + (self.s - epoch * src.n_shards - p) % n, src.n_shards, n)
            else:
                positions = range(p, src.n_shards)
            for pos in positions:
                shards_dry += 1
                if self.owns_shards and shards_dry > src.n_shards * n:  # N epochs' worth of the source
                    raise DataError(
                        f"data source {src.label!r}: stream {self.s} of {n} read {src.n_shards * n} shards in a "
                        f"row ({n} times the source's {src.n_shards}) without filling one window of "
                        f"seq_len+1={length} tokens: the corpus is too small; lower data.seq_len or "
                        "data.num_streams, or add data")
                start = i if pos == p else 0
                step, phase = (1, 0) if self.owns_shards else (n, (self.s - pos) % n)
                rows = src.docs(int(order[pos]), start, step, phase, parsed)
                for batch in _batched(rows, ENCODE_DOCS):
                    recs, texts = [], []
                    for row, text in batch:
                        if text.isspace() or not text:  # empty documents are skipped and counted
                            nempty += 1
                            continue
                        recs.append((row, ndocs, nempty))
                        texts.append(text)
                        ndocs += 1
                    if not texts:
                        continue
                    for (row, nd, ne), toks in zip(recs, encode_docs(self.tok, texts, self.eot)):
                        o = 0
                        if drop is not None:
                            if (pos, row) == drop[:2]:
                                o = drop[2]
                            drop = None
                        epoch_tokens += len(toks)
                        while have + len(toks) - o >= length:
                            take = length - have
                            parts.append(toks[o:o + take])
                            o += take
                            w = np.concatenate(parts) if len(parts) > 1 else parts[0]
                            parts, have = [], 0
                            shards_dry = 0
                            yield w, (epoch, pos, row, o, nd, ne, parsed[0])
                        if o < len(toks):
                            parts.append(toks[o:])
                            have += len(toks) - o
            if fresh and epoch_tokens < length and not self.owns_shards:  # (whole shards: checked above)
                raise DataError(
                    f"data source {src.label!r}: stream {self.s} of {n} has {epoch_tokens} tokens in an "
                    f"epoch, fewer than seq_len+1={length}: the corpus is too small; lower data.seq_len or "
                    "data.num_streams, split it into more documents (sample_by), or add data")
            epoch, p, i, off = epoch + 1, 0, 0, 0


def _batched(it, n):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


class PreparedStream:
    """Stream `s` of prepared source `j`: in epoch e it takes positions s, s+N, ... of a permutation of
    all windows seeded by (seed, j, e). State (epoch, k): the k-th window of the epoch is next; seeking
    is instant."""

    def __init__(self, src: PreparedSource, j: int, s: int, n_streams: int, seq_len: int, seed: int,
                 shuffle: bool, state: dict | None = None):
        self.src, self.j, self.s, self.n, self.length, self.seed, self.shuffle = (
            src, j, s, n_streams, seq_len + 1, seed, shuffle)
        self.windows = src.n_tokens // self.length
        self.per_epoch = len(range(s, self.windows, n_streams))  # this stream's windows in an epoch
        if self.windows <= s:
            raise DataError(
                f"prepared source {src.label!r} has {src.n_tokens} tokens = {self.windows} windows of "
                f"seq_len+1={self.length}, fewer than data.num_streams={n_streams}: lower data.seq_len or "
                "data.num_streams, or add data")
        state = state or {}
        self.epoch, self.k = int(state.get("epoch", 0)), int(state.get("k", 0))

    def next(self) -> tuple[np.ndarray, dict]:
        pos = self.s + self.k * self.n
        if pos >= self.windows:
            self.epoch, self.k, pos = self.epoch + 1, 0, self.s
        w = pos
        if self.shuffle:
            w = int(self.src.permutation((self.seed, self.j, self.epoch), self.windows)[pos])
        self.k += 1
        return self.src.window(w, self.length), {"epoch": self.epoch, "k": self.k,
                                                 "windows": self.epoch * self.per_epoch + self.k}
