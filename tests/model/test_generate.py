"""Sampling with the KV cache: greedy is argmax of the full forward; seeds reproduce."""

import pytest
import torch

from pretrain.model.args import ModelArgs
from pretrain.model.generate import next_token, sample
from pretrain.model.model import Transformer


@pytest.fixture(scope="module")
def model():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
    m = Transformer(args)
    torch.manual_seed(0)
    m.init_weights()
    # Sharper logits than a fresh init, so greedy has clear winners and ties are not an issue.
    with torch.no_grad():
        m.output.weight.mul_(20)
    return m


PROMPT = [5, 17, 42, 99, 3]


def test_greedy_is_argmax_of_full_forward(model):
    out = sample(model, PROMPT, max_new_tokens=20)
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(20):
            seq.append(model(torch.tensor([seq]))[0, -1].argmax().item())
    assert out == seq[len(PROMPT):]


def test_same_seed_same_sample(model):
    a = sample(model, PROMPT, 30, temperature=1.0, seed=11)
    b = sample(model, PROMPT, 30, temperature=1.0, seed=11)
    c = sample(model, PROMPT, 30, temperature=1.0, seed=12)
    assert a == b and a != c


def test_seed_leaves_global_rng_alone(model):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    sample(model, PROMPT, 5, temperature=1.0, seed=1)
    assert torch.equal(torch.rand(3), expected)


def test_top_k_1_and_tiny_top_p_are_greedy(model):
    greedy = sample(model, PROMPT, 20)
    assert sample(model, PROMPT, 20, temperature=1.0, top_k=1, seed=3) == greedy
    assert sample(model, PROMPT, 20, temperature=1.0, top_p=1e-6, seed=3) == greedy


def test_eos_stops_and_is_included(model):
    greedy = sample(model, PROMPT, 20)
    eos = greedy[4]
    assert sample(model, PROMPT, 20, eos_id=eos) == greedy[:greedy.index(eos) + 1]


def test_too_long_is_refused(model):
    with pytest.raises(ValueError, match="max_seq_len"):
        sample(model, PROMPT, 60)


def test_next_token_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    top2 = next_token(logits, temperature=1.0, top_k=2, generator=g)
    assert set(top2.tolist()) == {2, 3}
    # softmax([0,1,2,3]) = [.032, .087, .237, .644]: top_p 0.8 keeps {3, 2}, 0.5 keeps {3}.
    assert set(next_token(logits, 1.0, top_p=0.8, generator=g).tolist()) == {2, 3}
    assert set(next_token(logits, 1.0, top_p=0.5, generator=g).tolist()) == {3}
    assert set(next_token(logits, 1.0, generator=g).tolist()) == {0, 1, 2, 3}
