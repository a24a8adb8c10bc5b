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

import logging
import random

import torch

from pretrain.errors import UserError
from pretrain.eval.tasks import loaders
from pretrain.eval.tasks.formats import Instance, metrics

log = logging.getLogger(__name__)

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


def encode_request(tokenizer, eot: int, context: str, continuation: str, max_len: int):
    """(context tokens, continuation tokens) of a request the model can score; a continuation of no
    tokens, or of more than the model's context, is one line (UserError)."""
    ctx, cont = encode_pair(tokenizer, eot, context, continuation)
    if not cont:
        raise UserError(f"the continuation {continuation!r} encodes to no tokens: give each choice or continuation text")
    if len(cont) > max_len:
        raise UserError(f"the continuation {continuation[:40]!r}... is {len(cont)} tokens, more than the model's "
                        f"context of {max_len}: shorten it (only its context is cut from the left)")
    return ctx, cont


@torch.no_grad()
def loglikelihoods(logits_fn, tokenizer, eot: int, requests: list[tuple[str, str]], max_len: int,
                   device) -> list[tuple[float, bool, bool]]:
    """[(log-likelihood in nats, greedy, truncated)] of each request, the requests in one batch;
    truncated: its context was cut from the left to fit max_len, as lm-eval's HFLM cuts it.
    `logits_fn(tokens (B, T) int64) -> logits (B, T, V)`."""
    rows, spans, truncated = [], [], []
    for context, continuation in requests:
        ctx, cont = encode_request(tokenizer, eot, context, continuation, max_len)
        inp = (ctx + cont)[-(max_len + 1):][:-1]
        rows.append(inp)
        spans.append((len(inp) - len(cont), cont))
        truncated.append(len(ctx) + len(cont) > max_len + 1)
    width = max(map(len, rows))
    batch = torch.tensor([r + [eot] * (width - len(r)) for r in rows], dtype=torch.long, device=device)
    logits = logits_fn(batch)
    out = []
    for b, (start, cont) in enumerate(spans):
        logp = torch.log_softmax(logits[b, start:start + len(cont)].float(), dim=-1)  # (n, V)
        target = torch.tensor(cont, device=logp.device)
        ll = logp.gather(1, target[:, None]).sum().item()
        out.append((ll, bool((logp.argmax(-1) == target).all()), truncated[b]))
    return out


def fewshot_prefix(inst_index: int, task: str, pool: list[Instance], k: int, seed: int,
                   exclude: Instance | None) -> str:
    """k examples drawn for instance `inst_index` alone (the same at any world size), never itself
    (`exclude`: the scored instance, the same object when the pool is its own split)."""
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
        self.tasks, self.pools = [], {}
        for spec in specs:
            instances, pool, where = loaders.load(spec, limit, fewshot)
            self.tasks.append((loaders.task_name(spec), instances, pool))
            self.pools[loaders.task_name(spec)] = where
            if fewshot:
                log.info("%s: %d-shot examples from %s", loaders.task_name(spec), fewshot, where)
        names = [t for t, _, _ in self.tasks]
        if len(set(names)) < len(names):
            raise UserError(f"tasks {', '.join(specs)}: two of them have the same name")
        self.checked_len = None

    def check(self, tokenizer, eot: int, max_len: int, progress=None) -> None:
        """Every request scorable (UserError naming the first that is not): run on every rank over
        every instance before any forward, so a bad one stops all ranks alike. `progress()` is
        called as it goes (thousands of instances take seconds: the hang watchdog sees them)."""
        if self.checked_len == max_len:
            return
        for task, instances, _ in self.tasks:
            for n, inst in enumerate(instances):
                if progress is not None and n % 64 == 0:
                    progress()
                for context, continuation in inst.requests():
                    try:
                        encode_request(tokenizer, eot, context, continuation, max_len)
                    except UserError as e:
                        raise UserError(f"task {task}, instance {inst.id}: {e}") from None
        self.checked_len = max_len

    def __call__(self, logits_fn, device, rank: int = 0, world: int = 1, gather=None, progress=None, *, tokenizer,
                 eot: int, max_len: int) -> dict:
        """{task: {"metrics": {name: mean}, "n", "format", "instances": [per instance]}}, the same on
        every rank. `gather(obj) -> [obj of each rank]` for world > 1; `progress()` is called while the
        requests are checked (each forward of `logits_fn` is progress of its own)."""
        self.check(tokenizer, eot, max_len, progress)
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
                    mine.append({"index": i, "id": inst.id, "lls": lls, "greedy": greedy,
                                 "truncated": any(s[2] for s in scored), **metrics(inst, lls, greedy)})
            every = [r for part in (gather(mine) if world > 1 else [mine]) for r in part]
            every.sort(key=lambda r: r["index"])
            # (a file of your own may mix formats: each metric is the mean over the instances that have it)
            names = list(dict.fromkeys(k for r in every for k in r
                                       if k not in ("index", "id", "lls", "greedy", "truncated")))
            means = {k: sum(r[k] for r in every if k in r) / sum(k in r for r in every) for k in names}
            formats = sorted({i.format for i in instances})
            cut = sum(r["truncated"] for r in every)
            if cut and rank == 0:
                log.warning("warning: %s: %d of %d instance(s) are longer than the model's context of %d tokens: "
                            "their contexts were cut from the left (as lm-eval cuts them)", task, cut, len(every), max_len)
            results[task] = {"metrics": means, "n": len(every), "format": "+".join(formats), "truncated": cut,
                             "fewshot_from": self.pools[task], "instances": every}
        return results
