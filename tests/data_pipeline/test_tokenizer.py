import json

import pytest

from data_pipeline.config import SourceConfig
from data_pipeline.errors import DataError
from data_pipeline.tokenizer import (eot_id, load_tokenizer, padded_vocab_size, tokenizer_fingerprint,
                                     train_tokenizer)
from dputil import make_docs, shared_file, write_jsonl


def test_gpt2_on_tinyshakespeare_is_not_truncated():
    tok = load_tokenizer(str(shared_file("gpt2-tokenizer.json")))
    text = shared_file("tinyshakespeare.txt").read_text()
    assert tok.encode("Hello world").ids == [15496, 995]
    n = len(tok.encode(text).ids)
    assert 337_000 < n < 339_000  # the file's own truncation at 50 would give a few dozen
    assert eot_id(tok) == 50256
    assert padded_vocab_size(tok, 64) == 50304


def test_builtin_tokenizer(tok):
    assert tok.get_vocab_size() == 4096
    assert eot_id(tok) == tok.token_to_id("<|endoftext|>") == 0
    text = 'The "assert" statement: raise AssertionError(expression2)'
    assert tok.decode(tok.encode(text).ids) == text
    assert padded_vocab_size(tok, 64) == 4096 and padded_vocab_size(tok, 1000) == 5000


def test_train_tokenizer(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", make_docs(300, seed=0))
    out = tmp_path / "tok" / "tokenizer.json"
    tok = train_tokenizer([SourceConfig(path=str(src))], 300, out, special_tokens=["<|endoftext|>", "<pad>"])
    assert out.exists() and tok.get_vocab_size() == 300
    again = load_tokenizer(str(out))
    assert again.token_to_id("<|endoftext|>") == 0 and again.token_to_id("<pad>") == 1
    text = "the function returns a value, café ✓"  # bytes never seen still encode (byte alphabet)
    assert again.decode(again.encode(text).ids) == text
    assert tokenizer_fingerprint(again) == tokenizer_fingerprint(tok)


def test_fingerprint_ignores_truncation_but_not_vocab(tmp_path, tok):
    fp = tokenizer_fingerprint(tok)
    state = json.loads(tok.to_str())
    state["truncation"] = {"direction": "Right", "max_length": 50, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "trunc.json").write_text(json.dumps(state))
    assert tokenizer_fingerprint(load_tokenizer(str(tmp_path / "trunc.json"))) == fp
    state["added_tokens"][0]["content"] = "<|other|>"
    (tmp_path / "other.json").write_text(json.dumps(state))
    other = load_tokenizer(str(tmp_path / "other.json"))
    assert tokenizer_fingerprint(other) != fp


def test_eot_lookup(tmp_path, tok):
    assert eot_id(tok, "<|endoftext|>") == 0
    with pytest.raises(DataError, match="data.eot_token='<nope>'"):
        eot_id(tok, "<nope>")
    src = write_jsonl(tmp_path / "d.jsonl", make_docs(50, seed=1))
    plain = train_tokenizer([SourceConfig(path=str(src))], 280, tmp_path / "t.json", special_tokens=["<x>"])
    with pytest.raises(DataError, match="set data.eot_token"):
        eot_id(plain)


def test_bad_tokenizer_files(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(DataError, match="does not parse"):
        load_tokenizer(str(bad))
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(DataError, match="unknown builtin tokenizer"):
        load_tokenizer("builtin:nope")
    assert load_tokenizer(str(shared_file("gpt2-tokenizer.json").parent / "gpt2-tokenizer.json"))
