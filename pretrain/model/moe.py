"""Mixture-of-Experts feed-forward (model.moe_experts > 0): a router sends each token to k of E
SwiGLU experts, with no token dropped (no capacity), plus shared experts that see every token.

- The router runs in fp32: scores = softmax or sigmoid of x W_r^T; the top k are chosen from the
  scores plus `expert_bias` (DeepSeek-V3's auxiliary-loss-free balancing: the bias only selects,
  the weights are the unbiased scores, renormalised over the k when model.moe_norm_topk).
- The experts are stacked tensors, w1 and w3 (E, H, D), w2 (E, D, H) (`Experts`), run as one grouped matmul
  over the tokens sorted by expert where the kernel exists (torch._grouped_mm on CUDA), else a loop
  over the experts with tokens: the FLOPs follow the tokens routed, not E.
- The load-balancing loss (Switch/GShard: E * sum_i f_i P_i, f_i the share of tokens routed to
  expert i, P_i its mean router probability) and the router z-loss (ST-MoE: mean logsumexp^2),
  times their coefficients (`aux_loss`), are added to the training loss by the model. f_i counts
  over the global batch when the parallel wing sets `reduce_counts` (an all-reduce over the data-
  and sequence-parallel ranks); the model itself calls no collective.

Written here rather than taken from DeepSpeed's `deepspeed.moe` (refused at ZeRO-3, pads experts to
a capacity) or its AutoEP (which replaces the module and refuses aux-loss-free balancing): this is
the model, torch only, and transformers' Mixtral sparse block is its reference in the tests.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.model.args import ModelArgs
from pretrain.model.feedforward import gated


def grouped_mm_available(x: torch.Tensor) -> bool:
    """torch._grouped_mm's kernel is CUDA's, in bf16, on Hopper and later (compute capability 9.0):
    on CPU its fp32 backward fails ("Invalid strides/sizes", torch 2.13), so CPUs and older GPUs take
    the loop. (Not run here: no GPU; its forward equals the loop's on CPU, tests/model/test_moe.py.)"""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class Router(nn.Linear):
    """The router's logits in fp32, whatever the weights' dtype (a module called, so that ZeRO-3
    gathers its weight), with a learned bias where the model has one (model.moe_router_bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())


class Experts(nn.Module):
    """E gated experts as stacked tensors: w1, w3 (E, H, D), w2 (E, D, H), and with `bias` b1, b3
    (E, H), b2 (E, D) (GPT-OSS's). `glu`: feedforward.gated's (gate, up) -> output. A module of its
    own, as nn.Linear is, so that ZeRO-3 gathers its weights for its forward (under compile too)."""

    def __init__(self, experts: int, dim: int, hidden: int, glu: Callable = gated("silu"), bias: bool = False):
        super().__init__()
        self.glu = glu  # the gate's (model.ffn_activation)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.b1, self.b2, self.b3 = ((nn.Parameter(torch.zeros(experts, hidden)), nn.Parameter(torch.zeros(experts, dim)),
                                      nn.Parameter(torch.zeros(experts, hidden))) if bias else (None, None, None))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's unit over its rows: x (n, D) sorted by expert, `counts` (E,) rows each."""
        if grouped_mm_available(x):
            offsets = counts.cumsum(0).to(torch.int32)
            gate = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets)
            up = torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
            if self.b1 is not None:  # each row its expert's bias
                expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
                gate, up = gate + self.b1[expert], up + self.b3[expert]
            out = torch._grouped_mm(self.glu(gate, up), self.w2.transpose(-2, -1), offs=offsets)
            return out if self.b2 is None else out + self.b2[expert]
        sizes = counts.tolist()
        # The experts without rows are skipped, unless no expert has any (under expert parallelism, a
        # rank whose experts got no token): then the first runs over the empty rows, so that the
        # output still depends on the rows and on the weights. Autograd then runs the backward of the
        # all-to-all that brought the rows (the other ranks wait in it), and the weights get their
        # (zero) gradient, which every rank's ZeRO reduces alike.
        busy = [e for e, n in enumerate(sizes) if n] or [0]
        parts = x.split(sizes)
        return torch.cat([self._unit(parts[e], e) for e in busy])

    def _unit(self, x: torch.Tensor, e: int) -> torch.Tensor:
        b1, b2, b3 = (None, None, None) if self.b1 is None else (self.b1[e], self.b2[e], self.b3[e])
        return F.linear(self.glu(F.linear(x, self.w1[e], b1), F.linear(x, self.w3[e], b3)), self.w2[e], b2)


class MoE(nn.Module):
    """`shared`: the shared experts' SwiGLU (moe_shared_experts x the expert width, one module), or None."""

    def __init__(self, args: ModelArgs, shared: nn.Module | None = None):
        super().__init__()
        E, H, D = args.moe_experts, args.moe_expert_hidden_dim, args.dim
        self.num_experts, self.top_k = E, args.moe_top_k
        self.sigmoid, self.norm_topk = args.moe_router == "sigmoid", args.moe_norm_topk
        self.aux_coef, self.z_coef = args.moe_aux_loss, args.moe_z_loss
        self.router = Router(D, E, bias=args.moe_router_bias)
        self.experts = Experts(E, D, H, gated(args.ffn_activation, args.swiglu_limit, args.swiglu_alpha),
                               bias=args.moe_expert_bias)
        self.shared = shared
        # Selection only (model.moe_bias_rate); fp32, in checkpoints (a resume selects as before).
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32))
        self.reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by the parallel wing
        # Under expert parallelism (set by the parallel wing): `experts` holds this rank's share of
        # the experts, and exchange(rows sorted by expert, rows per expert (E,), experts) runs them
        # wherever they live and returns the rows' outputs in the same order.
        self.exchange: Callable[[torch.Tensor, torch.Tensor, nn.Module], torch.Tensor] | None = None
        self.routed: dict[str, torch.Tensor] = {}  # the last forward's routing (see _keep)
        self.stats: dict[str, torch.Tensor] = {}  # the last aux_loss's counts and losses (detached)

    def _apply(self, fn, recurse=True):
        # A cast of the model (engine.bfloat16(), zero.Init's constructors) keeps the bias fp32.
        super()._apply(fn, recurse)
        if self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> the router's fp32 logits and scores (N, E), the chosen experts (N, k) and their
        weights (N, k, fp32)."""
        logits = self.router(x)
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        chosen = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.norm_topk:  # (at k = 1 the weight is 1, as in Mixtral; Switch keeps the probability: false)
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
        return logits, scores, chosen, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        logits, scores, chosen, weights = self.route(x)
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts)  # (E,) int64
        order = chosen.flatten().argsort(stable=True)  # token copies sorted by expert
        token = order // self.top_k
        rows = x[token]
        out = self.experts(rows, counts) if self.exchange is None else self.exchange(rows, counts, self.experts)
        out = out * weights.flatten()[order, None].to(x.dtype)
        y = torch.zeros_like(x).index_add_(0, token, out)
        if self.shared is not None:
            y = y + self.shared(x)
        self._keep(logits, scores, counts)
        return y.view(shape)

    def _keep(self, logits: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor) -> None:
        """What the losses need from this forward, in `routed`: the mean router probabilities and
        the z-loss (differentiable), the tokens per expert and the tokens (this rank's)."""
        # (DeepSeek-V3's balancing loss normalises the sigmoid scores per token)
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.sigmoid else scores
        with torch.no_grad():
            entropy = -(probs * probs.clamp(min=1e-20).log()).sum(dim=-1).mean()
        self.routed = {"probs": probs.mean(dim=0), "z": torch.logsumexp(logits, dim=-1).square().mean(),
                       "counts": counts, "tokens": logits.new_tensor(float(logits.size(0))), "entropy": entropy}

    def aux_loss(self) -> torch.Tensor:
        """The last forward's balancing loss E * sum_i f_i P_i (f_i: the share of tokens routed to
        expert i, over the ranks `reduce_counts` sums; P_i: the mean probability here) and z-loss,
        times their coefficients. Called once per forward, after the block (never inside its
        recomputation under activation checkpointing), so the collective runs once. Sets `stats`."""
        r = self.routed
        counts, tokens = r["counts"].float(), r["tokens"]
        if self.reduce_counts is not None:
            both = self.reduce_counts(torch.cat([counts, tokens[None]]))
            counts, tokens = both[:-1], both[-1]
        balance = self.num_experts * (counts / tokens * r["probs"]).sum()
        aux = self.aux_coef * balance + self.z_coef * r["z"]
        self.stats = {"counts": counts.detach(), "balance_loss": balance.detach(), "z_loss": r["z"].detach(),
                      "entropy": r["entropy"], "aux": aux.detach()}
        return aux

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's update after an optimizer step: each expert's bias moves by `rate` towards
        the mean load (up when it got fewer tokens than the mean, down when more). `counts` are the
        step's tokens per expert over the whole batch (the same on every rank, so the bias is)."""
        counts = counts.float().to(self.expert_bias.device)
        self.expert_bias += rate * torch.sign(counts.mean() - counts)

    def init_weights(self, std: float, out_std: float, router_std: float) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=router_std)
        for b in (self.router.bias, self.experts.b1, self.experts.b2, self.experts.b3):
            if b is not None:
                nn.init.zeros_(b)
        nn.init.normal_(self.experts.w1, mean=0.0, std=std)
        nn.init.normal_(self.experts.w3, mean=0.0, std=std)
        nn.init.normal_(self.experts.w2, mean=0.0, std=out_std)
        if self.shared is not None:
            self.shared.init_weights(std, out_std)
        self.expert_bias.zero_()


