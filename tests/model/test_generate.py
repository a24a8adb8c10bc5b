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


def _nucleus(probs: list[float], top_p: float) -> list[float]:
    """The smallest set of the likeliest tokens whose probability reaches top_p, renormalised."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for i in order:
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    return [probs[i] / mass if i in kept else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize("temperature, top_p", [(0.5, 1.0), (2.0, 1.0), (2.0, 0.75), (0.7, 0.9)])
def test_sampling_follows_the_softmax_of_the_logits_over_the_temperature(temperature, top_p):
    """The frequencies of 40,000 draws against softmax(logits / T) computed here, cut to the nucleus
    for top_p < 1 (T=2 with top_p 0.75 keeps 3 tokens; T=1 would keep 2): each within 5 sigma."""
    import math

    logits = [0.0, 1.0, 2.0, 3.0, -1.0]
    z = [math.exp(v / temperature) for v in logits]
    want = _nucleus([v / sum(z) for v in z], top_p)
    n = 40_000
    g = torch.Generator().manual_seed(1)
    got = torch.bincount(next_token(torch.tensor([logits]).repeat(n, 1), temperature, top_p=top_p, generator=g),
                         minlength=len(logits)).double() / n
    for p, f in zip(want, got.tolist()):
        assert abs(f - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (got.tolist(), want)
    if (temperature, top_p) == (2.0, 0.75):
        assert sum(p > 0 for p in want) == 3 and sum(p > 0 for p in _nucleus([0.032, 0.087, 0.237, 0.644, 0.0], 0.75)) == 2


@pytest.fixture(scope="module")
def cli_model():
    """A fresh model (soft logits: sampling rarely agrees with greedy) with a 512-token vocabulary,
    and the builtin tokenizer of that size, as `pretrain generate` would load them."""
    from data_pipeline import eot_id, load_tokenizer

    tokenizer = load_tokenizer("builtin:python-bpe-512")
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=512, multiple_of=32, max_seq_len=64)
    m = Transformer(args)
    torch.manual_seed(1)
    m.init_weights()
    return m.eval(), tokenizer, eot_id(tokenizer, "")


def test_generate_command_passes_top_p_temperature_and_seed(cli_model, monkeypatch, capsys):
    from pretrain.cli import main
    import pretrain.hf.export

    monkeypatch.setattr(pretrain.hf.export, "load_for_inference", lambda path, device="cpu", verified=False: cli_model)

    def generate(*flags):
        assert main(["generate", "model-dir", "--prompt", "The", "--max-new-tokens", "16", *flags]) == 0
        return capsys.readouterr().out

    greedy = generate("--temperature", "0")
    model, tokenizer, eot = cli_model
    prompt = tokenizer.encode("The").ids
    assert greedy == "The" + tokenizer.decode(sample(model, prompt, 16, eos_id=eot)) + "\n"
    # a nucleus this small keeps the likeliest token only: greedy, whatever the temperature and seed
    assert generate("--temperature", "1.5", "--top-p", "1e-9", "--seed", "3") == greedy
    # otherwise it samples: reproducibly for a seed, as the sampler does with these settings
    for flags in (("--temperature", "1.3", "--top-p", "0.9"), ("--temperature", "0.7", "--top-p", "0.9")):
        first = generate(*flags, "--seed", "5")
        assert first == generate(*flags, "--seed", "5") != greedy
        want = sample(model, prompt, 16, temperature=float(flags[1]), top_p=0.9, seed=5, eos_id=eot)
        assert first == "The" + tokenizer.decode(want) + "\n"
    assert generate("--temperature", "1.3", "--seed", "5") != generate("--temperature", "0.7", "--seed", "5")
