"""`flops_per_token`, the numerator of MFU, against the matmul FLOPs torch counts in a real forward and
backward of each preset's shape, scaled down to run on a CPU in seconds."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from pretrain.model.args import PRESETS, ModelArgs
from pretrain.model.model import Transformer, flops_per_token
from pretrain.parallel.parallelize import apply_activation_checkpointing

SEQ_LEN = 256


@pytest.fixture(autouse=True)
def one_thread():
    """Matmuls this small gain nothing from threads, which spin when the cores are shared (10x slower
    under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def scaled(name: str, head_dim: int = 8, tie: bool = False) -> ModelArgs:
    """The preset's layers, heads, key/value heads and FFN and vocabulary ratios to the width (at a 32k
    vocabulary), at head_dim 8: the shares of attention, FFN and head in the FLOPs stay the preset's."""
    p = ModelArgs(**PRESETS[name], vocab_size=32000)
    dim = p.n_heads * head_dim
    return ModelArgs(dim=dim, n_layers=p.n_layers, n_heads=p.n_heads, n_kv_heads=p.n_kv_heads,
                     ffn_hidden_dim=round(p.hidden_dim * dim / p.dim), vocab_size=round(32000 * dim / p.dim),
                     tie_embeddings=tie or p.tie_embeddings, max_seq_len=SEQ_LEN)


def counted_flops(model: Transformer, batch: int = 1, loss_chunk: int = 0) -> int:
    """FLOPs of one training forward + backward as torch's FlopCounterMode counts them.

    On CPU, SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, for which the counter has no
    formula (it counts 0), so attention runs in the math backend: its matmuls are real bmm's over the
    full T x T scores (the causal mask is applied to them, not skipped), 2 in forward and 4 in backward,
    which is PaLM's 12 L H Q T. (The counter's GPU flash formulas also ignore causality, and count a
    fifth backward matmul, the scores recomputed: hardware FLOPs, which MFU leaves out.)"""
    args = model.args
    tokens = torch.randint(0, args.vocab_size, (batch, SEQ_LEN))
    labels = torch.randint(0, args.vocab_size, (batch, SEQ_LEN))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, labels, loss_chunk=loss_chunk).backward()
    return counter.get_total_flops()


def build(args: ModelArgs) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("name,tie", [(n, False) for n in PRESETS] + [("tiny", True)])
def test_flops_per_token_matches_counted_flops(name, tie):
    """The loss in one chunk, no activation checkpointing: nothing is computed twice, so the count is
    the model's FLOPs. The counter leaves out the embedding (a gather), norms, RoPE and the loss
    (elementwise); of these PaLM's 6N only has the norm weights, under 0.1% here."""
    args = scaled(name, tie=tie)
    measured = counted_flops(build(args), batch=2, loss_chunk=2 * SEQ_LEN)
    predicted = flops_per_token(args, SEQ_LEN) * 2 * SEQ_LEN
    assert measured == pytest.approx(predicted, rel=0.02), (measured / predicted, measured, predicted)


def test_recomputation_is_on_top_of_flops_per_token():
    """Activation checkpointing and the chunked loss recompute forwards in backward: hardware FLOPs,
    not model FLOPs. flops_per_token (what MFU divides by) keeps its meaning under either; the counter
    sees exactly one more forward of each recomputed part on top of it."""
    args = scaled("7b")
    tokens = SEQ_LEN
    plain = counted_flops(build(args), loss_chunk=tokens)
    head_forward = 2 * args.vocab_size * args.dim * tokens

    chunked = counted_flops(build(args), loss_chunk=tokens // 4)
    assert chunked - plain == head_forward

    model = build(args)
    apply_activation_checkpointing(model, 2)
    # Every other block runs forward again, but torch's checkpoint stops recomputing once it has what
    # backward needs, so that block's last matmul (w2, whose output nothing saves) is not redone.
    a = args
    redone_weights = a.dim * a.head_dim * (2 * a.n_heads + 2 * a.kv_heads) + 2 * a.dim * a.hidden_dim
    block_forward = (2 * redone_weights + 4 * a.n_heads * a.head_dim * SEQ_LEN) * tokens
    assert counted_flops(model, loss_chunk=tokens) - plain == a.n_layers // 2 * block_forward
