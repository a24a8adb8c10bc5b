"""The training and validation loaders: a world-size-independent global order of packed sequences.

Global sequence g = 0, 1, 2, ... comes from source j = mixture(seed, g) and stream s = g % num_streams
of that source. Rank r of W takes g = r + W*m for its m-th sequence, so global batch b (G sequences)
is g in [bG, (b+1)G) at any world size. DataLoader worker k of K takes local sequences m ≡ start + k
(mod K); K divides num_streams/W, so each stream is read by exactly one worker. Workers yield one
sequence at a time with the state of its stream after it; the main process keeps the states of the
sequences it actually handed out, so prefetched items never move the saved position.

State: {"consumed": global sequences C, "num_streams": N, "streams": {"j/s": stream state},
"fingerprint": {...}}. The trainer merges all ranks' states (`merge_states`); any world size W'
dividing C and N resumes from the merged state, each rank picking its streams s ≡ r (mod W').
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline.config import DataConfig, SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.sources import PreparedSource, TextSource, _digest, _first_line, resolve_source
from data_pipeline.streams import Mixture, PreparedStream, TextStream
from data_pipeline.tokenizer import eot_id, fork_safe, load_tokenizer, tokenizer_fingerprint

log = logging.getLogger(__name__)
STATE_VERSION = 1


@dataclass
class _Plan:
    """Everything a worker needs to produce any sequence: picklable, no open files."""

    sources: list
    tok: object
    eot: int
    seq_len: int
    num_streams: int
    seed: int
    shuffle_blocks: int
    shuffle_shards: bool
    mixture: Mixture

    def stream(self, j: int, s: int, state: dict | None):
        src = self.sources[j]
        if isinstance(src, PreparedSource):
            return PreparedStream(src, j, s, self.num_streams, self.seq_len, self.seed,
                                  shuffle=self.shuffle_blocks > 1, state=state)
        return TextStream(src, self.tok, self.eot, j, s, self.num_streams, self.seq_len, self.seed,
                          self.shuffle_blocks, self.shuffle_shards, state)


def _plan(sources: list[SourceConfig], data: DataConfig, tok, seed: int, shuffle: bool) -> tuple[_Plan, dict]:
    problems = data.problems()
    if problems:
        raise DataError("; ".join(problems))
    tok = load_tokenizer(tok) if isinstance(tok, str) else tok
    if tok is None:
        tok = load_tokenizer(data.tokenizer)
    tok.no_truncation()  # a user's tokenizer object may carry them too
    tok.no_padding()
    eot = eot_id(tok, data.eot_token)
    tok_fp = tokenizer_fingerprint(tok)
    resolved = [resolve_source(s) for s in sources]
    for cfg, src in zip(sources, resolved):
        if isinstance(src, PreparedSource):
            if src.meta.get("tokenizer_fingerprint") != tok_fp:
                raise DataError(f"prepared source {cfg.path!r} was tokenized with another tokenizer "
                                f"({src.meta.get('tokenizer', '?')}): re-run `pretrain data prepare` with "
                                f"data.tokenizer={data.tokenizer}, or use the tokenizer it was prepared with")
            if src.meta.get("eot_id") != eot:
                raise DataError(f"prepared source {cfg.path!r} ends documents with token {src.meta.get('eot_id')}, "
                                f"this run with {eot}: set data.eot_token as when it was prepared")
    weights = [s.weight for s in sources]
    plan = _Plan(resolved, tok, eot, data.seq_len, data.num_streams, seed,
                 data.shuffle_blocks if shuffle else 1, data.shuffle_shards and shuffle,
                 Mixture(weights, seed))
    for j, src in enumerate(resolved):
        if isinstance(src, PreparedSource):
            plan.stream(j, plan.num_streams - 1, None)  # fails now, not mid-run, if a stream gets no window
    # Sources that read whole shards order their documents otherwise than row striding did: a
    # position saved before (or with fewer shards) is not theirs. Row-striding sources keep the old order.
    whole = [j for j, s in enumerate(resolved) if isinstance(s, TextSource) and s.n_shards >= plan.num_streams]
    reads = f" whole_shards={','.join(map(str, whole))}" if whole else ""
    fingerprint = {
        "sources": _digest([[s.fingerprint, w] for s, w in zip(resolved, weights)]),
        "tokenizer": tok_fp,
        "order": f"seq_len={plan.seq_len} seed={seed} shuffle_blocks={plan.shuffle_blocks} "
                 f"shuffle_shards={plan.shuffle_shards}{reads}",
    }
    return plan, fingerprint


class _WorkerError:
    """Sent instead of a sequence when a worker fails: the main process raises DataError(message)."""

    def __init__(self, message: str):
        self.message = message


class _Sequences(IterableDataset):
    """One rank's sequences from local index `start` on: (window int32 (seq_len+1,), g, j, s, state)."""

    def __init__(self, plan: _Plan, rank: int, world_size: int, start: int, states: dict):
        self.plan, self.rank, self.world_size, self.start, self.states = plan, rank, world_size, start, states

    def __iter__(self):
        info = get_worker_info()
        k, K = (info.id, info.num_workers) if info else (0, 1)
        plan, streams = self.plan, {}
        m = self.start + k
        try:
            while True:
                g = self.rank + self.world_size * m
                j, s = plan.mixture.source_of(g), g % plan.num_streams
                stream = streams.get((j, s))
                if stream is None:
                    stream = streams[(j, s)] = plan.stream(j, s, self.states.get(f"{j}/{s}"))
                try:
                    w, state = stream.next()
                except DataError:
                    raise
                except Exception as e:  # name the source: the traceback stays in the worker
                    raise DataError(f"data source {plan.sources[j].label!r} (stream {s}): {_first_line(e)}") from e
                yield w, g, j, s, state
                m += K
        except DataError as e:
            yield _WorkerError(str(e))


