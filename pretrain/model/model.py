"""A Llama-style decoder-only transformer: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases.

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
import functools
import math
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from pretrain.model.args import ModelArgs
from pretrain.model.moe import MoE

Gather = Callable[[list[nn.Parameter]], ContextManager]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for bf16 accuracy; scale after casting back, as HF Llama does.
        return F.rms_norm(x.float(), (x.size(-1),), eps=self.eps).type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def precompute_freqs_cis(head_dim: int, end: int, theta: float = 10000.0,
                         scaling: tuple[float, float, float, int] | None = None) -> torch.Tensor:
    """RoPE table for positions 0..end-1: (end, head_dim // 2, 2) fp32, last axis (cos, sin).

    `scaling` = (factor, low_freq_factor, high_freq_factor, original context): Llama 3.1's RoPE
    scaling, as transformers computes it ("llama3"): wavelengths longer than original/low are
    stretched by `factor`, shorter than original/high kept, and those in between interpolated.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling:
        factor, low, high, original = scaling
        wavelen = 2 * math.pi / freqs
        scaled = torch.where(wavelen > original / low, freqs / factor, freqs)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) & ~(wavelen > original / low)
        freqs = torch.where(medium, smoothed, scaled)
    angles = torch.outer(torch.arange(end, dtype=torch.float32), freqs)  # (end, hd/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, heads, hd) by the table rows for its T positions (T, hd/2, 2), or for each
    row's own positions (B, T, hd/2, 2), in fp32.

    Dimension i is paired with i + hd/2 (rotate-half, HF Llama's layout). Returns x's dtype.
    """
    cos = freqs_cis[..., None, :, 0].float()  # (T, 1, hd/2) or (B, T, 1, hd/2): broadcasts over heads
    sin = freqs_cis[..., None, :, 1].float()
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, T, heads, hd/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


FLEX_DEVICES = {"cuda"}  # devices whose document masks are FlexAttention block masks (others: a dense mask)


def document_mask(documents: torch.Tensor):
    """The attention mask of packed documents: token i attends to token j iff j <= i and both are
    in the same document. documents (B, T) -> on FLEX_DEVICES a FlexAttention BlockMask (blocks
    with nothing to attend are skipped, and no T x T tensor is made), elsewhere a (B, 1, T, T)
    boolean mask for SDPA (T^2 bytes per row: fine on CPU at the lengths a CPU trains)."""
    B, T = documents.shape
    if documents.device.type in FLEX_DEVICES:
        def same_document_causal(b, h, q, kv):
            return (documents[b, q] == documents[b, kv]) & (kv <= q)

        return create_block_mask(same_document_causal, B, None, T, T, device=documents.device,
                                 _compile=documents.device.type == "cuda")
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal


_COMPILED_FLEX = None


def _flex_attention(device: torch.device):
    """FlexAttention; compiled on GPUs (eager it materialises the scores: for tests on CPU only)."""
    global _COMPILED_FLEX
    if device.type != "cuda":
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX


class KVCache:
    """Pre-allocated keys and values for incremental decoding.

    `k[i]`, `v[i]`: layer i's cache, (B, max_len, KV, hd); KV-heads wide, so GQA shrinks it.
    The model writes positions start_pos..start_pos+T-1 on each call; the caller tracks start_pos.
    """

    def __init__(self, args: ModelArgs, batch_size: int, max_len: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32):
        max_len = max_len or args.max_seq_len
        shape = (batch_size, max_len, args.kv_heads, args.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]

    @property
    def max_len(self) -> int:
        return self.k[0].size(1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.scale = args.attn_scale  # None: SDPA's 1/sqrt(head_dim)
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, cache_k: torch.Tensor | None = None,
                cache_v: torch.Tensor | None = None, start_pos: int = 0, mask=None) -> torch.Tensor:
        """x (B, T, D), freqs_cis (T or B x T, hd/2, 2); `mask`: None (causal) or a document mask
        (see `document_mask`)."""
        B, T, _ = x.shape
        # (-1: under tensor parallelism a rank holds H/tp and KV/tp of the heads)
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, KV, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, KV, hd)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)

        if cache_k is not None:
            cache_k[:, start_pos:start_pos + T] = k
            cache_v[:, start_pos:start_pos + T] = v
            k, v = cache_k[:, :start_pos + T], cache_v[:, :start_pos + T]  # (B, S, KV, hd)
            S = k.size(1)
            # SDPA's is_causal aligns the mask top-left, right only without past keys; one new token
            # sees every key; a chunk after a past needs the mask shifted by start_pos.
            if S != T and T > 1:
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
        out = self.attend(q, k, v, mask)  # (B, T, H, hd)
        return self.wo(out.reshape(B, T, -1))  # (B, T, D)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        """Attention of q (B, T, H, hd) over k, v (B, S, KV, hd) -> (B, T, H, hd). Causal when `mask`
        is None (and T > 1); else a boolean mask (True = attend) or a FlexAttention BlockMask.
        Sequence parallelism replaces this method on each layer with the all-to-all exchange around
        it (pretrain/parallel/ulysses.py): heads of the whole sequence in, the same layout out."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T or S, hd)
        gqa = k.size(1) != q.size(1)  # the kernel shares each KV head across its query group without copying
        if isinstance(mask, BlockMask):
            out = _flex_attention(q.device)(q, k, v, block_mask=mask, scale=self.scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and q.size(2) > 1,
                                                 scale=self.scale, enable_gqa=gqa)
        return out.transpose(1, 2)  # (B, T, H, hd)

    def init_weights(self, std: float, out_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.normal_(w.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x).

    With `chunk` > 0 (train.mlp_chunk_tokens) it runs `chunk` tokens at a time, each tile under
    torch.utils.checkpoint when gradients are on: only the tiles' inputs are kept for backward, and
    the (tokens, hidden_dim) intermediates exist for one tile at a time, forward and backward (ALST's
    TiledMLP). For long sequences, where those intermediates are the largest activations."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.chunk = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, -2)  # (N, D)
        if not self.chunk or tokens.size(0) <= self.chunk:
            return self._swiglu(x)
        tile = functools.partial(checkpoint, self._swiglu, use_reentrant=False) if torch.is_grad_enabled() \
            else self._swiglu
        return torch.cat([tile(part) for part in tokens.split(self.chunk)]).view_as(x)

    def _swiglu(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1.weight, mean=0.0, std=std)
        nn.init.normal_(self.w3.weight, mean=0.0, std=std)
        nn.init.normal_(self.w2.weight, mean=0.0, std=out_std)


LOSS_CHUNK_BYTES = 1 << 28  # fp32 logits of one chunk of the loss: 256 MiB


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one chunk: h (n, D), labels (n,) -> scalar fp32 (labels of -100 are
    not scored)."""
    return F.cross_entropy(F.linear(h, weight).float(), labels, reduction="sum")


class LMHead(nn.Linear):
    """The output projection. With labels, it returns the mean cross-entropy instead of logits,
    computed `chunk` tokens at a time: each chunk's logits are made, cast to fp32, reduced to a sum
    and dropped, and made again in backward (torch.utils.checkpoint), so the (B, T, V) logits and
    their fp32 copy never exist at once. (A module of its own so that ZeRO-3 gathers its weight for
    the loss as for the logits.)"""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, chunk: int = 0,
                label_count: float = 0) -> torch.Tensor:
        """The loss is the sum over the scored labels (not -100) divided by `label_count`, by default
        their number here."""
        if labels is None:
            return super().forward(h)  # (B, T, V)
        h, labels = h.flatten(0, 1), labels.flatten()  # (N, D), (N,)
        n = labels.numel()
        divisor = label_count or (labels != -100).sum().clamp(min=1)  # (a device tensor: no host sync)
        chunk = chunk or max(128, LOSS_CHUNK_BYTES // (4 * self.out_features))
        if n <= chunk:  # one chunk: nothing to save by recomputing
            return _chunk_loss(h, self.weight, labels) / divisor
        total = h.new_zeros((), dtype=torch.float32)
        for i in range(0, n, chunk):
            total = total + checkpoint(_chunk_loss, h[i:i + chunk], self.weight, labels[i:i + chunk],
                                       use_reentrant=False)
        return total / divisor


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.is_moe_layer(index):
            shared = args.moe_shared_experts * args.moe_expert_hidden_dim
            self.feed_forward = MoE(args, FeedForward(args.dim, shared) if shared else None)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.residual_scale = args.residual_scale  # completep: 1 / m_L on each branch

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, cache_k: torch.Tensor | None = None,
                cache_v: torch.Tensor | None = None, start_pos: int = 0, mask=None) -> torch.Tensor:
        """x (B, T, D), freqs_cis (T or B x T, hd/2, 2) -> (B, T, D). Tensors, None, ints and a
        BlockMask only, so that activation checkpointing can wrap the block."""
        a = self.attention(self.attention_norm(x), freqs_cis, cache_k, cache_v, start_pos, mask)
        if self.residual_scale == 1.0:
            h = x + a
            return h + self.feed_forward(self.ffn_norm(h))
        h = x + self.residual_scale * a
        return h + self.residual_scale * self.feed_forward(self.ffn_norm(h))

    def init_weights(self, std: float, out_std: float, ffn_out_std: float, router_std: float) -> None:
        self.attention_norm.init_weights()
        self.attention.init_weights(std, out_std)
        self.ffn_norm.init_weights()
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
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = LMHead(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.logit_scale = args.logit_scale  # mup, completep: logits x 1/m
        # Non-persistent: derived from args, so checkpoints hold weights only.
        self.register_buffer("freqs_cis", self.rope_table(), persistent=False)

    def rope_table(self, device: torch.device | str | None = None) -> torch.Tensor:
        """This model's RoPE table, fp32: (max_seq_len, head_dim / 2, 2)."""
        a = self.args
        scaling = (a.rope_scaling_factor, a.rope_low_freq_factor, a.rope_high_freq_factor,
                   a.rope_original_max_seq_len) if a.rope_scaling_factor else None
        return precompute_freqs_cis(a.head_dim, a.max_seq_len, a.rope_theta, scaling).to(device)

    def reset_rope_table(self) -> None:
        """Rebuild the table in fp32 on the device it is on. bf16 would round positions past 256 to
        multiples of 8 and more; whoever builds the model under something that changes dtypes
        behind its back (deepspeed.zero.Init patches tensor constructors so that even an explicit
        float32 arange comes out bf16) calls this afterwards."""
        self.freqs_cis = self.rope_table(self.freqs_cis.device)

    def _apply(self, fn, recurse=True):
        # model.to(bf16) / .half() would round the RoPE table too: rebuild it after any cast or move.
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
        mask = None
        if self.args.document_mask and cache is None:
            if documents is None or (positions is None and self.args.document_positions):
                raise ValueError("model.document_mask needs the batch's `documents` (and with model.document_positions "
                                 "its `positions`): data_pipeline.document_inputs")
            mask = document_mask(documents)
        h = self.tok_embeddings(tokens)  # (B, T, D)
        # (T, hd/2, 2), or each row's own positions (B, T, hd/2, 2)
        freqs_cis = self.freqs_cis[start_pos:end] if positions is None else self.freqs_cis[positions]
        aux = []
        for i, layer in enumerate(self.layers):
            if cache is None:
                h = layer(h, freqs_cis, None, None, 0, mask)
            else:
                h = layer(h, freqs_cis, cache.k[i], cache.v[i], start_pos)
            # The MoE blocks' balancing and z losses, in training (after the block: activation
            # checkpointing reruns its forward in backward, and the counts' all-reduce runs once).
            if labels is not None and torch.is_grad_enabled() and isinstance(layer.feed_forward, MoE):
                aux.append(layer.feed_forward.aux_loss())
        h = self.norm(h)
        if self.logit_scale != 1.0:  # applied to the head's input: the same, and D wide instead of V
            h = h * self.logit_scale
        out = self.output(h, labels, loss_chunk, label_count)  # (B, T, V), or the loss
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
    attn = a.dim * a.head_dim * (2 * a.n_heads + 2 * a.kv_heads)  # wq, wo + wk, wv
    dense = 3 * a.dim * a.hidden_dim  # w1, w2, w3
    experts = a.moe_top_k if active else a.moe_experts
    moe = a.dim * a.moe_experts + 3 * a.dim * a.moe_expert_hidden_dim * (experts + a.moe_shared_experts)
    ffn = (a.n_layers - a.moe_layers) * dense + a.moe_layers * moe
    blocks = a.n_layers * (attn + 2 * a.dim) + ffn  # + two RMSNorm weights
    head = 0 if a.tie_embeddings else a.vocab_size * a.dim
    n = blocks + a.dim + head  # + final norm
    return n if non_embedding else n + a.vocab_size * a.dim


def flops_per_token(args: ModelArgs | Transformer, seq_len: int) -> int:
    """Training FLOPs (forward + backward) per token at sequence length seq_len: 6*N + 12*L*H*Q*T.

    PaLM (Chowdhery et al. 2022, appendix B) convention. N = every parameter except the
    embedding lookup, with the LM head matmul included even when tied (it is computed either way);
    norm weights are in N too (negligible). 12*L*H*Q*T counts the attention scores and their
    weighted sum over the full T x T matrix, not just its causal half.
    """
    a = args.args if isinstance(args, Transformer) else args
    return 6 * matmul_params(a) + 12 * a.n_layers * a.n_heads * a.head_dim * seq_len


def matmul_params(args: ModelArgs | Transformer) -> int:
    """N of the 6N term above, and of scaling-law fits: every parameter but the embedding lookup,
    the LM head included even when tied; in MoE blocks the active ones (k experts of E)."""
    a = args.args if isinstance(args, Transformer) else args
    return num_params(a, non_embedding=True, active=True) + (a.vocab_size * a.dim if a.tie_embeddings else 0)
