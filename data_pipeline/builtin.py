"""Built-in data that exists on every machine without network: Python's own documentation text.

`builtin:python-docs` is the English text of `pydoc_data.topics` (the topics behind `help("assert")`,
~465 KB), split into documents of a few paragraphs, written once as jsonl files into a cache dir and
then read through the same `datasets` json path as any user file. `builtin:python-docs-bpe` is a
4096-token byte-level BPE tokenizer trained on it, shipped in `data_pipeline/assets/`
(rebuild with `python -m data_pipeline.tokenizer`). `builtin:python-docstrings` is a second corpus of
the same kind, the stdlib modules' docstrings, used by the fine-tuning example.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from data_pipeline.errors import DataError

DATASETS = ("python-docs", "python-docstrings")
TOKENIZERS = {
    "python-docs-bpe": Path(__file__).parent / "assets" / "python-docs-bpe.json",  # 4096, on python-docs
    # 512, on python-docs + python-docstrings: small models whose size is not mostly the vocabulary
    # (configs/scaling_tiny.yaml, a scaling-law sweep on CPU)
    "python-bpe-512": Path(__file__).parent / "assets" / "python-bpe-512.json",
}
DOC_CHARS = 2000  # paragraphs are grouped into documents of about this many characters
N_FILES = 4  # shards, so that shard shuffling has something to permute
VALIDATION_EVERY = 10  # every 10th document forms the held-out validation split


def cache_dir() -> Path:
    """$PRETRAIN_CACHE/builtin, default ~/.cache/pretrain/builtin."""
    root = os.environ.get("PRETRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pretrain")
    return Path(root) / "builtin"


def python_docs() -> list[str]:
    """The documents of builtin:python-docs: each topic cut at paragraph breaks into ~DOC_CHARS chunks."""
    from pydoc_data.topics import topics

    docs = []
    for name in sorted(topics):
        chunk = ""
        for para in topics[name].split("\n\n"):
            if chunk and len(chunk) + len(para) > DOC_CHARS:
                docs.append(chunk)
                chunk = ""
            chunk = f"{chunk}\n\n{para}" if chunk else para
        if chunk.strip():
            docs.append(chunk)
    return docs


def python_docstrings() -> list[str]:
    """The documents of builtin:python-docstrings: the docstrings of the top-level stdlib modules
    (module, class and function docstrings of one module form one document), read with `ast` from
    the source files, never imported. Another register of English than python-docs: the fine-tuning
    example's "new data". (Parsed once per process: the standard library takes seconds.)"""
    return list(_python_docstrings())


@functools.cache
def _python_docstrings() -> tuple[str, ...]:
    import ast
    import sysconfig

    docs = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        parts = [d for d in (ast.get_docstring(n) for n in nodes) if d]
        if parts:
            docs.append("\n\n".join(parts))
    return tuple(docs)


def split_docs(docs: list[str], split: str) -> list[str]:
    """Every VALIDATION_EVERY-th distinct document is held out as the "validation" split; "train" is
    the rest. Duplicates (some help topics share text) are dropped first, so nothing leaks."""
    if split not in ("train", "validation"):
        raise DataError(f"builtin datasets have the splits train and validation, not {split!r}")
    held_out = split == "validation"
    return [d for i, d in enumerate(dict.fromkeys(docs)) if (i % VALIDATION_EVERY == 0) == held_out]


def dataset_files(name: str, split: str = "train") -> list[str]:
    """Write split `split` of builtin dataset `name` as jsonl shards (once, atomically) and return
    their paths."""
    if name not in DATASETS:
        raise DataError(f"unknown builtin dataset 'builtin:{name}': use one of "
                        + ", ".join(f"builtin:{d}" for d in DATASETS))
    docs = split_docs(python_docs() if name == "python-docs" else python_docstrings(), split)
    lines = [json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs]
    # The directory is named by content, so a Python upgrade that changes the docs gets a new one.
    digest = hashlib.sha256("".join(lines).encode()).hexdigest()[:12]
    out = cache_dir() / f"{name}-{split}-{digest}"
    paths = [out / f"part-{k:05d}.jsonl" for k in range(N_FILES)]
    if all(p.exists() for p in paths):
        return [str(p) for p in paths]
    out.mkdir(parents=True, exist_ok=True)
    per = -(-len(lines) // N_FILES)
    for k, path in enumerate(paths):
        # Several ranks may write at once: write a private temp file, then rename over.
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text("".join(lines[k * per:(k + 1) * per]), encoding="utf-8")
        os.replace(tmp, path)
    return [str(p) for p in paths]


def tokenizer_file(name: str) -> Path:
    if name not in TOKENIZERS:
        raise DataError(f"unknown builtin tokenizer 'builtin:{name}': use one of "
                        + ", ".join(f"builtin:{t}" for t in TOKENIZERS))
    path = TOKENIZERS[name]
    if not path.exists():
        raise DataError(f"builtin tokenizer file {path} is missing: rebuild it with "
                        "`python -m data_pipeline.tokenizer`")
    return path