def _as_is(item):
    return item


def _survive_foreign_sigterm(worker_id: int) -> None:
    """Slurm (scancel, time limit, preemption) sends SIGTERM to every process of a job step, and
    torch's DataLoader workers die of a SIGTERM their parent did not send: the training process
    would then fail mid-step instead of saving its checkpoint. Here SIGTERM is blocked and a thread
    takes it: from the parent (shutdown) the worker exits, from anyone else it is ignored (the
    training process has its own handler and stops the workers when it is done)."""
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=wait, daemon=True, name="sigterm").start()


def _worker_count(requested: int, per_rank: int) -> int:
    """The largest divisor of the streams per rank that is <= requested, so each stream has one reader."""
    return max(d for d in range(1, max(requested, 1) + 1) if per_rank % d == 0) if requested else 0


class TokenLoader:
    """Micro-batches of packed sequences for one rank: {"input_ids": (B, T) int64, "labels": (B, T) int64}.

    Iterating continues from the current position (a fresh `iter()` after `load_state_dict` resumes).
    The stream never ends: epochs follow one another.
    """

    def __init__(self, plan: _Plan, fingerprint: dict, rank: int, world_size: int, micro_batch_size: int,
                 num_workers: int, force_resume: bool = False):
        if world_size < 1 or not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is not in a world of size {world_size}")
        if plan.num_streams % world_size:
            raise DataError(f"data.num_streams={plan.num_streams} is not divisible by the world size "
                            f"{world_size}: set data.num_streams to a multiple of it (fixed for a run)")
        if micro_batch_size < 1:
            raise DataError(f"micro batch size {micro_batch_size} must be >= 1")
        self.plan, self.fingerprint = plan, fingerprint
        self.rank, self.world_size, self.micro_batch_size = rank, world_size, micro_batch_size
        self.force_resume = force_resume
        per_rank = plan.num_streams // world_size
        if all(isinstance(s, PreparedSource) for s in plan.sources):
            # no tokenizing to spread: workers would only add a copy through a queue per sequence
            self.num_workers = 0
        else:
            self.num_workers = _worker_count(num_workers, per_rank)
            if self.num_workers != num_workers and rank == 0:
                log.info("data: %d DataLoader workers instead of %d (must divide the %d streams per rank)",
                         self.num_workers, num_workers, per_rank)
        self._m = 0  # local sequences handed out
        self._states: dict[str, dict] = {}  # latest state of each stream, from handed-out sequences

    @property
    def sequences_consumed(self) -> int:
        """Global sequences consumed (all ranks, assuming they advance together)."""
        return self._m * self.world_size

    def stats(self) -> dict:
        """This rank's accounting since the start of the run (it is part of the saved position):
        `docs`, `empty_docs`: documents tokenized and empty ones skipped by its text streams, and
        `parsed_docs`: the rows parsed to find them (all up to the end of each stream's current
        shuffle block); `sequences`: sequences handed out from each source."""
        read = [st.get("read", [st["docs"], st["empty"], 0]) for st in self._states.values() if "docs" in st]
        sequences = [0] * len(self.plan.sources)
        for key, st in self._states.items():
            j = int(key.split("/")[0])
            if j < len(sequences):  # (a forced resume may have dropped sources)
                sequences[j] += st.get("windows", 0)
        docs, empty, parsed = (sum(r[k] for r in read) for k in range(3))
        return {"docs": docs, "empty_docs": empty, "parsed_docs": parsed, "sequences": sequences}

    def _items(self) -> Iterator:
        data = _Sequences(self.plan, self.rank, self.world_size, self._m, dict(self._states))
        if self.num_workers == 0:
            return iter(data)
        # collate_fn=_as_is: the default would turn each window into a tensor in shared memory, sent
        # as a file descriptor over a socket: ~0.5 ms a sequence, against a few us for a pickled array.
        loader = DataLoader(data, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is,
                            prefetch_factor=max(2, self.micro_batch_size), in_order=True,
                            worker_init_fn=_survive_foreign_sigterm)
        with fork_safe():  # the workers are forked here
            return iter(loader)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        items = self._items()
        B = self.micro_batch_size
        try:
            while True:
                rows = []
                for _ in range(B):
                    item = next(items)
                    if isinstance(item, _WorkerError):
                        raise DataError(item.message)
                    rows.append(item)
                inputs = torch.empty((B, self.plan.seq_len), dtype=torch.int64)
                labels = torch.empty((B, self.plan.seq_len), dtype=torch.int64)
                x, y = inputs.numpy(), labels.numpy()
                for i, (w, g, j, s, state) in enumerate(rows):
                    assert g == self.rank + self.world_size * (self._m + i), "sequence out of order"
                    x[i] = w[:-1]  # one copy from the window's dtype (int32, or uint16 from a memmap)
                    y[i] = w[1:]
                    self._states[f"{j}/{s}"] = state
                self._m += B
                yield {"input_ids": inputs, "labels": labels}
        finally:
            # Stop the workers now: a traceback that keeps this frame alive would otherwise keep them.
            del items

    def state_dict(self) -> dict:
        """This rank's position: JSON-able. Merge all ranks' with `merge_states` before saving."""
        return {"version": STATE_VERSION, "consumed": self.sequences_consumed,
                "num_streams": self.plan.num_streams, "streams": dict(self._states),
                "fingerprint": dict(self.fingerprint)}

    def check_state(self, state: dict | None) -> None:
        """Raise DataError if `state` (merged, from a checkpoint) cannot position this loader: another
        state version, num_streams, world size not dividing it, or other data (unless forced)."""
        if not isinstance(state, dict):
            raise DataError("the checkpoint has no data position (data_state.json): it cannot be resumed")
        version = state.get("version")
        if version != STATE_VERSION:
            raise DataError(f"the data position has version {version}, this pretrain reads version {STATE_VERSION}: "
                            "resume with the pretrain version that saved it")
        n = state.get("num_streams")
        if n != self.plan.num_streams:
            raise DataError(f"the data state was saved with data.num_streams={n}, this run has "
                            f"{self.plan.num_streams}: set data.num_streams={n} (it is fixed for a run)")
        saved = state.get("fingerprint", {})
        fields = {"sources": "data.sources", "tokenizer": "data.tokenizer",
                  "order": "data.seq_len/seed/shuffle_blocks/shuffle_shards"}
        for key, field in fields.items():
            if saved.get(key) != self.fingerprint[key] and not self.force_resume:
                what = (f"({saved.get(key)} vs {self.fingerprint[key]})" if key == "order"
                        else f"(fingerprint {str(saved.get(key))[:12]} vs {self.fingerprint[key][:12]})")
                if key == "order" and "whole_shards" in str(saved.get(key)) + self.fingerprint[key]:
                    field += " or the sources whose streams read whole shards (whole_shards; before, all striped rows)"
                raise DataError(f"the data state was saved with other {field} {what}: resume with the "
                                "same data settings, or set data.force_resume=true to continue anyway")
        consumed = int(state["consumed"])
        if consumed % self.world_size:
            raise DataError(f"the data state has {consumed} sequences consumed, not divisible by the world "
                            f"size {self.world_size}: resume at a world size that divides the global batch")

    def load_state_dict(self, state: dict) -> None:
        """Resume from a merged state saved at any world size dividing its `consumed` count."""
        self.check_state(state)
        self._m = int(state["consumed"]) // self.world_size
        self._states = {key: st for key, st in state["streams"].items()
                        if int(key.split("/")[1]) % self.world_size == self.rank}


