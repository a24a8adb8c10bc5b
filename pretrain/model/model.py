"""A decoder-only transformer assembled from its per-layer description (pretrain/model/args.py):
by default Llama's (RMSNorm before each sublayer, RoPE, grouped-query attention, SwiGLU, no
biases); each block's attention kind (full or a sliding window), RoPE (or none), norm placement, q/k
norms, biases, sinks and gate activation follow ModelArgs. Attention, the feed-forward, the MoE,
the norm and RoPE live in their own modules; this one assembles the blocks, the embedding and the
head (with the loss, and the output z-loss), and counts parameters and FLOPs.

Build first, initialise second: `Transformer(args)` only allocates (with PyTorch's default init),
`init_weights()` sets the real values. That split lets ZeRO-3 build the model already partitioned
and initialise it one gathered group at a time, and lets the trainer skip init when it loads weights.

RoPE uses the rotate-half convention of Hugging Face Llama (each head's first half of dimensions
pairs with its second half), so HF conversion copies weights as they are; see docs/model.md.

Shape letters: B batch, T new tokens, S keys seen (past + new), H query heads, KV key/value heads,
hd head_dim, D dim, V vocab.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pretrain.model.args import ModelArgs
from pretrain.model.attention import Attention, KVCache, document_mask
from pretrain.model.feedforward import FeedForward, gated
from pretrain.model.moe import MoE
from pretrain.model.norm import RMSNorm, init_norms, optional_norm
from pretrain.model.rope import precompute_freqs_cis

Gather = Callable[[list[nn.Parameter]], ContextManager]


LOSS_CHUNK_BYTES = 1 << 28  # fp32 logits of one chunk of the loss: 256 MiB


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_loss: bool) -> torch.Tensor:
    """Summed cross-entropy of one chunk: h (n, D), labels (n,) -> scalar fp32 (labels of -100 are
    not scored); with `z_loss`, (2,): it and the sum of the scored tokens' logsumexp^2."""
    logits = F.linear(h, weight).float()  # (n, V)
    ce = F.cross_entropy(logits, labels, reduction="sum")
    if not z_loss:
        return ce
    return torch.stack([ce, (logits.logsumexp(dim=-1).square() * (labels != -100)).sum()])