class RoutingStats:
    """The routing of a model's MoE blocks over training: each step's tokens per expert (for the
    bias update, model.moe_bias_rate) and each logging window's (for the moe/ metrics). Read after
    every training forward (`micro_batch`), closed at every optimizer step (`step_done`)."""

    def __init__(self, model: nn.Module, bias_rate: float):
        self.blocks = [i for i, block in enumerate(model.layers) if isinstance(block.feed_forward, MoE)]
        self.layers = [model.layers[i].feed_forward for i in self.blocks]
        self.bias_rate = bias_rate
        self.step_counts = self.window_counts = None  # (MoE blocks, E)
        self.sums: torch.Tensor | None = None  # per block: balance loss, z-loss, entropy summed over forwards
        self.forwards = 0

    def micro_batch(self) -> torch.Tensor:
        """After a training forward: keep its routing; its aux losses (coefficients applied, summed
        over the blocks, detached), which the trainer leaves out of train/loss."""
        stats = [layer.stats for layer in self.layers]
        counts = torch.stack([s["counts"] for s in stats])
        sums = torch.stack([torch.stack([s["balance_loss"], s["z_loss"], s["entropy"]]) for s in stats])
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts
        self.sums = sums if self.sums is None else self.sums + sums
        self.forwards += 1
        return sum(s["aux"] for s in stats)

    def step_done(self, applied: bool) -> None:
        """The step's update was applied (or dropped: then the bias stays too)."""
        if self.step_counts is None:
            return
        if applied and self.bias_rate:
            for layer, counts in zip(self.layers, self.step_counts):
                layer.update_bias(counts, self.bias_rate)
        self.window_counts = self.step_counts if self.window_counts is None else self.window_counts + self.step_counts
        self.step_counts = None

    def reset(self) -> None:
        """The run went back to a checkpoint (a decay branch's end, a rollback): the steps since are
        not the run's."""
        self.step_counts = self.window_counts = self.sums = None
        self.forwards = 0

    def metrics(self) -> dict:
        """The window's moe/ metrics (one host sync), then a new window: the max-over-mean load of
        each block's experts (1 = balanced) and their max, the losses and router entropy averaged
        over blocks and forwards, the bias's range."""
        if self.window_counts is None:
            return {}
        load = (self.window_counts.max(dim=1).values / self.window_counts.float().mean(dim=1).clamp(min=1e-9)).tolist()
        balance, z, entropy = (self.sums.mean(dim=0) / self.forwards).tolist()
        out = {"moe/max_load": max(load), "moe/balance_loss": balance, "moe/z_loss": z, "moe/router_entropy": entropy,
               **{f"moe/max_load/block_{i}": v for i, v in zip(self.blocks, load)}}
        if self.bias_rate:
            out["moe/bias_range"] = max((layer.expert_bias.max() - layer.expert_bias.min()).item()
                                        for layer in self.layers)
        self.reset()
        return out