def merge_states(states: list[dict]) -> dict:
    """One state from all ranks' `state_dict()`s (any order), loadable at any world size."""
    if not states:
        raise ValueError("merge_states needs at least one state")
    first = states[0]
    for st in states[1:]:
        if st["consumed"] != first["consumed"] or st["fingerprint"] != first["fingerprint"]:
            raise DataError(f"data states of the ranks disagree (consumed {st['consumed']} vs "
                            f"{first['consumed']}): save them at the same step")
    merged = {**first, "streams": {}}
    for st in states:
        merged["streams"].update(st["streams"])
    return merged


def build_loader(data_cfg: DataConfig, tokenizer=None, rank: int = 0, world_size: int = 1,
                 micro_batch_size: int = 1, seed: int | None = None) -> TokenLoader:
    """The training loader for `rank` of `world_size` over data_cfg.sources.

    tokenizer: a `tokenizers.Tokenizer`, a spec string for `load_tokenizer`, or None for data_cfg.tokenizer.
    seed: data order seed (default data_cfg.seed).
    """
    plan, fingerprint = _plan(data_cfg.sources, data_cfg, tokenizer,
                              data_cfg.seed if seed is None else seed, shuffle=True)
    for cfg, src in zip(data_cfg.sources, plan.sources):
        if rank == 0 and not isinstance(src, PreparedSource) and src.n_shards < plan.num_streams:
            log.info("data source %r has %d shard(s) for data.num_streams=%d: every stream reads all of it "
                     "and keeps 1/%d of its rows (each reader parses it in full); with at least %d files "
                     "each stream reads only its own", cfg.path, src.n_shards, plan.num_streams,
                     plan.num_streams, plan.num_streams)
    return TokenLoader(plan, fingerprint, rank, world_size, micro_batch_size, data_cfg.num_workers,
                       data_cfg.force_resume)


