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
    assert eot_id(tok, "") == 50256
    assert padded_vocab_size(tok, 64) == 50304


def test_truncation_and_padding_in_a_tokenizer_file_are_switched_off(tmp_path, tok):
    """A tokenizer.json may carry truncation and padding (GPT-2's truncates at 50 tokens): either
    would silently cut or pad every document. Written here with both switched on, it loads with both
    off: a long text encodes to all its tokens, a short one to its own."""
    from data_pipeline import builtin

    path = tmp_path / "tokenizer.json"
    with_both = load_tokenizer("builtin:python-docs-bpe")
    with_both.enable_truncation(50)
    with_both.enable_padding(length=40, pad_id=0)
    with_both.save(str(path))
    text = "\n\n".join(builtin.python_docs()[:20])
    assert len(with_both.encode(text).ids) == 50 and len(with_both.encode("a").ids) == 40  # (the trap)
    loaded = load_tokenizer(str(path))
    assert loaded.encode(text).ids == tok.encode(text).ids and len(tok.encode(text).ids) > 1000
    assert loaded.encode("a").ids == tok.encode("a").ids and len(loaded.encode("a").ids) == 1


def test_builtin_tokenizer(tok):
    assert tok.get_vocab_size() == 4096
    assert eot_id(tok, "") == tok.token_to_id("<|endoftext|>") == 0
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
        eot_id(plain, "")


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


def test_train_tokenizer_command(tmp_path, capsys):
    """`pretrain data train-tokenizer FILES --vocab-size N --out PATH`: a byte-level BPE of exactly N
    tokens learned from every file given (a jsonl and a text file here), the special tokens first,
    and any text round-trips."""
    from pretrain.cli import main

    jsonl = write_jsonl(tmp_path / "a.jsonl", make_docs(300, seed=0))
    txt = tmp_path / "b.txt"
    txt.write_text("\n\n".join(f"zebracorn {i} quokkaline" for i in range(300)))  # words found only here
    out = tmp_path / "tok" / "tokenizer.json"
    assert main(["data", "train-tokenizer", str(jsonl), str(txt), "--vocab-size", "400", "--out", str(out),
                 "--special-tokens", "<|endoftext|>", "<pad>"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out} (vocab 400)"
    tok = load_tokenizer(str(out))
    assert tok.get_vocab_size() == 400
    assert (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<pad>")) == (0, 1) and eot_id(tok, "") == 0
    for word in ("zebracorn", "Ġquokkaline", "Ġfunction"):  # merged from b.txt, b.txt and a.jsonl
        assert tok.token_to_id(word) is not None, word
    for text in ("the function returns a value, café ✓\n\tzebracorn", make_docs(1, seed=5)[0]):
        assert tok.decode(tok.encode(text).ids) == text
    assert tok.encode("zebracorn quokkaline").tokens == ["zebracorn", "Ġquokkaline"]
    # the vocabulary size is honoured (a smaller one learns fewer merges)
    assert main(["data", "train-tokenizer", str(jsonl), "--vocab-size", "270", "--out", str(tmp_path / "s.json")]) == 0
    assert load_tokenizer(str(tmp_path / "s.json")).get_vocab_size() == 270
