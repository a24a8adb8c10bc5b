import importlib
import json

import numpy as np
import pytest
import torch

from data_pipeline import build_loader, prepare
from data_pipeline.config import SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.sources import resolve_source
from dputil import data_cfg, doc_tokens, make_docs, run_ranks, take, windows, write_jsonl


def corpus_docs(corpus):
    return [json.loads(line)["text"] for f in sorted(corpus.glob("*.jsonl")) for line in f.read_text().splitlines()]


def test_prepare_writes_tokens_and_meta(corpus, tmp_path, tok):
    write_jsonl(corpus / "part-3.jsonl", ["", "   ", "last doc"])  # empty docs are skipped and counted
    cfg = data_cfg(corpus)
    [out] = prepare(cfg, tmp_path / "prep", num_proc=2)
    meta = json.loads((out / "meta.json").read_text())
    docs = corpus_docs(corpus)
    expected = doc_tokens(tok, [d for d in docs if d.strip()])
    assert meta["dtype"] == "uint16" and meta["eot_id"] == 0 and meta["vocab_size"] == 4096
    assert (meta["tokens"], meta["docs"], meta["empty_docs"]) == (len(expected), 121, 2)
    assert np.fromfile(out / "tokens-00000.bin", dtype=np.uint16).tolist() == expected
    assert resolve_source(SourceConfig(path=str(out))).kind == "prepared"  # found by its meta.json
    [again] = prepare(cfg, tmp_path / "prep1", num_proc=1)
    assert (again / "tokens-00000.bin").read_bytes() == (out / "tokens-00000.bin").read_bytes()


def test_prepared_windows_equal_streaming(corpus, tmp_path, tok, monkeypatch):
    module = importlib.import_module("data_pipeline.prepare")  # the package's `prepare` is the function
    monkeypatch.setattr(module, "SHARD_TOKENS", 100)  # many files: windows cross files
    cfg = data_cfg(corpus, num_streams=1, shuffle_blocks=1, shuffle_shards=False)
    [out] = prepare(cfg, tmp_path / "prep", num_proc=2)
    assert len(list(out.glob("tokens-*.bin"))) > 20
    pcfg = data_cfg(SourceConfig(path=str(out), kind="prepared"), num_streams=1, shuffle_blocks=1)
    n = json.loads((out / "meta.json").read_text())["tokens"] // 17 // 4
    streamed = windows(take(build_loader(cfg, tok, 0, 1, 4), n))
    prepared = windows(take(build_loader(pcfg, tok, 0, 1, 4), n))
    assert torch.equal(prepared, streamed)


def test_prepared_shuffled_covers_each_window_once_per_epoch(corpus, tmp_path, tok):
    [out] = prepare(data_cfg(corpus), tmp_path / "prep", num_proc=1)
    tokens = np.fromfile(out / "tokens-00000.bin", dtype=np.uint16).astype(np.int64)
    n_windows = len(tokens) // 17
    all_windows = {tuple(w) for w in tokens[:n_windows * 17].reshape(-1, 17).tolist()}
    pcfg = data_cfg(out, num_streams=4, shuffle_blocks=8)
    got = windows(take(build_loader(pcfg, tok, 0, 4, 1), n_windows // 4))
    for r in range(1, 4):
        got = torch.cat([got, windows(take(build_loader(pcfg, tok, r, 4, 1), n_windows // 4))])
    seen = [tuple(w) for w in got.tolist()]
    assert len(set(seen)) == len(seen) and set(seen) <= all_windows
    assert seen[:10] != [tuple(w) for w in tokens[:170].reshape(10, 17).tolist()]  # shuffled


@pytest.mark.parametrize("workers", [0, 2])
def test_prepared_resume_across_world_sizes(corpus, tmp_path, tok, workers):
    [out] = prepare(data_cfg(corpus), tmp_path / "prep", num_proc=2)
    other = write_jsonl(tmp_path / "b.jsonl", make_docs(40, 5, "b"))
    # a prepared source mixed with a streaming one, past the end of an epoch
    cfg = data_cfg(SourceConfig(path=str(out), weight=2), SourceConfig(path=str(other)), num_workers=workers)
    ref, _ = run_ranks(cfg, tok, world=2, global_batch=8, n_global=30)
    a, state = run_ranks(cfg, tok, world=2, global_batch=8, n_global=10)
    b, state = run_ranks(cfg, tok, world=1, global_batch=8, n_global=10, state=state)
    c, state = run_ranks(cfg, tok, world=4, global_batch=8, n_global=10, state=state)
    assert {**a, **b, **c} == ref
    assert max(st["epoch"] for key, st in state["streams"].items() if key.startswith("0/")) >= 1


def test_prepared_with_another_tokenizer(corpus, tmp_path, tok):
    from data_pipeline.tokenizer import train_tokenizer

    [out] = prepare(data_cfg(corpus), tmp_path / "prep", num_proc=1)
    tok2 = train_tokenizer([SourceConfig(path=str(corpus))], 300, tmp_path / "t.json")
    with pytest.raises(DataError, match="tokenized with another tokenizer.*re-run `pretrain data prepare`"):
        build_loader(data_cfg(out), tok2, 0, 1, 1)
    with pytest.raises(DataError, match=r"fewer than data.num_streams=4"):
        build_loader(data_cfg(out, seq_len=1000), tok, 0, 1, 1)
    with pytest.raises(DataError, match=r"has \d+ tokens = 0 windows of seq_len\+1=100001"):
        build_loader(data_cfg(out, seq_len=100000), tok, 0, 1, 1)
    (out / "tokens-00000.bin").write_bytes(b"12")
    with pytest.raises(DataError, match="wrong size"):
        build_loader(data_cfg(out), tok, 0, 1, 1)


def test_prepare_several_sources(corpus, tmp_path, tok):
    other = write_jsonl(tmp_path / "b.jsonl", make_docs(10, 5))
    cfg = data_cfg(corpus, other, validation=[SourceConfig(path=str(other))])
    dirs = prepare(cfg, tmp_path / "prep", num_proc=1)
    assert [d.name for d in dirs] == ["source-0", "source-1", "validation-0"]
    assert all((d / "meta.json").exists() for d in dirs)


def test_a_prepared_dir_of_another_format_is_refused(corpus, tmp_path):
    [out] = prepare(data_cfg(corpus), tmp_path / "prep", num_proc=1)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "format": "pretrain-tokens/9"}))
    with pytest.raises(DataError, match="has format 'pretrain-tokens/9', this pretrain reads 'pretrain-tokens/1'"):
        resolve_source(SourceConfig(path=str(out)))
