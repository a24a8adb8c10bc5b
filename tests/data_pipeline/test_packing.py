import json

import pytest
import torch

from data_pipeline import build_loader, build_validation_batches, load_tokenizer
from data_pipeline.config import SourceConfig
from data_pipeline.streams import Mixture
from dputil import by_global_index, data_cfg, doc_tokens, make_docs, shared_file, take, windows, write_jsonl


def corpus_docs(corpus):
    return [json.loads(line)["text"] for f in sorted(corpus.glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_windows_are_documents_joined_with_eot(corpus, tok):
    cfg = data_cfg(corpus, num_streams=1, shuffle_blocks=1, shuffle_shards=False)
    expected = doc_tokens(tok, corpus_docs(corpus))
    n = len(expected) // 17
    batches = take(build_loader(cfg, tok, 0, 1, micro_batch_size=1), n + 1)
    assert all(b["input_ids"].shape == (1, 16) and b["input_ids"].dtype == torch.int64 for b in batches)
    assert all(torch.equal(b["input_ids"][0, 1:], b["labels"][0, :-1]) for b in batches)
    got = windows(batches).flatten().tolist()
    assert got[:n * 17] == expected[:n * 17]  # no padding, nothing dropped, in order
    assert got[n * 17:] == (expected[n * 17:] + expected)[:17]  # the tail runs on into epoch 2


def test_every_document_lands_in_its_stream(corpus, tok):
    # At world size = num_streams, rank r reads exactly stream r: doc (p, i) goes to (p + i) % 4.
    cfg = data_cfg(corpus, num_streams=4, shuffle_blocks=1, shuffle_shards=False)
    files = [corpus_docs(corpus)[k * 40:(k + 1) * 40] for k in range(3)]
    total = 0
    for r in range(4):
        mine = [d for p, docs in enumerate(files) for i, d in enumerate(docs) if (p + i) % 4 == r]
        expected = doc_tokens(tok, mine)
        n = len(expected) // 17
        got = windows(take(build_loader(cfg, tok, r, 4, 1), n)).flatten().tolist()
        assert got == expected[:n * 17]
        total += len(mine)
    assert total == 120


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_coverage_any_world_size_and_workers(corpus, tok, world, workers):
    # 8 streams, shuffled; > 1 epoch (~180 windows per epoch). Every sequence g must be the same window
    # as in the 1-rank in-process run: disjoint across ranks, covering, identical global batches.
    base = data_cfg(corpus, num_streams=8, shuffle_blocks=3)
    ref = by_global_index(take(build_loader(base, tok, 0, 1, 4), 64), 0, 1)
    cfg = data_cfg(corpus, num_streams=8, shuffle_blocks=3, num_workers=workers)
    got = {}
    for r in range(world):
        loader = build_loader(cfg, tok, r, world, micro_batch_size=8 // world)
        part = by_global_index(take(loader, 32), r, world)  # 32 global batches of 8
        assert not set(part) & set(got)
        got.update(part)
    assert got == ref


def test_mixture_weights():
    m = Mixture([3, 1], seed=5)
    picks = [m.source_of(g) for g in range(20000)]
    assert abs(picks.count(0) / 20000 - 0.75) < 0.015
    assert picks == [Mixture([3, 1], seed=5).source_of(g) for g in range(20000)]
    assert picks != [Mixture([3, 1], seed=6).source_of(g) for g in range(20000)]
    assert {Mixture([1], seed=1).source_of(g) for g in range(100)} == {0}


def test_mixture_in_loader(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", ["class " * 40] * 50)
    b = write_jsonl(tmp_path / "b.jsonl", ["return " * 40] * 50)
    cfg = data_cfg(SourceConfig(path=str(a), weight=3), SourceConfig(path=str(b), weight=1), num_workers=2)
    w = windows(take(build_loader(cfg, tok, 0, 1, 8), 100))
    ta, tb = set(tok.encode("class " * 3).ids) - {0}, set(tok.encode("return " * 3).ids) - {0}
    from_a = [set(x.tolist()) - {0} <= ta for x in w]
    from_b = [set(x.tolist()) - {0} <= tb for x in w]
    assert all(x != y for x, y in zip(from_a, from_b))  # each window from one source only
    assert abs(sum(from_a) / len(w) - 0.75) < 0.05


def test_validation_batches_same_every_run_and_world_size(corpus, tmp_path, tok):
    val = write_jsonl(tmp_path / "val.jsonl", make_docs(60, seed=9))
    cfg = data_cfg(corpus, validation=[SourceConfig(path=str(val))], num_streams=4)
    one = build_validation_batches(cfg, tok, 0, 1, micro_batch_size=8, n_batches=3)
    assert len(one) == 3 and all(b["input_ids"].shape == (8, 16) for b in one)
    again = build_validation_batches(cfg, tok, 0, 1, micro_batch_size=8, n_batches=3)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(one, again))
    two = {}
    for r in range(2):
        two.update(by_global_index(build_validation_batches(cfg, tok, r, 2, 4, 3), r, 2))
    assert two == by_global_index(one, 0, 1)
    # unshuffled: sequence 0 is the start of stream 0, the first document
    first = json.loads(val.read_text().splitlines()[0])["text"]
    assert one[0]["input_ids"][0].tolist() == doc_tokens(tok, [first])[:16]


def test_one_big_document_streams_as_its_exact_tokens(tmp_path, tok):
    """A text file read as one document (sample_by: document), in windows of 1024 tokens: the
    windows are exactly its tokens and the end-of-text token, in order, nothing cut or padded."""
    from data_pipeline import builtin

    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(builtin.python_docs()[:300]))
    expected = tok.encode(path.read_text()).ids + [0]
    n = len(expected) // 1024
    assert n >= 20
    cfg = data_cfg(SourceConfig(path=str(path), sample_by="document"), seq_len=1023, num_streams=1, shuffle_blocks=1)
    got = windows(take(build_loader(cfg, tok, 0, 1, 10), n // 10)).flatten().tolist()
    assert got == expected[:n // 10 * 10 * 1024]


def test_gpt2_tinyshakespeare_stream():
    tok = load_tokenizer(str(shared_file("gpt2-tokenizer.json")))
    path = shared_file("tinyshakespeare.txt")
    expected = tok.encode(path.read_text()).ids + [50256]
    assert 337_000 < len(expected) < 339_000
    cfg = data_cfg(SourceConfig(path=str(path), sample_by="document"), seq_len=1023,
                   num_streams=1, shuffle_blocks=1)
    n = len(expected) // 1024
    got = windows(take(build_loader(cfg, tok, 0, 1, 10), n // 10)).flatten().tolist()
    assert got == expected[:n // 10 * 10 * 1024]


def test_empty_documents_are_skipped_and_counted(tmp_path, tok):
    docs = make_docs(40, seed=4)
    with_empty = [d for doc in docs for d in (doc, "", "  \n")]
    write_jsonl(tmp_path / "a.jsonl", with_empty)
    cfg = data_cfg(tmp_path / "a.jsonl", num_streams=1, shuffle_blocks=1)
    expected = doc_tokens(tok, docs)
    n = len(expected) // 17
    loader = build_loader(cfg, tok, 0, 1, 1)
    assert windows(take(loader, n)).flatten().tolist() == expected[:n * 17]
    assert loader.stats()["empty_docs"] > 70 and loader.stats()["docs"] > 35
