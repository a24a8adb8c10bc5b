"""Forward pass, causality, KV-cache decoding, counts. (Activation checkpointing:
tests/test_parallelize.py, and through the trainer in tests/test_train.py.)"""

import pytest
import torch

from pretrain.model.args import ModelArgs
from pretrain.model.attention import KVCache
from pretrain.model.model import Transformer, flops_per_token, num_params
from pretrain.model.rope import apply_rotary_emb


def tiny(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
    return ModelArgs(**{**base, **kw})


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_forward_shape():
    model = build(tiny())
    logits = model(torch.randint(0, 256, (3, 10)))
    assert logits.shape == (3, 10, 256) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_bad_args_fail_clearly():
    with pytest.raises(ValueError, match="vocab_size=0"):
        Transformer(tiny(vocab_size=0))
    with pytest.raises(ValueError, match="n_kv_heads"):
        Transformer(tiny(n_kv_heads=3))
    with pytest.raises(ValueError, match="max_seq_len"):
        build(tiny())(torch.zeros(1, 65, dtype=torch.long))


def test_no_bias_and_rope_buffer_not_saved():
    model = build(tiny())
    assert all(not name.endswith("bias") for name, _ in model.named_parameters())
    assert "freqs_cis" not in model.state_dict()
    assert model.freqs_cis.dtype == torch.float32 and model.freqs_cis.shape == (64, 8, 2)


@pytest.mark.parametrize("n_kv_heads", [0, 2, 1])
def test_causal(n_kv_heads):
    model = build(tiny(n_kv_heads=n_kv_heads))
    tokens = torch.randint(0, 256, (2, 20))
    ref = model(tokens)
    for t in (0, 7, 19):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1) % 256
        out = model(changed)
        torch.testing.assert_close(out[:, :t], ref[:, :t], rtol=0, atol=0)
        assert not torch.allclose(out[:, t:], ref[:, t:])  # the change does reach t and later


def test_kv_cache_decoding_matches_full_forward():
    args = tiny(n_heads=4, n_kv_heads=2)
    model = build(args)
    tokens = torch.randint(0, 256, (2, 24))
    full = model(tokens)

    cache = KVCache(args, batch_size=2, max_len=24)
    assert cache.k[0].shape == (2, 24, 2, 16)  # KV heads wide, not n_heads
    steps = [model(tokens[:, t:t + 1], cache=cache, start_pos=t) for t in range(24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)

    # Chunked prefill: chunks after the first (T > 1, start_pos > 0) need the shifted causal mask.
    cache = KVCache(args, batch_size=2, max_len=24)
    chunks, pos = [], 0
    for size in (5, 7, 1, 11):
        chunks.append(model(tokens[:, pos:pos + size], cache=cache, start_pos=pos))
        pos += size
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, rtol=0, atol=1e-5)


def test_apply_rotary_emb_keeps_dtype_and_computes_in_fp32():
    from pretrain.model.rope import precompute_freqs_cis
    freqs = precompute_freqs_cis(16, 32)
    x = torch.randn(2, 32, 4, 16)
    ref = apply_rotary_emb(x, freqs)
    out = apply_rotary_emb(x.bfloat16(), freqs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, apply_rotary_emb(x.bfloat16().float(), freqs).bfloat16(), rtol=0, atol=0)
    # A rotation keeps each pair's norm, so each head vector keeps its length.
    torch.testing.assert_close(ref.norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize("kw", [{}, dict(n_kv_heads=0), dict(tie_embeddings=True), dict(ffn_hidden_dim=100)])
def test_num_params_from_args_equals_model(kw):
    args = tiny(**kw)
    model = Transformer(args)
    total = sum(p.numel() for p in model.parameters())  # parameters() counts a tied matrix once
    assert num_params(args) == num_params(model) == total
    assert num_params(args, non_embedding=True) == total - model.tok_embeddings.weight.numel()


def test_flops_per_token_by_hand():
    args = tiny(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=96)
    # head_dim 16; per block: wq 64*64 + wk 64*32 + wv 64*32 + wo 64*64 + 3*64*96 + 2 norms of 64
    block = 4096 + 2048 + 2048 + 4096 + 18432 + 128
    n = 2 * block + 64 + 256 * 64  # blocks, final norm, LM head (embedding excluded)
    assert num_params(args, non_embedding=True) == n
    assert flops_per_token(args, 32) == 6 * n + 12 * 2 * 4 * 16 * 32
    # Tied: the head is the embedding (not in N) but its matmul still runs, so FLOPs are unchanged.
    tied = tiny(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden_dim=96,
                tie_embeddings=True)
    assert num_params(tied, non_embedding=True) == n - 256 * 64
    assert flops_per_token(tied, 32) == flops_per_token(args, 32)


def test_dtype_casts_keep_the_rope_table_fp32():
    args = tiny()
    model = build(args)
    tokens = torch.randint(0, 256, (2, 32))
    ref = model(tokens)
    table = model.freqs_cis.clone()
    model.to(torch.bfloat16)
    assert model.freqs_cis.dtype == torch.float32 and torch.equal(model.freqs_cis, table)
    out = model(tokens)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=0.02)  # logits ~0.2, bf16 ~3 digits


def test_meta_device_build_then_init_equals_plain():
    args = tiny()
    plain = build(args, seed=4)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(4)
    model.init_weights()
    assert torch.equal(model.freqs_cis, plain.freqs_cis)
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(tokens), plain(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_equals_cross_entropy_of_full_logits(tied):
    """The loss from labels (LMHead, chunks recomputed in backward) against F.cross_entropy of the
    full fp32 logits: the same loss and the same gradients to fp32 rounding."""
    import torch.nn.functional as F

    tokens, labels = torch.randint(0, 256, (3, 40)), torch.randint(0, 256, (3, 40))
    plain, chunked = build(tiny(tie_embeddings=tied)), build(tiny(tie_embeddings=tied))
    want = F.cross_entropy(plain(tokens).float().flatten(0, 1), labels.flatten())
    want.backward()
    for chunk in (7, 32, 120, 0):  # uneven chunks, several, exactly one, and the derived size
        chunked.zero_grad()
        got = chunked(tokens, labels, loss_chunk=chunk)
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_loss_never_holds_all_logits():
    """With chunks, no tensor of the full (N, V) logits is saved for backward."""
    args = tiny(vocab_size=1024)
    model = build(args)
    tokens, labels = torch.randint(0, 1024, (2, 64)), torch.randint(0, 1024, (2, 64))
    biggest = 0

    def pack(t):
        nonlocal biggest
        biggest = max(biggest, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels, loss_chunk=16).backward()
    assert biggest < 128 * 1024  # the logits would be (128, 1024); the largest saved is the head weight
    assert biggest == 1024 * 64  # (V, D)
