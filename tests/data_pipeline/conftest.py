import pytest

from dputil import make_docs, write_jsonl


@pytest.fixture(scope="session")
def tok():
    from data_pipeline.tokenizer import load_tokenizer

    return load_tokenizer("builtin:python-docs-bpe")


@pytest.fixture
def corpus(tmp_path):
    """3 jsonl files of 40 short documents each; returns the directory."""
    d = tmp_path / "corpus"
    d.mkdir()
    for f in range(3):
        write_jsonl(d / f"part-{f}.jsonl", make_docs(40, seed=f, tag=f"f{f}d"))
    return d


@pytest.fixture
def sharded(tmp_path):
    """8 jsonl files of 10 short documents each (more files than the 4 streams: each stream reads
    its own 2 files); returns the directory."""
    d = tmp_path / "sharded"
    d.mkdir()
    for f in range(8):
        write_jsonl(d / f"part-{f}.jsonl", make_docs(10, seed=f, tag=f"s{f}d"))
    return d
