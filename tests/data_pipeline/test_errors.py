"""Bad input gives one-line DataErrors naming the bad value, also when it is found in a worker process."""

import pytest

from data_pipeline import build_loader
from data_pipeline.config import SourceConfig
from data_pipeline.errors import DataError
from dputil import data_cfg, make_docs, take, write_jsonl


def first_batch(cfg, tok):
    return take(build_loader(cfg, tok, 0, 1, 2), 1)


def test_bad_sources_at_build(tmp_path, tok):
    with pytest.raises(DataError, match=r"'.*nope.jsonl' does not exist"):
        first_batch(data_cfg(tmp_path / "nope.jsonl"), tok)
    write_jsonl(tmp_path / "c.jsonl", ["x"], field="content")
    with pytest.raises(DataError, match=r"no field 'text' \(columns: content, id\): set text_field"):
        first_batch(data_cfg(tmp_path / "c.jsonl"), tok)
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(DataError, match="is empty"):
        first_batch(data_cfg(tmp_path / "e.jsonl"), tok)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="does not parse"):
        first_batch(data_cfg(tmp_path / "c.jsonl", tokenizer=str(tmp_path / "tokenizer.json")), None)
    with pytest.raises(DataError, match="num_streams and data.shuffle_blocks must be >= 1"):
        first_batch(data_cfg(tmp_path / "c.jsonl", num_streams=0), tok)


@pytest.mark.parametrize("workers", [0, 2])
def test_seq_len_longer_than_corpus(tmp_path, tok, workers):
    write_jsonl(tmp_path / "a.jsonl", make_docs(8, seed=0))
    cfg = data_cfg(tmp_path / "a.jsonl", seq_len=4096, num_workers=workers)
    with pytest.raises(DataError, match=r"stream 0 of 4 has \d+ tokens in an epoch, fewer than seq_len\+1=4097") as e:
        first_batch(cfg, tok)
    assert "\n" not in str(e.value)
    one_doc = tmp_path / "one.txt"  # one document cannot feed 4 streams
    one_doc.write_text(" ".join(make_docs(50, seed=1)))
    with pytest.raises(DataError, match=r"stream 1 of 4 has 0 tokens.*split it into more documents"):
        first_batch(data_cfg(SourceConfig(path=str(one_doc), sample_by="document"), num_workers=workers), tok)


@pytest.mark.parametrize("workers", [0, 2])
def test_errors_found_in_workers_surface_as_one_line(tmp_path, tok, workers):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "a.jsonl", make_docs(40, seed=0))
    (d / "b.jsonl").write_text('{"text": "fine"}\n{"text": \n')  # only read once a stream gets to it
    cfg = data_cfg(d, shuffle_shards=False, num_workers=workers)
    with pytest.raises(DataError, match=r"b.jsonl\) could not be read \(ArrowInvalid: JSON parse error") as e:
        take(build_loader(cfg, tok, 0, 1, 2), 100)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)

    write_jsonl(d / "b.jsonl", make_docs(5, seed=1), field="content")
    with pytest.raises(DataError, match=r"b.jsonl\) has columns \['content', 'id'.* unlike the first file's"):
        take(build_loader(cfg, tok, 0, 1, 2), 100)
