"""The data section of the run config: sources, tokenizer, packing and loading knobs."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

# The local files a source reads, by extension (data_pipeline/sources.py opens them).
EXT_KINDS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
             ".ndjson": "json", ".parquet": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")


@dataclass
class SourceConfig:
    path: str = ""  # hub dataset name, local file/glob/dir, "builtin:python-docs", or a `prepare`d dir
    kind: str = "auto"  # auto | hub | text | json | parquet | prepared | builtin
    name: str = ""  # hub dataset config name ("" = default)
    split: str = "train"  # dataset split: a hub split; builtin and local files: train | validation
    holdout: float = 0.0  # local files: share of documents held out as split "validation" (train skips them)
    text_field: str = "text"  # column holding the document text (json/parquet/hub)
    sample_by: str = "paragraph"  # plain-text files: one document per line | paragraph | document
    weight: float = 1.0  # mixture weight: share of training sequences (tokens) drawn from this source
    label: str = ""  # its name in the metrics (data/tokens/LABEL; "" = from the path)


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=lambda: [SourceConfig(path="builtin:python-docs")])
    validation: list[SourceConfig] = field(default_factory=list)  # held-out sources (empty = none)
    tokenizer: str = "builtin:python-docs-bpe"  # tokenizer.json path, hub name, or builtin:NAME
    eot_token: str = ""  # end-of-text token appended to every document ("" = find it in the vocab)
    seq_len: int = 256  # tokens per training sequence (windows of seq_len + 1 give inputs and labels)
    num_streams: int = 8  # independent data streams; the world size must divide it; fixed for a run
    num_workers: int = 1  # DataLoader worker processes per rank that tokenize (0 = in the main process)
    shuffle_blocks: int = 64  # windows per shuffle block within a stream (1 = no window shuffle)
    shuffle_shards: bool = True  # permute the shard order of every epoch (seeded)
    seed: int = 1234  # data order seed (independent of the model init seed)
    force_resume: bool = False  # resume even if the sources or tokenizer fingerprint changed

    def problems(self) -> list[str]:
        out = []
        if not self.sources:
            out.append("data.sources is empty: name at least one source (path: ...)")
        for i, src in enumerate(self.sources + self.validation):
            if not src.path:
                out.append(f"data source #{i} has no path: set path to a hub name or local file")
            if not (math.isfinite(src.weight) and src.weight > 0):  # (NaN passes `<= 0`)
                out.append(f"data source {src.path!r} has weight {src.weight}: weights must be > 0")
            if not 0 <= src.holdout < 1:
                out.append(f"data source {src.path!r} has holdout={src.holdout}: a share in [0, 1)")
        # Held-out documents must not be trained on: a validation source with `holdout` needs its
        # training source (the same path) to skip the same documents.
        train = {s.path: s for s in self.sources}
        for v in self.validation:
            t = train.get(v.path)
            if v.holdout and t is not None and (t.holdout != v.holdout or t.split != "train"):
                out.append(f"data source {v.path!r} is held out with holdout={v.holdout} for validation, but "
                           f"its training source has holdout={t.holdout}: set the same holdout on both, or the "
                           "held-out documents are trained on")
        if self.seq_len <= 0:
            out.append(f"data.seq_len={self.seq_len} must be positive")
        if self.num_streams <= 0 or self.shuffle_blocks <= 0 or self.num_workers < 0:
            out.append("data.num_streams and data.shuffle_blocks must be >= 1, data.num_workers >= 0")
        return out


def source_names(sources: list[SourceConfig]) -> list[str]:
    """A short, unique name per source for metrics (`data/tokens/NAME`): its `label`, else from its
    path: builtin:python-docs -> python-docs, org/name -> name, data/web/*.jsonl.gz -> web."""
    names = []
    for src in sources:
        name = src.label
        if not name:
            parts = [p for p in src.path.removeprefix("builtin:").replace("\\", "/").split("/")
                     if p and not any(c in p for c in "*?[")]
            name = parts[-1] if parts else "source"
            while os.path.splitext(name)[1].lower() in {*EXT_KINDS, *COMPRESSIONS}:
                name = os.path.splitext(name)[0]
        name = re.sub(r"[^\w.-]", "_", name) or "source"
        names.append(name if name not in names else f"{name}-{len(names)}")
    return names
