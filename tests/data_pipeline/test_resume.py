import json

import pytest
import torch

from data_pipeline import build_loader, merge_states
from data_pipeline.config import SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.tokenizer import train_tokenizer
from dputil import data_cfg, make_docs, run_ranks, take, windows, write_jsonl


@pytest.mark.parametrize("case", ["shuffle", "mixture", "workers", "no-shuffle", "no-shared-parse", "sharded",
                                  "sharded-workers"])
def test_exact_resume_three_times(corpus, sharded, tmp_path, tok, case, monkeypatch):
    corpus = sharded if case.startswith("sharded") else corpus  # streams read their own files
    sources, kw = [SourceConfig(path=str(corpus), weight=3)], {"shuffle_blocks": 4}
    if case == "sharded-workers":
        kw["num_workers"] = 2
    if case == "mixture":
        sources.append(SourceConfig(path=str(write_jsonl(tmp_path / "b.jsonl", make_docs(50, 7, "b")))))
    if case == "workers":
        kw["num_workers"] = 2
    if case == "no-shared-parse":  # streams cannot share parsed tables: each parses on its own
        monkeypatch.setattr("data_pipeline.sources.SHARED_BYTES", 0)
        sources.append(SourceConfig(path=str(write_jsonl(tmp_path / "b.jsonl", make_docs(3000, 7, "b")))))
    if case == "no-shuffle":
        kw.update(shuffle_blocks=1, shuffle_shards=False)
    cfg = data_cfg(*sources, **kw)
    n = 25  # 100 sequences a piece: 25 per stream, mid-block, past an epoch
    straight = windows(take(build_loader(cfg, tok, 0, 1, 4), 3 * n))
    pieces, state = [], None
    for _ in range(3):
        loader = build_loader(cfg, tok, 0, 1, 4)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))  # JSON-able, as in a checkpoint
        pieces.append(windows(take(loader, n)))
        state = merge_states([loader.state_dict()])
    assert state["consumed"] == 3 * n * 4 and loader.stats()["docs"] > 100
    assert max(st["epoch"] for st in state["streams"].values()) >= 1  # crossed an epoch
    assert torch.equal(torch.cat(pieces), straight)


def test_iterating_again_continues(corpus, tok):
    cfg = data_cfg(corpus, num_workers=2)
    straight = windows(take(build_loader(cfg, tok, 0, 1, 2), 12))
    loader = build_loader(cfg, tok, 0, 1, 2)
    parts = [windows(take(loader, 4)) for _ in range(3)]  # a new iter() each time: prefetch is not lost
    assert torch.equal(torch.cat(parts), straight)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("files", ["3 files", "8 files"])  # fewer shards than streams, and more
def test_world_size_change(corpus, sharded, tok, workers, files):
    # Saved at 2 ranks (states merged), resumed at 1, then at 4: every global sequence g is the same
    # window as in the uninterrupted 2-rank run, so global batches match as sets and in order.
    cfg = data_cfg(corpus if files == "3 files" else sharded, num_streams=4, num_workers=workers)
    ref, _ = run_ranks(cfg, tok, world=2, global_batch=8, n_global=9)
    a, state = run_ranks(cfg, tok, world=2, global_batch=8, n_global=3)
    b, state = run_ranks(cfg, tok, world=1, global_batch=8, n_global=3, state=state)
    c, state = run_ranks(cfg, tok, world=4, global_batch=8, n_global=3, state=state)
    assert sorted(ref) == list(range(72))
    assert {**a, **b, **c} == ref
    assert state["consumed"] == 72 and len(state["streams"]) == 4


def test_state_mismatches(corpus, tmp_path, tok):
    cfg = data_cfg(corpus)
    loader = build_loader(cfg, tok, 0, 1, 3)
    take(loader, 1)
    state = loader.state_dict()

    other = write_jsonl(tmp_path / "other.jsonl", make_docs(100, seed=42))
    with pytest.raises(DataError, match="saved with other data.sources.*force_resume=true"):
        build_loader(data_cfg(other), tok, 0, 1, 3).load_state_dict(state)
    forced = build_loader(data_cfg(other, force_resume=True), tok, 0, 1, 3)
    forced.load_state_dict(state)
    assert forced.sequences_consumed == 3 and take(forced, 2)

    with pytest.raises(DataError, match=r"data.seq_len/seed/shuffle_blocks/shuffle_shards \(seq_len=16"):
        build_loader(data_cfg(corpus, seq_len=32), tok, 0, 1, 3).load_state_dict(state)
    tok2 = train_tokenizer([SourceConfig(path=str(other))], 300, tmp_path / "t.json")
    with pytest.raises(DataError, match="other data.tokenizer"):
        build_loader(cfg, tok2, 0, 1, 3).load_state_dict(state)
    with pytest.raises(DataError, match="data.num_streams=4, this run has 8"):
        build_loader(data_cfg(corpus, num_streams=8), tok, 0, 1, 3).load_state_dict(state)
    with pytest.raises(DataError, match="3 sequences consumed, not divisible by the world size 2"):
        build_loader(cfg, tok, 0, 2, 3).load_state_dict(state)
    with pytest.raises(DataError, match="not divisible by the world size 3"):
        build_loader(cfg, tok, 0, 3, 3)


def test_a_state_of_another_version_is_refused(tmp_path):
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs(200, seed=1))
    tok = "builtin:python-docs-bpe"
    loader = build_loader(data_cfg(corpus), tok, 0, 1, 3)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    state["version"] = 99
    with pytest.raises(DataError, match="version 99, this pretrain reads version 1"):
        build_loader(data_cfg(corpus), tok, 0, 1, 3).load_state_dict(state)
