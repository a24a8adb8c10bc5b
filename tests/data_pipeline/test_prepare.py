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


def prepared_tokens(out) -> list[int]:
    """The tokens of a prepared directory, its files concatenated in meta.json's order."""
    meta = json.loads((out / "meta.json").read_text())
    return np.concatenate([np.fromfile(out / s["file"], dtype=meta["dtype"]) for s in meta["shards"]]).tolist()


def test_prepare_writes_tokens_and_meta(corpus, tmp_path, tok):
    write_jsonl(corpus / "part-3.jsonl", ["", "   ", "last doc"])  # empty docs are skipped and counted
    cfg = data_cfg(corpus)
    [out] = prepare(cfg, tmp_path / "prep", num_proc=2)  # 4 files: two processes, whole files each
    meta = json.loads((out / "meta.json").read_text())
    docs = corpus_docs(corpus)
    expected = doc_tokens(tok, [d for d in docs if d.strip()])
    assert meta["dtype"] == "uint16" and meta["eot_id"] == 0 and meta["vocab_size"] == 4096
    assert (meta["tokens"], meta["docs"], meta["empty_docs"]) == (len(expected), 121, 2)
    assert [s["file"] for s in meta["shards"]] == [f"tokens-{k:05d}.bin" for k in range(4)]  # one per input file
    assert prepared_tokens(out) == expected
    assert resolve_source(SourceConfig(path=str(out))).kind == "prepared"  # found by its meta.json
    [again] = prepare(cfg, tmp_path / "prep1", num_proc=1)
    assert prepared_tokens(again) == expected


def test_one_file_is_read_here_and_tokenized_in_the_pool(corpus, tmp_path, tok):
    one = write_jsonl(tmp_path / "one.jsonl", corpus_docs(corpus))
    [out] = prepare(data_cfg(one), tmp_path / "prep", num_proc=2)
    assert prepared_tokens(out) == doc_tokens(tok, corpus_docs(corpus))


def test_prepared_windows_equal_streaming(corpus, tmp_path, tok, monkeypatch):
    module = importlib.import_module("data_pipeline.prepare")  # the package's `prepare` is the function
    monkeypatch.setattr(module, "SHARD_TOKENS", 100)  # many files: windows cross files
    cfg = data_cfg(corpus, num_streams=1, shuffle_blocks=1, shuffle_shards=False)
    [out] = prepare(cfg, tmp_path / "prep", num_proc=2)
    assert len(json.loads((out / "meta.json").read_text())["shards"]) > 20
    pcfg = data_cfg(SourceConfig(path=str(out), kind="prepared"), num_streams=1, shuffle_blocks=1)
    n = json.loads((out / "meta.json").read_text())["tokens"] // 17 // 4
    streamed = windows(take(build_loader(cfg, tok, 0, 1, 4), n))
    prepared = windows(take(build_loader(pcfg, tok, 0, 1, 4), n))
    assert torch.equal(prepared, streamed)


def test_prepared_shuffled_covers_each_window_once_per_epoch(corpus, tmp_path, tok):
    [out] = prepare(data_cfg(corpus), tmp_path / "prep", num_proc=1)
    tokens = np.asarray(prepared_tokens(out), dtype=np.int64)
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


def test_tasks_then_merge_equal_one_process(corpus, tmp_path, tok, capsys):
    """3 tasks take the 4 files k % 3; nothing is usable before --merge, which refuses while a task
    is missing; the merged directory is the one a single process writes, and the printed config
    trains on it."""
    import yaml

    write_jsonl(corpus / "part-3.jsonl", make_docs(20, seed=9))
    cfg = data_cfg(corpus)
    [single] = prepare(cfg, tmp_path / "single", num_proc=1)
    out = tmp_path / "tasks"
    for i in (0, 2):
        prepare(cfg, out, num_proc=1, task_index=i, num_tasks=3)
    assert not (out / "meta.json").exists()
    with pytest.raises(DataError, match="not finished"):
        build_loader(data_cfg(out), tok, 0, 1, 1)
    with pytest.raises(DataError, match=r"1 of 4 shards .* not prepared \(shards 1\).*k % --num-tasks"):
        prepare(cfg, out, merge=True)
    prepare(cfg, out, num_proc=2, task_index=1, num_tasks=3)
    capsys.readouterr()
    prepare(cfg, out, merge=True)
    assert prepared_tokens(out) == prepared_tokens(single)
    keys = ("tokens", "docs", "empty_docs", "shards", "source", "tokenizer_fingerprint")
    meta = [json.loads((d / "meta.json").read_text()) for d in (out, single)]
    assert {k: meta[0][k] for k in keys} == {k: meta[1][k] for k in keys}
    assert resolve_source(SourceConfig(path=str(out))).fingerprint == resolve_source(
        SourceConfig(path=str(single))).fingerprint  # the same data to a resume
    snippet = capsys.readouterr().out.split("# train on it")[1]
    data = yaml.safe_load(snippet.split("\n", 1)[1])["data"]
    assert data["sources"][0]["path"] == str(out)
    from data_pipeline.config import DataConfig

    loaded = DataConfig(**{**data, "sources": [SourceConfig(**s) for s in data["sources"]]})
    assert len(take(build_loader(loaded, tok, 0, 1, 2), 2)) == 2


