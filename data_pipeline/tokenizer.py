"""Tokenizers: load (file, builtin or hub), find the end-of-text id, fingerprint, train byte-level BPE."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer

from data_pipeline.config import SourceConfig
from data_pipeline.errors import DataError

EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def load_tokenizer(spec: str) -> Tokenizer:
    """Load a tokenizer from a tokenizer.json path (or a directory holding one), `builtin:NAME`,
    or `hub:NAME` (downloads from the Hugging Face hub: only when asked for by that prefix).

    Truncation and padding are switched off: a file may carry them (GPT-2's does, at 50 tokens),
    and either would silently cut or pad documents.
    """
    from data_pipeline import builtin

    if spec.startswith("builtin:"):
        path = builtin.tokenizer_file(spec.removeprefix("builtin:"))
    elif spec.startswith("hub:"):
        try:
            tok = Tokenizer.from_pretrained(spec.removeprefix("hub:"))
        except Exception as e:
            raise DataError(f"could not load tokenizer {spec!r} from the hub ({_first_line(e)}): "
                            "check the name and the network, or give a local tokenizer.json") from None
        return _plain(tok)
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"tokenizer {spec!r} not found: give a tokenizer.json path, "
                            "builtin:python-docs-bpe, or hub:NAME to download one")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise DataError(f"tokenizer file {str(path)!r} does not parse ({_first_line(e)}): "
                        "give a tokenizer.json written by the `tokenizers` library") from None
    return _plain(tok)


def _plain(tok: Tokenizer) -> Tokenizer:
    tok.no_truncation()
    tok.no_padding()
    return tok


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def eot_id(tok: Tokenizer, spec: str) -> int:
    """Id of the end-of-text token: `spec` (data.eot_token) if given, else the first of
    EOT_CANDIDATES in the vocabulary. The one owner of a run's end-of-text id: the documents'
    separator, the task scoring's empty context, the export's eos token all come from here, with
    the run's data.eot_token (no default, so that no caller can leave it out)."""
    for name in [spec] if spec else EOT_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    if spec:
        raise DataError(f"data.eot_token={spec!r} is not in the tokenizer's vocabulary: "
                        "set data.eot_token to one of its special tokens")
    raise DataError("the tokenizer has none of the end-of-text tokens " + ", ".join(EOT_CANDIDATES)
                    + ": set data.eot_token to the token that ends a document")


def padded_vocab_size(tok: Tokenizer, multiple: int = 64) -> int:
    """The model's embedding rows: the tokenizer's vocabulary (with added tokens) rounded up to `multiple`."""
    n = tok.get_vocab_size(with_added_tokens=True)
    return -(-n // multiple) * multiple


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON (sorted keys, no truncation/padding)."""
    state = json.loads(tok.to_str())
    state["truncation"] = state["padding"] = None
    return hashlib.sha256(json.dumps(state, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def encode_docs(tok: Tokenizer, texts: list[str], eot: int) -> list[np.ndarray]:
    """Token ids of each text followed by `eot`, as int32 arrays. No special tokens are added
    (a BOS from the tokenizer's post-processor would be repeated inside every packed window)."""
    encs = tok.encode_batch_fast(texts, add_special_tokens=False)
    out = []
    for e in encs:
        ids = e.ids
        ids.append(eot)
        out.append(np.array(ids, dtype=np.int32))
    return out


@contextlib.contextmanager
def fork_safe():
    """Around a fork (DataLoader workers, a process pool): the children start with the tokenizer's
    thread pool off. Threads do not survive a fork, and each child is one of several processes
    sharing the cores anyway; set explicitly, it also avoids the tokenizers fork warning."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def train_tokenizer(sources: list[SourceConfig], vocab_size: int, out_path: str | os.PathLike,
                    special_tokens: Iterable[str] = ("<|endoftext|>",)) -> Tokenizer:
    """Train a byte-level BPE tokenizer (GPT-2 style: ByteLevel pre-tokenizer and decoder, the 256
    byte symbols as initial alphabet) on every document of `sources`; save it as tokenizer.json."""
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    from data_pipeline.sources import resolve_source

    special_tokens = list(special_tokens)
    if vocab_size < 256 + len(special_tokens):
        raise DataError(f"vocab size {vocab_size} is smaller than the 256 byte symbols plus "
                        f"{len(special_tokens)} special tokens: raise --vocab-size")
    resolved = [resolve_source(s) for s in sources]
    if any(s.kind == "prepared" for s in resolved):
        raise DataError("cannot train a tokenizer on a prepared (already tokenized) source: "
                        "give the raw text source instead")

    def batches() -> Iterator[list[str]]:
        for src in resolved:
            for shard in range(src.n_shards):
                batch = []
                for _, text in src.docs(shard):
                    if text:
                        batch.append(text)
                    if len(batch) == 1000:
                        yield batch
                        batch = []
                if batch:
                    yield batch

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(batches(), trainer=trainer)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return tok


def build_tokenizer_assets() -> None:
    """Train the builtin tokenizers on the builtin datasets' train splits and write them into
    data_pipeline/assets/ (`python -m data_pipeline.tokenizer`)."""
    from data_pipeline import builtin

    for name, sources, vocab in (("python-docs-bpe", ["builtin:python-docs"], 4096),
                                 ("python-bpe-512", ["builtin:python-docs", "builtin:python-docstrings"], 512)):
        path = builtin.TOKENIZERS[name]
        tok = train_tokenizer([SourceConfig(path=s) for s in sources], vocab, path)
        print(f"wrote {path} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    build_tokenizer_assets()
