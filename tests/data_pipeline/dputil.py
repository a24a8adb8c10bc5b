"""Helpers for the data_pipeline tests: small corpora, configs, and reading windows back from batches."""

import json
import random
from pathlib import Path

import pytest
import torch

from data_pipeline.config import DataConfig, SourceConfig

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
WORDS = ("the of and to in is was for that with as on by at from this are be or an it which class "
         "function value return object module type method list string error import file name").split()


def shared_file(name: str) -> Path:
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"{path} is not here")
    return path


def make_docs(n: int, seed: int, tag: str = "") -> list[str]:
    rng = random.Random(seed)
    return [f"{tag}{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for i in range(n)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def data_cfg(*paths, **kw) -> DataConfig:
    sources = [p if isinstance(p, SourceConfig) else SourceConfig(path=str(p)) for p in paths]
    kw = {"tokenizer": "builtin:python-docs-bpe", "seq_len": 16, "num_streams": 4, "num_workers": 0,
          "shuffle_blocks": 4, **kw}
    return DataConfig(sources=sources, **kw)


def take(loader, n: int, it=None) -> list[dict]:
    it = it if it is not None else iter(loader)
    return [next(it) for _ in range(n)]


def windows(batches: list[dict]) -> torch.Tensor:
    """(N, T+1) windows back from micro-batches."""
    return torch.cat([torch.cat([b["input_ids"], b["labels"][:, -1:]], dim=1) for b in batches])


def by_global_index(batches: list[dict], rank: int, world: int, start: int = 0) -> dict[int, tuple]:
    """{g: window} for a rank's batches whose first sequence is its local sequence `start`."""
    return {rank + world * (start + m): tuple(w.tolist()) for m, w in enumerate(windows(batches))}


def doc_tokens(tok, docs: list[str], eot: int = 0) -> list[int]:
    """The documents' tokens, each followed by the end-of-text token, concatenated."""
    out = []
    for d in docs:
        out += tok.encode(d, add_special_tokens=False).ids + [eot]
    return out


def run_ranks(cfg, tok, world: int, global_batch: int, n_global: int, state=None):
    """Every rank of a `world`-sized run takes n_global micro-batches of global_batch/world sequences
    (one global batch each). Returns ({g: window}, merged state)."""
    from data_pipeline import build_loader, merge_states

    out, loaders = {}, []
    for r in range(world):
        loader = build_loader(cfg, tok, r, world, global_batch // world)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))  # as saved to disk
        start = loader.sequences_consumed // world
        got = by_global_index(take(loader, n_global), r, world, start)
        assert not set(got) & set(out)
        out.update(got)
        loaders.append(loader)
    return out, merge_states([ld.state_dict() for ld in reversed(loaders)])