class LMHead(nn.Linear):
    """The output projection. With labels, it returns the mean cross-entropy instead of logits,
    computed `chunk` tokens at a time: each chunk's logits are made, cast to fp32, reduced to a sum
    and dropped, and made again in backward (torch.utils.checkpoint), so the (B, T, V) logits and
    their fp32 copy never exist at once. With `z_loss` > 0 the loss adds z_loss x the mean of the
    scored tokens' logsumexp(logits)^2 (PaLM's output z-loss, OLMo 2's `z_loss_multiplier`), from the
    same chunks, and keeps that mean, detached, in `last_z_loss`. (A module of its own so that ZeRO-3
    gathers its weight for the loss as for the logits.)"""

    last_z_loss: torch.Tensor | None = None

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, chunk: int = 0,
                label_count: float = 0, z_loss: float = 0.0) -> torch.Tensor:
        """The loss is the sum over the scored labels (not -100) divided by `label_count`, by default
        their number here."""
        if labels is None:
            return super().forward(h)  # (B, T, V)
        h, labels = h.flatten(0, 1), labels.flatten()  # (N, D), (N,)
        n = labels.numel()
        divisor = label_count or (labels != -100).sum().clamp(min=1)  # (a device tensor: no host sync)
        chunk = chunk or max(128, LOSS_CHUNK_BYTES // (4 * self.out_features))
        if n <= chunk:  # one chunk: nothing to save by recomputing
            sums = _chunk_loss(h, self.weight, labels, bool(z_loss))
        else:
            sums = sum(checkpoint(_chunk_loss, h[i:i + chunk], self.weight, labels[i:i + chunk], bool(z_loss),
                                  use_reentrant=False) for i in range(0, n, chunk))
        if not z_loss:
            return sums / divisor
        ce, z = sums.unbind()
        self.last_z_loss = (z / divisor).detach()
        return (ce + z_loss * z) / divisor


class TransformerBlock(nn.Module):
    """Block `index`: attention then feed-forward, each a residual branch with its norms where
    model.norm_placement puts them: before the sublayer (pre, Llama: x + f(norm(x))), after it
    (post, OLMo 2: x + norm(f(x))) or both (sandwich, Gemma: x + norm(f(norm(x))))."""

    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        pre, post = args.norm_placement in ("pre", "sandwich"), args.norm_placement in ("post", "sandwich")
        self.attention_norm = optional_norm(pre, args.dim, args.norm_eps, args.norm_unit_offset)
        self.attention = Attention(args, index)
        self.attention_out_norm = optional_norm(post, args.dim, args.norm_eps, args.norm_unit_offset)
        self.ffn_norm = optional_norm(pre, args.dim, args.norm_eps, args.norm_unit_offset)
        glu = gated(args.ffn_activation, args.swiglu_limit, args.swiglu_alpha)
        if args.is_moe_layer(index):
            shared = args.moe_shared_experts * args.moe_expert_hidden_dim
            self.feed_forward = MoE(args, FeedForward(args.dim, shared, glu) if shared else None)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim, glu)
        self.ffn_out_norm = optional_norm(post, args.dim, args.norm_eps, args.norm_unit_offset)
        self.residual_scale = args.residual_scale  # completep: 1 / m_L on each branch

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor | None, cache_k: torch.Tensor | None = None,
                cache_v: torch.Tensor | None = None, start_pos: int = 0, mask=None) -> torch.Tensor:
        """x (B, T, D), freqs_cis (T or B x T, rd/2, 2; None: no RoPE in this block) -> (B, T, D).
        Tensors, None, ints and a BlockMask only, so that activation checkpointing can wrap the block."""
        a = self.attention_out_norm(self.attention(self.attention_norm(x), freqs_cis, cache_k, cache_v, start_pos,
                                                   mask))
        h = x + a if self.residual_scale == 1.0 else x + self.residual_scale * a
        f = self.ffn_out_norm(self.feed_forward(self.ffn_norm(h)))
        return h + f if self.residual_scale == 1.0 else h + self.residual_scale * f

    def init_weights(self, std: float, out_std: float, ffn_out_std: float, router_std: float) -> None:
        init_norms(self.attention_norm, self.attention_out_norm, self.ffn_norm, self.ffn_out_norm)
        self.attention.init_weights(std, out_std)
        if isinstance(self.feed_forward, MoE):
            self.feed_forward.init_weights(std, ffn_out_std, router_std)
        else:
            self.feed_forward.init_weights(std, ffn_out_std)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        problems = args.problems()
        if not args.vocab_size:
            problems.append("model.vocab_size=0: set it, or let the trainer fill it from the tokenizer")
        if args.document_mask and args.eot_id < 0:
            problems.append("model.document_mask=true needs model.eot_id (the trainer fills it from the tokenizer)")
        if problems:
            raise ValueError("; ".join(problems))
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_unit_offset)
        self.output = LMHead(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.logit_scale = args.logit_scale  # mup, completep: logits x 1/m
        # Non-persistent: derived from args, so checkpoints hold weights only. Local layers with a
        # RoPE base of their own (model.rope_local_theta) read a second table.
        self.register_buffer("freqs_cis", self.rope_table(), persistent=False)
        self.register_buffer("freqs_cis_local", self.rope_table(local=True) if args.local_rope_table else None,
                             persistent=False)

    def rope_table(self, device: torch.device | str | None = None, local: bool = False) -> torch.Tensor:
        """This model's RoPE table (or its local layers'), fp32: (max_seq_len, rotary_dim / 2, 2).
        Llama 3.1's or YaRN's scaling applies to the global layers only, as Gemma 3 and OLMo 3 scale
        their global ones, unless model.rope_local_scaling (GPT-OSS scales every layer)."""
        a = self.args
        theta = (a.rope_local_theta or a.rope_theta) if local else a.rope_theta
        scaling = a.rope_scaling if not local or a.rope_local_scaling else None
        return precompute_freqs_cis(a.rotary_dim, a.max_seq_len, theta, scaling).to(device)

    def reset_rope_table(self) -> None:
        """Rebuild the tables in fp32 on the device they are on. bf16 would round positions past 256
        to multiples of 8 and more; whoever builds the model under something that changes dtypes
        behind its back (deepspeed.zero.Init patches tensor constructors so that even an explicit
        float32 arange comes out bf16) calls this afterwards."""
        self.freqs_cis = self.rope_table(self.freqs_cis.device)
        if self.freqs_cis_local is not None:
            self.freqs_cis_local = self.rope_table(self.freqs_cis_local.device, local=True)

    def _apply(self, fn, recurse=True):
        # model.to(bf16) / .half() would round the RoPE tables too: rebuild them after any cast or move.
        super()._apply(fn, recurse)
        self.reset_rope_table()
        return self

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, cache: KVCache | None = None,
                start_pos: int = 0, loss_chunk: int = 0, positions: torch.Tensor | None = None,
                documents: torch.Tensor | None = None, label_count: float = 0) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, V) in the parameters' dtype; with labels (B, T), the
        mean cross-entropy (fp32 scalar) instead, `loss_chunk` tokens at a time (0 = as many as make
        256 MiB of fp32 logits; see LMHead), over the labels that are not -100 (or divided by
        `label_count`).

        With `cache`, the tokens sit at positions start_pos..start_pos+T-1 and attend to the cached
        past; without, they start at 0 (training), or at `positions` (B, T) where given.
        With model.document_mask, tokens attend within their document only: `documents` (B, T') are
        the document ids, and with model.document_positions `positions` restart at each document
        (both from data_pipeline.document_inputs(tokens, args.document_eot, args.document_positions),
        which the data path and every caller use; the model computes neither).
        Under sequence parallelism each rank passes its slice of the tokens with their `positions`,
        the whole sequences' `documents` (T' = the whole length) and the whole sequences' scored
        labels per rank as `label_count`, so that the group's losses average to its mean
        (data_pipeline.sequence_shard).
        """
        B, T = tokens.shape
        end = start_pos + T
        if end > self.args.max_seq_len:
            raise ValueError(f"positions up to {end} exceed model.max_seq_len={self.args.max_seq_len}")
        masks = {}  # window (0 = full) -> the document mask of the layers of that kind
        if self.args.document_mask and cache is None:
            if documents is None or (positions is None and self.args.document_positions):
                raise ValueError("model.document_mask needs the batch's `documents` (and with model.document_positions "
                                 "its `positions`): data_pipeline.document_inputs")
            masks = {w: document_mask(documents, w) for w in self.args.windows}
        h = self.tok_embeddings(tokens)  # (B, T, D)
        if self.args.embed_scale != 1.0:  # (Gemma: x sqrt(dim))
            h = h * self.args.embed_scale
        # (T, rd/2, 2), or each row's own positions (B, T, rd/2, 2)
        tables = {"": None, "global": self.freqs_cis, "local": self.freqs_cis_local}
        tables = {k: None if t is None else t[start_pos:end] if positions is None else t[positions]
                  for k, t in tables.items()}
        training = labels is not None and torch.is_grad_enabled()
        aux = []
        for i, layer in enumerate(self.layers):
            attention = layer.attention
            freqs_cis = tables[attention.rope]
            if cache is None:
                h = layer(h, freqs_cis, None, None, 0, masks.get(attention.window))
            else:
                h = layer(h, freqs_cis, cache.k[i], cache.v[i], start_pos)
            # The MoE blocks' balancing and z losses, in training (after the block: activation
            # checkpointing reruns its forward in backward, and the counts' all-reduce runs once).
            if training and isinstance(layer.feed_forward, MoE):
                aux.append(layer.feed_forward.aux_loss())
        h = self.norm(h)
        if self.logit_scale != 1.0:  # applied to the head's input: the same, and D wide instead of V
            h = h * self.logit_scale
        # (B, T, V), or the loss: with model.z_loss, in training, plus the output z-loss
        out = self.output(h, labels, loss_chunk, label_count, self.args.z_loss if training else 0.0)
        return out + torch.stack(aux).sum() if aux else out

    def moe_layers(self) -> list[MoE]:
        """The MoE feed-forwards, in block order (empty for a dense model)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def init_weights(self, gather: Gather | None = None) -> None:
        """Initialise every parameter from the global torch RNG, in a fixed order.

        Seed right before calling: the same seed on the same device gives the same weights.
        Embeddings and the untied LM head ~ N(0, init_std); input projections (wq wk wv w1 w3) ~
        N(0, hidden_init_std); output projections wo ~ N(0, out_init_std), w2 ~ N(0, ffn_out_init_std);
        norms = 1. Under sp those are init_std and init_std / sqrt(2 * n_layers); ModelArgs has mup's
        and completep's.
        `gather(params)` is entered
        around each group it touches (embedding, each block, final norm + head), so ZeRO-3 can pass
        `lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=0)` for a partitioned model.
        """
        gather = gather or (lambda params: contextlib.nullcontext())
        std, hidden_std, out_std = self.args.init_std, self.args.hidden_init_std, self.args.out_init_std
        with gather([self.tok_embeddings.weight]):
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        # Found via modules(), so blocks wrapped for activation checkpointing or compile are reached too.
        for block in [m for m in self.modules() if isinstance(m, TransformerBlock)]:
            with gather(list(block.parameters())):
                block.init_weights(hidden_std, out_std, self.args.ffn_out_init_std, std)
        tail = [self.norm.weight] + ([] if self.args.tie_embeddings else [self.output.weight])
        with gather(tail):
            self.norm.init_weights()
            if not self.args.tie_embeddings:
                nn.init.normal_(self.output.weight, mean=0.0, std=std)