def test_a_killed_prepare_keeps_its_finished_shards(corpus, tmp_path, tok, capsys):
    cfg = data_cfg(corpus)
    [out] = prepare(cfg, tmp_path / "prep", num_proc=1)
    want = prepared_tokens(out)
    (out / "parts" / "shard-00001.json").unlink()  # as if killed while writing shard 1
    (out / "tokens-00001.bin").write_bytes(b"\0\0")
    capsys.readouterr()
    prepare(cfg, out, num_proc=1)
    assert "2 of 3 shards already prepared, kept" in capsys.readouterr().out
    assert prepared_tokens(out) == want


def test_bad_task_arguments(corpus, tmp_path):
    with pytest.raises(DataError, match="--task-index 3 --num-tasks 3"):
        prepare(data_cfg(corpus), tmp_path / "p", task_index=3, num_tasks=3)


def test_an_input_changed_since_is_prepared_again(corpus, tmp_path, tok):
    import os

    cfg = data_cfg(corpus)
    [out] = prepare(cfg, tmp_path / "prep", num_proc=1, progress=False)
    first = corpus / "part-0.jsonl"
    text = first.read_text()
    first.write_text(text.replace("f0d0 ", "f0d9 ", 1))  # the same size, other content
    os.utime(first, ns=(1, 10**18))
    prepare(cfg, out, num_proc=1, progress=False)
    docs = corpus_docs(corpus)
    assert prepared_tokens(out) == doc_tokens(tok, docs) and not list(out.rglob("*.tmp"))


def test_merge_removes_what_killed_tasks_left(corpus, tmp_path, tok):
    """A task killed while writing leaves `*.tmp` files (tokens and shard records, named by its pid)
    and, killed between two files, a token file no record lists: --merge removes them all."""
    cfg = data_cfg(corpus)
    out = tmp_path / "tasks"
    for i in range(2):
        prepare(cfg, out, num_proc=1, task_index=i, num_tasks=2, progress=False)
    debris = [out / "tokens-00001.bin.4242.tmp", out / "tokens-00001-1.bin.4242.tmp", out / "parts" / "shard-00002.json.4243.tmp",
              out / "tokens-00007.bin"]
    for path in debris:
        path.write_bytes(b"\1\0" * 10)
    prepare(cfg, out, merge=True)
    assert not any(p.exists() for p in debris)
    meta = json.loads((out / "meta.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == sorted(["meta.json", "parts", *(s["file"] for s in meta["shards"])])
    assert sorted(p.name for p in (out / "parts").iterdir()) == [f"shard-{k:05d}.json" for k in range(3)]
    assert prepared_tokens(out) == doc_tokens(tok, corpus_docs(corpus))


def _big_vocab_tokenizer(path, size: int):
    """A word-level tokenizer of `size` tokens: w0 ... w{size-2} and the end-of-text token last."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(size - 1)} | {"<|endoftext|>": size - 1}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(path))
    return tk


def test_a_vocabulary_over_65536_is_prepared_as_uint32_and_read_back_exactly(tmp_path):
    import random

    tk = _big_vocab_tokenizer(tmp_path / "big.json", 70_000)
    rng = random.Random(0)
    docs = [" ".join(f"w{rng.choice([rng.randrange(70_000 - 1), rng.randrange(65_530, 65_540)])}"
                     for _ in range(rng.randint(5, 40))) for _ in range(200)]
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    expected = doc_tokens(tk, docs, eot=69_999)
    assert max(expected) == 69_999 and sum(t >= 65_536 for t in expected) > 100  # ids uint16 would wrap
    cfg = data_cfg(src, tokenizer=str(tmp_path / "big.json"), num_streams=1, shuffle_blocks=1, shuffle_shards=False)
    [out] = prepare(cfg, tmp_path / "prep", num_proc=1, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", 70_000, 69_999)
    assert (out / "tokens-00000.bin").stat().st_size == 4 * len(expected)
    assert prepared_tokens(out) == expected
    # and the loader reads the windows back exactly: the same as streaming the text
    pcfg = data_cfg(SourceConfig(path=str(out)), tokenizer=str(tmp_path / "big.json"), num_streams=1,
                    shuffle_blocks=1)
    n = len(expected) // 17 // 4
    prepared = windows(take(build_loader(pcfg, str(tmp_path / "big.json"), 0, 1, 4), n))
    assert prepared.max() >= 65_536
    assert prepared.tolist() == torch.tensor(expected[:n * 4 * 17]).reshape(-1, 17).tolist()
    assert torch.equal(prepared, windows(take(build_loader(cfg, str(tmp_path / "big.json"), 0, 1, 4), n)))
