"""Grouped-query attention and its masks: causal, packed documents, sliding windows; q/k norms,
projection biases, partial or no RoPE, and learned attention sinks, as the layer's description says.

Shape letters: B batch, T new tokens, S keys seen (past + new), H query heads, KV key/value heads,
hd head_dim, D dim.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from pretrain.model.args import ModelArgs
from pretrain.model.norm import init_norms, optional_norm
from pretrain.model.rope import apply_rotary_emb

FLEX_DEVICES = {"cuda"}  # devices whose structured masks are FlexAttention block masks (others: a dense mask)


def document_mask(documents: torch.Tensor, window: int = 0):
    """The attention mask of packed documents: token i attends to token j iff j <= i, both are in
    the same document and (with `window`) i - j < window. documents (B, T) -> on FLEX_DEVICES a
    FlexAttention BlockMask (blocks with nothing to attend are skipped, and no T x T tensor is
    made), elsewhere a (B, 1, T, T) boolean mask for SDPA (T^2 bytes per row: fine on CPU at the
    lengths a CPU trains)."""
    B, T = documents.shape
    if documents.device.type in FLEX_DEVICES:
        def same_document_causal(b, h, q, kv):
            keep = (documents[b, q] == documents[b, kv]) & (kv <= q)
            return keep & (q - kv < window) if window else keep

        return create_block_mask(same_document_causal, B, None, T, T, device=documents.device,
                                 _compile=documents.device.type == "cuda")
    keep = causal_mask(T, T, window, documents.device)
    return (documents[:, None, :, None] == documents[:, None, None, :]) & keep


def causal_mask(T: int, S: int, window: int = 0, device=None) -> torch.Tensor:
    """(T, S) boolean: the T new tokens sit at the last T of S positions; each sees the keys at
    or before its position, and with `window` only the `window` latest of them (itself included)."""
    q = torch.arange(S - T, S, device=device)[:, None]
    kv = torch.arange(S, device=device)[None, :]
    keep = kv <= q
    return keep & (q - kv < window) if window else keep


@functools.lru_cache(maxsize=16)
def _structured_block_mask(T: int, window: int, device: torch.device) -> BlockMask:
    """The causal (or sliding-window causal) BlockMask of length T, made once per shape."""
    def causal_window(b, h, q, kv):
        keep = kv <= q
        return keep & (q - kv < window) if window else keep

    return create_block_mask(causal_window, None, None, T, T, device=device, _compile=device.type == "cuda")


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

    `k[i]`, `v[i]`: layer i's cache, (B, max_len, KV, hd); KV-heads wide, so GQA shrinks it. Every
    layer keeps every position, local (sliding-window) layers too: their mask reads the window.
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
    """Block `index`'s attention: wq, wk, wv (biased with model.qkv_bias), q/k norms
    (model.qk_norm: per head, or over the whole projection), RoPE unless the layer has none,
    full causal or sliding-window attention (its kind in model.layer_pattern), learned sinks
    (model.attn_sinks), wo (biased with model.attn_out_bias)."""

    def __init__(self, args: ModelArgs, index: int = 0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.scale = args.attn_scale  # None: SDPA's 1/sqrt(head_dim)
        self.window = args.layer_window(index)  # 0: full causal attention
        self.rope = args.layer_rope(index)  # which RoPE table: "global", "local", or "" (none: a NoPE layer)
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.wq = nn.Linear(args.dim, q_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(q_dim, args.dim, bias=args.attn_out_bias)
        self.qk_norm = args.qk_norm
        per_head = args.qk_norm == "head"
        self.q_norm = optional_norm(args.qk_norm != "none", self.head_dim if per_head else q_dim, args.norm_eps,
                                    args.norm_unit_offset)
        self.k_norm = optional_norm(args.qk_norm != "none", self.head_dim if per_head else kv_dim, args.norm_eps,
                                    args.norm_unit_offset)
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if args.attn_sinks else None  # (H,) logits

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor | None, cache_k: torch.Tensor | None = None,
                cache_v: torch.Tensor | None = None, start_pos: int = 0, mask=None) -> torch.Tensor:
        """x (B, T, D), freqs_cis (T or B x T, rd/2, 2), None in a layer without RoPE; `mask`: None
        (causal, and this layer's window) or a document mask of this layer's kind (`document_mask`)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, freqs_cis)
        if cache_k is not None:
            cache_k[:, start_pos:start_pos + T] = k
            cache_v[:, start_pos:start_pos + T] = v
            k, v = cache_k[:, :start_pos + T], cache_v[:, :start_pos + T]  # (B, S, KV, hd)
            S = k.size(1)
            # SDPA's is_causal aligns the mask top-left, right only without past keys; one new token
            # sees every key (but those before a window); a chunk after a past needs the mask shifted.
            if (S != T and T > 1) or (self.window and S > self.window):
                mask = causal_mask(T, S, self.window, x.device)
        out = self.attend(q, k, v, mask, self.sinks)  # (B, T, H, hd)
        return self.wo(out.reshape(B, T, -1))  # (B, T, D)

    def qkv(self, x: torch.Tensor, freqs_cis: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The queries (B, T, H, hd), keys and values (B, T, KV, hd) of x (B, T, D): projected,
        q/k-normalised, rotated (unless freqs_cis is None)."""
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # (B, T, H*hd), (B, T, KV*hd) x 2
        if self.qk_norm == "projection":  # over every head at once (OLMo 2): before splitting them
            q, k = self.q_norm(q), self.k_norm(k)
        # (-1: under tensor parallelism a rank holds H/tp and KV/tp of the heads)
        q = q.view(B, T, -1, self.head_dim)  # (B, T, H, hd)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, KV, hd)
        v = v.view(B, T, -1, self.head_dim)  # (B, T, KV, hd)
        if self.qk_norm == "head":  # each head's vector alone (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        if freqs_cis is not None:
            q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q (B, T, H, hd) over k, v (B, S, KV, hd) -> (B, T, H, hd). Causal (within
        this layer's window) when `mask` is None; else a boolean mask (True = attend) or a
        FlexAttention BlockMask. `sinks` (H,): each head's sink logit, a key every query sees whose
        value is zero (it only takes softmax mass). Sequence parallelism replaces this method on each
        layer with the all-to-all exchange around it (pretrain/parallel/ulysses.py): heads of the
        whole sequence in, the same layout out, and the sinks of the heads this rank holds."""
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T or S, hd)
        T, S = q.size(2), k.size(2)
        gqa = k.size(1) != q.size(1)  # the kernels share each KV head across its query group without copying
        if mask is None and q.device.type in FLEX_DEVICES and (self.window or sinks is not None) and T == S:
            mask = _structured_block_mask(T, self.window, q.device)  # blocks outside the window skipped
        elif mask is None and (self.window or sinks is not None) and T > 1:
            mask = causal_mask(T, S, self.window, q.device)
        if isinstance(mask, BlockMask):
            flex = _flex_attention(q.device)
            if sinks is None:
                out = flex(q, k, v, block_mask=mask, scale=self.scale, enable_gqa=gqa)
            else:  # softmax over [scores, sink] = softmax(scores) x sigmoid(lse - sink)
                out, aux = flex(q, k, v, block_mask=mask, scale=self.scale, enable_gqa=gqa,
                                return_aux=AuxRequest(lse=True))
                out = out * torch.sigmoid(aux.lse - sinks.float()[:, None]).unsqueeze(-1).to(out.dtype)
        elif sinks is not None:
            out = _attend_with_sinks(q, k, v, mask, sinks, self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                                 scale=self.scale, enable_gqa=gqa)
        return out.transpose(1, 2)  # (B, T, H, hd)

    def init_weights(self, std: float, out_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            nn.init.normal_(w.weight, mean=0.0, std=std)
        nn.init.normal_(self.wo.weight, mean=0.0, std=out_std)
        for w in (self.wq, self.wk, self.wv, self.wo):
            if w.bias is not None:
                nn.init.zeros_(w.bias)
        init_norms(self.q_norm, self.k_norm)
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       sinks: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Dense attention with a sink column (q (B, H, T, hd), k, v (B, KV, S, hd)), in fp32: the
    scores are materialised, so this is the path of CPUs and of the KV-cache decode, where no
    FlexAttention kernel runs. Returns (B, H, T, hd) in q's dtype."""
    B, H, T, hd = q.shape
    group = H // k.size(1)
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = (q.float() @ k.transpose(-1, -2)) * (scale if scale is not None else hd ** -0.5)  # (B, H, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(B, H, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # (B, H, T, S)
    return (probs @ v).to(q.dtype)