def num_params(args: ModelArgs | Transformer, non_embedding: bool = False, active: bool = False) -> int:
    """Parameter count from the shape alone (works on partitioned models whose tensors are empty).

    non_embedding=True gives Kaplan/Chinchilla's N: everything but the token embedding. An untied
    LM head counts in N; a tied one is the embedding and does not. active=True counts, in MoE
    blocks, the k experts a token goes through instead of all E (and the router, shared experts).
    """
    a = args.args if isinstance(args, Transformer) else args
    if not a.vocab_size:
        raise ValueError("model.vocab_size=0: parameter counts need the vocabulary size")
    q, kv = a.n_heads * a.head_dim, a.kv_heads * a.head_dim
    attn = a.dim * (2 * q + 2 * kv)  # wq, wo + wk, wv
    attn += (q + 2 * kv) * a.qkv_bias + a.dim * a.attn_out_bias + a.n_heads * a.attn_sinks
    attn += {"none": 0, "head": 2 * a.head_dim, "projection": q + kv}[a.qk_norm]  # q/k norms
    norms = (4 if a.norm_placement == "sandwich" else 2) * a.dim  # each block's RMSNorm weights
    dense = 3 * a.dim * a.hidden_dim  # w1, w2, w3
    experts = a.moe_top_k if active else a.moe_experts
    moe = a.dim * a.moe_experts + 3 * a.dim * a.moe_expert_hidden_dim * (experts + a.moe_shared_experts)
    moe += a.moe_experts * a.moe_router_bias + experts * (2 * a.moe_expert_hidden_dim + a.dim) * a.moe_expert_bias
    ffn = (a.n_layers - a.moe_layers) * dense + a.moe_layers * moe
    blocks = a.n_layers * (attn + norms) + ffn
    head = 0 if a.tie_embeddings else a.vocab_size * a.dim
    n = blocks + a.dim + head  # + final norm
    return n if non_embedding else n + a.vocab_size * a.dim


