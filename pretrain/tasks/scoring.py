"""Scoring tasks with a model: the log-likelihood of each request's continuation, tokenised and
truncated as lm-evaluation-harness's HFLM does, so that the numbers are its numbers.

A request (context, continuation): trailing spaces of the context move to the continuation; the
context is encoded alone and the two together, and the continuation's tokens are the whole's past
the context's (an empty context is the end-of-text token). The input is the last max_len + 1 tokens
less the final one; the continuation's log-likelihood is the sum of its tokens' log-probabilities,
and it is greedy when every one of them is the most likely token.

Instances are split across ranks (instance i on rank i % world); every rank runs the same number of
forwards (a rank out of instances repeats one and drops it), since a ZeRO-3 model's forward is
collective. An instance's requests go through the model as one batch: the choices that share a
context are scored together. The per-instance results are gathered, so the task's means are the
same at any world size.
"""

from __future__ import annotations

import random

import torch

from pretrain.tasks import loaders
from pretrain.tasks.formats import Instance, metrics

FEWSHOT_DELIMITER = "\n\n"  # between few-shot examples and before the instance, as lm-eval's default


def encode_pair(tokenizer, eot: int, context: str, continuation: str) -> tuple[list[int], list[int]]:
    if not context:
        return [eot], tokenizer.encode(continuation).ids
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation).ids
    context_ids = tokenizer.encode(context).ids
    return context_ids, whole[len(context_ids):]


@torch.no_grad()
def loglikelihoods(logits_fn, tokenizer, eot: int, requests: list[tuple[str, str]], max_len: int,
                   device) -> list[tuple[float, bool]]:
    """[(log-likelihood in nats, greedy)] of each request, the requests in one batch.
    `logits_fn(tokens (B, T) int64) -> logits (B, T, V)`."""
    rows, spans = [], []
    for context, continuation in requests:
        ctx, cont = encode_pair(tokenizer, eot, context, continuation)
        if not cont:
            raise ValueError(f"continuation {continuation!r} encodes to no tokens")
        inp = (ctx + cont)[-(max_len + 1):][:-1]
        rows.append(inp)
        spans.append((len(inp) - len(cont), cont))
    width = max(map(len, rows))
    batch = torch.tensor([r + [eot] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    logits = logits_fn(batch)
    out = []
    for b, (start, cont) in enumerate(spans):
        logp = torch.log_softmax(logits[b, start:start + len(cont)].float(), dim=-1)  # (n, V)
        target = torch.tensor(cont, device=logp.device)
        ll = logp.gather(1, target[:, None]).sum().item()
        out.append((ll, bool((logp.argmax(-1) == target).all())))
    return out


def fewshot_prefix(inst_index: int, task: str, pool: list[Instance], k: int, seed: int,
                   exclude: Instance | None) -> str:
    """k examples drawn for instance `inst_index` alone (the same at any world size), never itself."""
    if not k:
        return ""
    rnd = random.Random(f"{seed}:{task}:{inst_index}")
    demos = rnd.sample([p for p in pool if p is not exclude], k)
    return "".join(d.demonstration() + FEWSHOT_DELIMITER for d in demos)


class TaskSuite:
    """Tasks loaded once (a bad spec fails here, before any model is built or loaded), scored on
    each call."""

    def __init__(self, specs: list[str], limit: int = 0, fewshot: int = 0, seed: int = 1234):
        self.fewshot, self.seed = fewshot, seed
        self.tasks = [(loaders.task_name(s), *loaders.load(s, limit, fewshot)) for s in specs]
        names = [t for t, _, _ in self.tasks]
        if len(set(names)) < len(names):
            from pretrain.errors import UserError

            raise UserError(f"tasks {', '.join(specs)}: two of them have the same name")

    def __call__(self, logits_fn, device, rank: int = 0, world: int = 1, gather=None, *, tokenizer, eot: int,
                 max_len: int) -> dict:
        """{task: {"metrics": {name: mean}, "n", "format", "instances": [per instance]}}, the same on
        every rank. `gather(obj) -> [obj of each rank]` for world > 1."""
        results = {}
        for task, instances, pool in self.tasks:
            mine = []
            for turn in range(-(-len(instances) // world)):  # every rank the same number of forwards
                i = turn * world + rank
                inst = instances[min(i, len(instances) - 1)]
                prefix = fewshot_prefix(i, task, pool, self.fewshot, self.seed, exclude=inst)
                shown = inst.with_prefix(prefix) if prefix else inst
                scored = loglikelihoods(logits_fn, tokenizer, eot, shown.requests(), max_len, device)
                if i < len(instances):
                    lls, greedy = [s[0] for s in scored], [s[1] for s in scored]
                    mine.append({"index": i, "id": inst.id, "lls": lls, "greedy": greedy, **metrics(inst, lls, greedy)})
            every = [r for part in (gather(mine) if world > 1 else [mine]) for r in part]
            every.sort(key=lambda r: r["index"])
            # (a file of your own may mix formats: each metric is the mean over the instances that have it)
            names = list(dict.fromkeys(k for r in every for k in r if k not in ("index", "id", "lls", "greedy")))
            means = {k: sum(r[k] for r in every if k in r) / sum(k in r for r in every) for k in names}
            formats = sorted({i.format for i in instances})
            results[task] = {"metrics": means, "n": len(every), "format": "+".join(formats), "instances": every}
        return results
