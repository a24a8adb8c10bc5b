"""Streaming data for pretraining: tokenizers, sources, packed sequences with exact resume at any world size.

The loader names are imported lazily: `pretrain.config` imports `data_pipeline.config`, and that must
not pull in torch.
"""

import importlib

from data_pipeline.config import DataConfig, SourceConfig, source_names
from data_pipeline.errors import DataError
from data_pipeline.prepare import prepare  # binds the function over the submodule of the same name
from data_pipeline.sources import resolve_source
from data_pipeline.tokenizer import eot_id, load_tokenizer, padded_vocab_size, tokenizer_fingerprint, train_tokenizer

_LAZY = ("TokenLoader", "build_loader", "build_validation_batches", "evaluation_windows", "merge_states")
_DOCUMENTS = ("document_ids", "document_inputs", "document_positions", "sequence_shard")
__all__ = ["DataConfig", "SourceConfig", "source_names", "DataError", "prepare", "resolve_source", "eot_id", "load_tokenizer",
           "padded_vocab_size", "tokenizer_fingerprint", "train_tokenizer", *_LAZY, *_DOCUMENTS]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module("data_pipeline.loader"), name)
    if name in _DOCUMENTS:
        return getattr(importlib.import_module("data_pipeline.documents"), name)
    raise AttributeError(f"module 'data_pipeline' has no attribute {name!r}")