def flops_per_token(args: ModelArgs | Transformer, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length seq_len: 6*N + 12*L*H*Q*T.

    PaLM (Chowdhery et al. 2022, appendix B) convention. N = every parameter except the
    embedding lookup, with the LM head matmul included even when tied (it is computed either way);
    norm weights are in N too (negligible). 12*L*H*Q*T counts the attention scores and their
    weighted sum over the full T x T matrix, not just its causal half; a sliding-window layer's as
    twice its causal band too (the band holds W T - W (W - 1) / 2 query-key pairs for W < T: twice
    that is 2 W - W (W - 1) / T keys per query, T at W = T), so that a windowed model's MFU and
    `pretrain estimate` count what a block-skipping kernel saves, in the same convention.
    """
    a = args.args if isinstance(args, Transformer) else args
    keys = sum(2 * w - w * (w - 1) / seq_len if 0 < w < seq_len else seq_len
               for w in map(a.layer_window, range(a.n_layers)))
    return 6 * matmul_params(a) + round(12 * a.n_heads * a.head_dim * keys)


def matmul_params(args: ModelArgs | Transformer) -> int:
    """N of the 6N term above, and of scaling-law fits: every parameter but the embedding lookup,
    the LM head included even when tied; in MoE blocks the active ones (k experts of E)."""
    a = args.args if isinstance(args, Transformer) else args
    return num_params(a, non_embedding=True, active=True) + (a.vocab_size * a.dim if a.tie_embeddings else 0)
