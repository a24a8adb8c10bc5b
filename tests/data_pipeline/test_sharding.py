"""Read once: with at least as many shards as streams, each stream reads only its own shards, so
across all ranks and DataLoader workers every document is parsed about once per epoch; with fewer,
every reader parses the whole source. Counted by the loaders' own accounting (`stats()`)."""

import logging

import pytest

from data_pipeline import build_loader
from data_pipeline.config import SourceConfig
from data_pipeline.errors import DataError
from dputil import data_cfg, make_docs, write_jsonl


def amplification(cfg, tok, world: int, batches: int) -> float:
    """Rows parsed by all readers / documents used, after `batches` micro-batches on every rank
    (the ranks are loaders in this process; their workers are real DataLoader processes)."""
    loaders = [build_loader(cfg, tok, r, world, 8) for r in range(world)]
    for it in [iter(ld) for ld in loaders]:
        for _ in range(batches):
            next(it)
    stats = [ld.stats() for ld in loaders]
    return sum(s["parsed_docs"] for s in stats) / sum(s["docs"] + s["empty_docs"] for s in stats)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """16 files of 1,000 documents, and the same 16,000 documents in one file."""
    d = tmp_path_factory.mktemp("big")
    docs = make_docs(16_000, seed=3)
    (d / "many").mkdir()
    for f in range(16):
        write_jsonl(d / "many" / f"part-{f:02d}.jsonl", docs[f * 1000:(f + 1) * 1000])
    write_jsonl(d / "one.jsonl", docs)
    return d


def test_many_shards_are_read_once_at_two_ranks_by_two_workers(big, tok):
    kw = dict(seq_len=32, num_streams=4, num_workers=2, shuffle_blocks=4)
    once = amplification(data_cfg(big / "many", **kw), tok, world=2, batches=600)
    every = amplification(data_cfg(big / "one.jsonl", **kw), tok, world=2, batches=150)
    assert once <= 1.1  # each shard parsed by the one worker of the one stream that owns it
    assert every >= 3.5  # one file: each of the 2 x 2 readers parses all of it


def test_a_hub_layout_is_split_by_its_own_file_list(tmp_path, tok):
    """kind: hub goes through `datasets`' own data-file resolution (a dataset repo's layout, here a
    local one): its files are the shards the streams own."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    docs = make_docs(4000, seed=5)
    for f in range(8):
        write_jsonl(repo / "data" / f"train-{f:05d}-of-00008.jsonl", docs[f * 500:(f + 1) * 500])
    cfg = data_cfg(SourceConfig(path=str(repo), kind="hub"), seq_len=32, num_streams=4, num_workers=2,
                   shuffle_blocks=4)
    assert build_loader(cfg, tok).plan.sources[0].n_shards == 8
    assert amplification(cfg, tok, world=2, batches=300) <= 1.1


def test_fewer_shards_than_streams_is_said_once(tmp_path, tok, caplog):
    path = write_jsonl(tmp_path / "a.jsonl", make_docs(100, seed=1))
    with caplog.at_level(logging.INFO, logger="data_pipeline.loader"):
        build_loader(data_cfg(path, num_streams=4), tok, rank=0, world_size=2)
        build_loader(data_cfg(path, num_streams=4), tok, rank=1, world_size=2)
    said = [r.message for r in caplog.records if "shard(s) for data.num_streams" in r.message]
    assert len(said) == 1 and "1 shard(s) for data.num_streams=4" in said[0]


def test_each_stream_reads_only_its_own_shards(sharded, tok):
    """One epoch of every stream (8 files, 4 streams, no shuffling): the documents read are each
    file's, once, and the streams' files are disjoint."""
    cfg = data_cfg(sharded, num_streams=4, shuffle_blocks=1, shuffle_shards=False)
    plan = build_loader(cfg, tok).plan
    seen, read = {s: set() for s in range(4)}, {}
    for s in range(4):
        stream = plan.stream(0, s, None)
        while True:
            _, state = stream.next()
            if state["epoch"] > 0:
                break
            seen[s].add(state["shard_pos"])
            read[s] = state["read"]  # [documents, empty, rows parsed] so far
    assert seen == {0: {0, 4}, 1: {1, 5}, 2: {2, 6}, 3: {3, 7}}
    # its 2 files of 10 rows parsed once, nothing else; the last document is still being cut
    assert all(parsed == 20 and 19 <= docs <= 20 for docs, _, parsed in read.values()), read


def test_a_small_source_is_parsed_once_per_process(tmp_path, tok):
    """Fewer shards than streams, one reader: the streams share the parse of every shard even when
    one comes to a shard after another has finished it, and a source under 64 MB of tables is then
    served from memory in later epochs (no reader's tables are inherited by a forked worker)."""
    for f in range(2):
        write_jsonl(tmp_path / f"p{f}.jsonl", make_docs(150, seed=f))
    cfg = data_cfg(tmp_path / "*.jsonl", num_streams=8, shuffle_blocks=16)
    loader = build_loader(cfg, tok, 0, 1, 8)
    assert loader.plan.sources[0]._shared is None  # the check's reads are not kept for the workers
    it = iter(loader)
    for _ in range(300):
        next(it)
    stats = loader.stats()
    assert max(int(st["epoch"]) for st in loader.state_dict()["streams"].values()) >= 2
    assert stats["parsed_docs"] == 300 < stats["docs"] + stats["empty_docs"]


def test_whole_shards_are_dealt_evenly_over_epochs(tmp_path, tok):
    """6 shards for 4 streams: numbering the shards of all epochs in order, each stream takes every
    4th, so over 2 epochs each stream reads 3 shards and each shard is read once per epoch."""
    for f in range(6):
        write_jsonl(tmp_path / f"p{f}.jsonl", make_docs(10, seed=f, tag=f"f{f}d"))
    plan = build_loader(data_cfg(tmp_path, num_streams=4, shuffle_blocks=1), tok).plan
    read = {}
    for s in range(4):
        stream, seen = plan.stream(0, s, None), set()
        while True:
            _, state = stream.next()
            if state["epoch"] >= 2:
                break
            seen.add((state["epoch"], state["shard_pos"]))
        read[s] = seen
    assert [len(v) for v in read.values()] == [3, 3, 3, 3]
    for epoch in (0, 1):
        positions = sorted(p for v in read.values() for e, p in v if e == epoch)
        assert positions == list(range(6))


def test_a_tiny_shard_does_not_stop_the_run(tmp_path, tok):
    for f in range(8):
        write_jsonl(tmp_path / f"p{f}.jsonl", make_docs(50, seed=f))
    write_jsonl(tmp_path / "p8.jsonl", ["hi"])  # 9 shards for 8 streams, one of 2 tokens
    loader = build_loader(data_cfg(tmp_path, num_streams=8, seq_len=32), tok, 0, 1, 8)
    it = iter(loader)
    for _ in range(60):  # several epochs
        next(it)


def test_a_source_too_small_for_one_window_is_one_line(tmp_path, tok):
    for f in range(4):
        write_jsonl(tmp_path / f"p{f}.jsonl", ["a few words"])
    with pytest.raises(DataError, match=r"read 16 shards in a row \(4 times the source's 4\) without filling one window"):
        next(iter(build_loader(data_cfg(tmp_path, num_streams=4, seq_len=256), tok)))
