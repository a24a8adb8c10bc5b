import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline import builtin
from data_pipeline.config import SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.sources import resolve_source
from dputil import make_docs, write_jsonl


def all_docs(src):
    return [t for shard in range(src.n_shards) for _, t in src.docs(shard)]


def test_builtin_python_docs(tmp_path, monkeypatch):
    monkeypatch.setenv("PRETRAIN_CACHE", str(tmp_path))
    src = resolve_source(SourceConfig(path="builtin:python-docs"))
    docs = all_docs(src)
    assert src.kind == "json" and src.n_shards == builtin.N_FILES
    assert len(docs) > 200 and sum(map(len, docs)) > 400_000 and any("assert" in d for d in docs)
    held_out = all_docs(resolve_source(SourceConfig(path="builtin:python-docs", split="validation")))
    # As documented, independently of split_docs: every 10th distinct document is held out.
    distinct = list(dict.fromkeys(builtin.python_docs()))
    assert sorted(held_out) == sorted(distinct[::10])
    assert sorted(docs) == sorted(d for i, d in enumerate(distinct) if i % 10)
    assert all(f.startswith(str(tmp_path)) for f in src.files)
    assert resolve_source(SourceConfig(path="builtin:python-docs")).fingerprint == src.fingerprint
    with pytest.raises(DataError, match="unknown builtin dataset 'builtin:nope'"):
        resolve_source(SourceConfig(path="builtin:nope"))


def test_builtin_python_docstrings_is_other_text(tmp_path, monkeypatch):
    monkeypatch.setenv("PRETRAIN_CACHE", str(tmp_path))
    docs = all_docs(resolve_source(SourceConfig(path="builtin:python-docstrings")))
    assert docs == builtin.split_docs(builtin.python_docstrings(), "train")
    assert len(docs) > 50 and sum(map(len, docs)) > 300_000
    assert not set(docs) & set(builtin.python_docs())


def test_local_kinds_globs_and_dirs(tmp_path):
    docs = make_docs(30, seed=0)
    write_jsonl(tmp_path / "a.jsonl", docs[:10])
    write_jsonl(tmp_path / "b.jsonl", docs[10:20], field="content")
    pq.write_table(pa.table({"body": docs[20:]}), tmp_path / "c.parquet")
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "d.jsonl", docs[:5])

    src = resolve_source(SourceConfig(path=str(tmp_path / "a.jsonl")))
    assert (src.kind, src.n_shards, all_docs(src)) == ("json", 1, docs[:10])
    src = resolve_source(SourceConfig(path=str(tmp_path / "b.jsonl"), text_field="content"))
    assert all_docs(src) == docs[10:20]
    src = resolve_source(SourceConfig(path=str(tmp_path / "c.parquet"), text_field="body"))
    assert (src.kind, all_docs(src)) == ("parquet", docs[20:])
    src = resolve_source(SourceConfig(path=str(tmp_path / "*.jsonl"), text_field="text"))
    assert src.files == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")] and src.n_shards == 2
    src = resolve_source(SourceConfig(path=str(tmp_path / "sub")))
    assert all_docs(src) == docs[:5]
    with pytest.raises(DataError, match="mixes json, parquet files"):
        resolve_source(SourceConfig(path=str(tmp_path)))


def test_compressed_files(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write("one\n\ntwo")
    assert all_docs(resolve_source(SourceConfig(path=str(tmp_path / "a.jsonl.gz")))) == ["doc 0", "doc 1", "doc 2"]
    assert all_docs(resolve_source(SourceConfig(path=str(tmp_path / "b.txt.gz")))) == ["one", "two"]


def test_text_sample_by(tmp_path):
    (tmp_path / "t.txt").write_text("para one\nline two\n\npara two\n\n\npara three\n")
    def docs(by):
        return all_docs(resolve_source(SourceConfig(path=str(tmp_path / "t.txt"), sample_by=by)))
    assert docs("line") == ["para one", "line two", "", "para two", "", "", "para three"]
    assert [d.strip() for d in docs("paragraph")] == ["para one\nline two", "para two", "para three"]
    assert docs("document") == ["para one\nline two\n\npara two\n\n\npara three\n"]
    with pytest.raises(DataError, match="sample_by='page'"):
        docs("page")


def test_step_and_phase_select_rows(tmp_path):
    docs = make_docs(2500, seed=3)  # more rows than one Arrow read
    src = resolve_source(SourceConfig(path=str(write_jsonl(tmp_path / "a.jsonl", docs))))
    got = list(src.docs(0, start=1001, step=7, phase=3))
    assert got == [(i, docs[i]) for i in range(1001, 2500) if i % 7 == 3]


def test_undecodable_bytes(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"hello\n\nbad \xff\xfe bytes\n\nok")
    docs = all_docs(resolve_source(SourceConfig(path=str(tmp_path / "bad.txt"))))
    assert docs == ["hello", "bad \ufffd\ufffd bytes", "ok"]  # text files: replaced, not fatal
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "bad \xff bytes"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl\) is not valid UTF-8.*re-encode"):
        resolve_source(SourceConfig(path=str(tmp_path / "bad.jsonl")))


