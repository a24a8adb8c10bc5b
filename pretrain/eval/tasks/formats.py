"""Downstream task instances and their metrics, as lm-evaluation-harness defines them.

Three formats, each a set of (context, continuation) requests scored by log-likelihood:
- multiple choice: one context, a continuation per choice (" " + choice); acc = the choice with the
  highest log-likelihood, acc_norm = the highest per character of the choice (lm-eval's length
  normalisation), bpb = the gold continuation's bits per UTF-8 byte (OLMo's), prob = the gold's
  share of the choices' probabilities;
- schema (Winogrande): a context per choice (the sentence up to the blank, filled in), one
  continuation (the rest of the sentence); the same metrics, acc_norm dividing by the contexts'
  lengths as lm-eval does;
- cloze (LAMBADA): one context, the final word as the continuation: acc = the word is what greedy
  decoding gives, and its loss (nats) and bpb.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

FORMATS = ("multiple_choice", "schema", "cloze")


@dataclasses.dataclass
class Instance:
    format: str  # one of FORMATS
    contexts: list[str]  # one, or one per choice (schema)
    continuations: list[str]  # one per choice (multiple choice), or one (schema, cloze)
    gold: int  # index of the right choice (0 for cloze)
    choices: list[str]  # what acc_norm divides by: the choice texts (schema: the contexts)
    id: str = ""

    def requests(self) -> list[tuple[str, str]]:
        """(context, continuation) pairs, in choice order."""
        if len(self.contexts) == 1:
            return [(self.contexts[0], c) for c in self.continuations]
        return [(c, self.continuations[0]) for c in self.contexts]

    def with_prefix(self, prefix: str) -> "Instance":
        """The same instance after few-shot examples (`prefix`, ending in the delimiter)."""
        return dataclasses.replace(self, contexts=[prefix + c for c in self.contexts])

    def demonstration(self) -> str:
        """This instance answered, as a few-shot example: its gold context and continuation."""
        ctx, cont = self.requests()[self.gold]
        return ctx + cont


def metrics(inst: Instance, lls: list[float], greedy: list[bool]) -> dict:
    """Per-instance metrics from each request's log-likelihood (nats) and whether greedy decoding
    gives its continuation."""
    gold_cont = inst.requests()[inst.gold][1]
    gold_bytes = len(gold_cont.encode("utf-8"))
    bpb = -lls[inst.gold] / (math.log(2) * gold_bytes) if gold_bytes else float("nan")
    if inst.format == "cloze":
        return {"acc": float(greedy[0]), "loss": -lls[0], "bpb": bpb}
    # numpy, as lm-eval computes them: the first of equals wins, and an empty choice's ll / 0 is -inf
    # (never chosen; nan, which argmax picks, if its ll is exactly 0).
    ll = np.array(lls, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        norm = ll / np.array([float(len(c)) for c in inst.choices])
    pred, pred_norm = int(np.argmax(ll)), int(np.argmax(norm))
    top = max(lls)
    probs = [math.exp(ll - top) for ll in lls]
    return {"acc": float(pred == inst.gold), "acc_norm": float(pred_norm == inst.gold), "bpb": bpb,
            "prob": probs[inst.gold] / sum(probs)}
