"""The documents inside a packed sequence, and a sequence's share for one rank of a sequence-parallel
group.

Packing joins documents with the end-of-text token (eot) between them. For document masking the
separator opens the next document, as a beginning-of-sequence token would: a document's first token
is predicted from the separator alone, and its last token predicts the separator. Token i belongs to
document `document_ids[i]` = the number of separators at positions <= i, so a packed sequence scores,
token for token, like each of its documents run alone after an eot (the first one, begun in an
earlier window, like its visible part run alone).
"""

from __future__ import annotations

import torch


def document_ids(input_ids: torch.Tensor, eot: int) -> torch.Tensor:
    """(B, T) token ids -> (B, T) int64: each token's document within its row, from 0."""
    return (input_ids == eot).cumsum(dim=-1)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) document ids -> (B, T) int64 positions that restart at 0 at each document's first token."""
    T = documents.size(-1)
    index = torch.arange(T, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values  # each token's document start
    return index - first


def document_inputs(input_ids: torch.Tensor, eot: int | None, restart_positions: bool = False) -> dict:
    """The model's document arguments for whole sequences (B, T): none without document masking (eot
    None); else "documents", and with `restart_positions` "positions" that restart at each document."""
    if eot is None:
        return {}
    documents = document_ids(input_ids, eot)
    return {"documents": documents, **({"positions": document_positions(documents)} if restart_positions else {})}


def sequence_shard(batch: dict, rank: int, size: int, eot: int | None = None,
                   restart_positions: bool = False) -> dict:
    """Rank `rank`'s share of a micro-batch of whole sequences for a sequence-parallel group of `size`
    ranks (Ulysses): every rank of the group reads the same sequences and keeps the contiguous T/size
    tokens [rank * T/size, (rank + 1) * T/size) of each.

    Returns {"input_ids", "labels"}: (B, T/size) slices; "positions": (B, T/size) the slice's
    positions in the whole sequence (restarted per document with `restart_positions`), so RoPE rotates
    by where a token is, not where it sits in the slice; "label_count": the scored labels (not -100)
    of the whole sequences per rank of the group, what each rank divides its summed loss by, so that
    the group's losses average to the mean over all its tokens (not a mean of the ranks' means,
    which differ where ranks score different numbers of labels); with `eot` (document masking) also
    "documents": (B, T) the document ids of the whole sequences, since every rank attends over the
    whole sequence for its heads.
    """
    inputs, labels = batch["input_ids"], batch["labels"]
    B, T = inputs.shape
    if T % size:
        raise ValueError(f"sequence length {T} is not divisible by the sequence-parallel size {size}")
    n = T // size
    part = slice(rank * n, (rank + 1) * n)
    if restart_positions and eot is None:
        raise ValueError("positions restarted per document need the document separator (eot)")
    whole = document_inputs(inputs, eot, restart_positions)
    documents = whole.get("documents")
    if restart_positions:
        positions = whole["positions"][:, part]
    else:
        positions = torch.arange(rank * n, (rank + 1) * n).expand(B, n)
    out = {"input_ids": inputs[:, part], "labels": labels[:, part], "positions": positions,
           "label_count": (labels != -100).sum().item() / size}
    if documents is not None:
        out["documents"] = documents
    return out