def test_bad_sources(tmp_path):
    with pytest.raises(DataError, match=r"'.*missing.jsonl' does not exist"):
        resolve_source(SourceConfig(path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(DataError, match="matches no files"):
        resolve_source(SourceConfig(path=str(tmp_path / "*.parquet")))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"'.*empty.jsonl' is empty"):
        resolve_source(SourceConfig(path=str(tmp_path / "empty.jsonl")))
    (tmp_path / "blank.txt").write_text("\n\n\n")
    with pytest.raises(DataError, match="is empty"):
        resolve_source(SourceConfig(path=str(tmp_path / "blank.txt")))
    write_jsonl(tmp_path / "c.jsonl", ["x"], field="content")
    with pytest.raises(DataError, match=r"has no field 'text' \(columns: content, id\)"):
        resolve_source(SourceConfig(path=str(tmp_path / "c.jsonl")))
    write_jsonl(tmp_path / "n.jsonl", ["x"])
    with pytest.raises(DataError, match="field 'id' holds int64, not text"):
        resolve_source(SourceConfig(path=str(tmp_path / "n.jsonl"), text_field="id"))
    (tmp_path / "x.csv").write_text("a\n")
    with pytest.raises(DataError, match="cannot tell the format"):
        resolve_source(SourceConfig(path=str(tmp_path / "x.csv")))
    with pytest.raises(DataError, match="kind='csv'"):
        resolve_source(SourceConfig(path=str(tmp_path / "x.csv"), kind="csv"))


def test_binary_files_given_as_text_are_refused(tmp_path):
    """Once: a binary file read as text trained on garbage without a word."""
    import os

    blob = os.urandom(50_000)
    (tmp_path / "model.bin.txt").write_bytes(blob.replace(b"\x00", b"\x01") + b"\x00" + blob)
    with pytest.raises(DataError, match=r"model.bin.txt\) looks binary, not text \(it contains NUL bytes\)"):
        resolve_source(SourceConfig(path=str(tmp_path / "model.bin.txt")))
    (tmp_path / "latin.txt").write_bytes(blob.replace(b"\x00", b"\x01")[:20_000])  # no NUL, not UTF-8
    with pytest.raises(DataError, match=r"looks binary, not text \(\d+% of its first characters are not UTF-8\)"):
        resolve_source(SourceConfig(path=str(tmp_path / "latin.txt")))
    with gzip.open(tmp_path / "packed.txt.gz", "wb") as f:
        f.write(b"text\n\n" + blob)
    with pytest.raises(DataError, match="packed.txt.gz.*looks binary"):
        resolve_source(SourceConfig(path=str(tmp_path / "packed.txt.gz")))
    write_jsonl(tmp_path / "nul.jsonl", ["fine", "bad\x00" * 10])
    with pytest.raises(DataError, match=r"nul.jsonl.*looks binary"):  # documents are checked too
        resolve_source(SourceConfig(path=str(tmp_path / "nul.jsonl")))


def test_local_files_have_a_held_out_split_or_refuse_one(tmp_path):
    """Once: `split: validation` on a local file was ignored, so "held-out" eval ran on training data."""
    docs = make_docs(3000, seed=5)
    path = str(write_jsonl(tmp_path / "a.jsonl", docs))
    with pytest.raises(DataError, match="split: validation, but local files have no validation split.*holdout"):
        resolve_source(SourceConfig(path=path, split="validation"))
    with pytest.raises(DataError, match="split='test'"):
        resolve_source(SourceConfig(path=path, split="test"))
    train = all_docs(resolve_source(SourceConfig(path=path, holdout=0.05)))
    held = all_docs(resolve_source(SourceConfig(path=path, split="validation", holdout=0.05)))
    assert sorted(train + held) == sorted(docs) and not set(train) & set(held)
    assert 0.03 < len(held) / len(docs) < 0.07
    # the same documents whatever stream reads them
    src = resolve_source(SourceConfig(path=path, split="validation", holdout=0.05))
    strided = sorted(t for phase in range(3) for _, t in src.docs(0, step=3, phase=phase))
    assert strided == sorted(held)


def test_a_held_out_split_must_be_held_out_of_training_too():
    from data_pipeline.config import DataConfig

    cfg = DataConfig(sources=[SourceConfig(path="a.jsonl")],
                     validation=[SourceConfig(path="a.jsonl", split="validation", holdout=0.01)])
    [problem] = cfg.problems()
    assert "held out with holdout=0.01" in problem and "training source has holdout=0.0" in problem
    cfg.sources[0].holdout = 0.01
    assert cfg.problems() == []
    with pytest.raises(DataError, match="holdout is for local files"):
        resolve_source(SourceConfig(path="builtin:python-docs", holdout=0.1))


def test_labels_name_the_sources_in_the_metrics():
    """data/tokens/NAME: a source's `label` when set (made safe for a metric name), else the last part
    of its path; names stay unique."""
    from data_pipeline.config import source_names

    sources = [SourceConfig(path="builtin:python-docs", label="web"), SourceConfig(path="data/web/*.jsonl.gz"),
               SourceConfig(path="org/name", label="code & math"), SourceConfig(path="/x/books.parquet"),
               SourceConfig(path="builtin:python-docs")]
    assert source_names(sources) == ["web", "web-1", "code___math", "books", "python-docs"]