def build_validation_batches(data_cfg: DataConfig, tokenizer=None, rank: int = 0, world_size: int = 1,
                             micro_batch_size: int = 1, n_batches: int = 1) -> list[dict[str, torch.Tensor]]:
    """This rank's part of the first n_batches global validation batches (of micro_batch_size x
    world_size sequences): the first n_batches x micro_batch_size x world_size sequences of the
    validation sources, unshuffled. The union over ranks is the same at any world size for the same
    product, and the same in every run."""
    if not data_cfg.validation:
        raise DataError("no validation data: add sources under data.validation")
    plan, fingerprint = _plan(data_cfg.validation, data_cfg, tokenizer, data_cfg.seed, shuffle=False)
    loader = TokenLoader(plan, fingerprint, rank, world_size, micro_batch_size, num_workers=0)
    it = iter(loader)
    return [next(it) for _ in range(n_batches)]


def evaluation_windows(data_cfg: DataConfig, tokenizer=None, rank: int = 0, world_size: int = 1,
                       sequences: int = 0) -> Iterator:
    """This rank's windows (seq_len + 1 tokens, numpy) of the validation sources, unshuffled, for
    scoring a model: global sequences g = rank + world_size * m, the same windows at any world size.
    `sequences` > 0: the first that many global sequences (those build_validation_batches gives).
    0: one pass, every window that starts in the first epoch of its stream (a stream's last window
    may run on into the start of the next epoch); the pass ends when every stream of this rank has
    wrapped around."""
    if not data_cfg.validation:
        raise DataError("no validation data: add sources under data.validation")
    plan, _ = _plan(data_cfg.validation, data_cfg, tokenizer, data_cfg.seed, shuffle=False)
    if plan.num_streams % world_size:
        raise DataError(f"data.num_streams={plan.num_streams} is not divisible by the world size {world_size}")
    mine = {(j, s) for j in range(len(plan.sources)) for s in range(rank, plan.num_streams, world_size)
            if data_cfg.validation[j].weight > 0}
    epoch_before = dict.fromkeys(mine, 0)  # text streams report the position after each window
    repeated = False
    for item in _Sequences(plan, rank, world_size, 0, {}):
        if isinstance(item, _WorkerError):
            raise DataError(item.message)
        w, g, j, s, state = item
        prepared = isinstance(plan.sources[j], PreparedSource)
        started_in = state["epoch"] if prepared else epoch_before[(j, s)]
        epoch_before[(j, s)] = state["epoch"]
        if sequences:
            if g >= sequences:
                return
            if started_in and not repeated:
                repeated = True
                log.warning("warning: the first %d validation sequences repeat windows: a stream of the data "
                            "wrapped around at global sequence %d (a full pass scores every window once)",
                            sequences, g)
            yield w
            continue
        if started_in == 0:
            yield w
        elif (j, s) in mine:
            mine.discard((j, s))
            if not mine:
                return
