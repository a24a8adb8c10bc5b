"""init_weights: deterministic, depth-scaled, and safe for a partition-built (ZeRO-3) model."""

import contextlib
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from pretrain.model.args import ModelArgs
from pretrain.model.model import Transformer


def tiny(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
    return ModelArgs(**{**base, **kw})


def initialised(args, seed, gather=None) -> Transformer:
    model = Transformer(args)
    torch.manual_seed(seed)
    model.init_weights(gather)
    return model


def test_same_seed_same_weights_bitwise():
    args = tiny()
    a, b, c = initialised(args, 1), initialised(args, 1), initialised(args, 2)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name


def test_init_ignores_construction_rng_and_default_init():
    args = tiny()
    a = initialised(args, 3)
    torch.manual_seed(123)  # different RNG state during construction
    b = Transformer(args)
    torch.manual_seed(3)
    b.init_weights()
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_stds_and_norms():
    args = ModelArgs(dim=512, n_layers=8, n_heads=8, vocab_size=1024, init_std=0.02)
    model = initialised(args, 0)
    out_std = 0.02 / (2 * 8) ** 0.5
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        expected = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.02
        assert abs(p.std().item() - expected) < 0.03 * expected, (name, p.std().item(), expected)
        assert abs(p.mean().item()) < 0.05 * expected, name


def test_tied_init_draws_the_embedding_once():
    """The tied matrix is the seed's first N(0, init_std) draw (a second draw for the head would
    replace it), and the blocks after it are drawn exactly as in the untied model."""
    args = tiny(tie_embeddings=True)
    model = initialised(args, 0)
    assert model.output.weight is model.tok_embeddings.weight
    torch.manual_seed(0)
    first_draw = torch.empty(args.vocab_size, args.dim).normal_(0.0, args.init_std)
    assert torch.equal(model.tok_embeddings.weight, first_draw)
    untied = initialised(tiny(tie_embeddings=False), 0)
    for (name, a), b in zip(model.layers.state_dict().items(), untied.layers.state_dict().values()):
        assert torch.equal(a, b), name


def test_gather_covers_every_parameter():
    model = Transformer(tiny(tie_embeddings=False))
    gathered = []

    def gather(params):
        gathered.extend(params)
        return contextlib.nullcontext()

    model.init_weights(gather)
    assert len(gathered) == len({id(p) for p in gathered})  # each group once
    assert {id(p) for p in gathered} == {id(p) for p in model.parameters()}


def test_partitioned_init_equals_plain_init():
    """Imitate ZeRO-3: parameters are empty except inside gather(), which materialises them."""
    args = tiny()
    plain = initialised(args, 7)

    model = Transformer(args)
    shapes = {p: p.shape for p in model.parameters()}
    saved = {}
    for p in model.parameters():
        p.data = torch.empty(0)

    @contextlib.contextmanager
    def gather(params):
        for p in params:
            p.data = saved.get(p, torch.empty(shapes[p]).fill_(float("nan")))
        yield
        for p in params:
            saved[p] = p.data
            p.data = torch.empty(0)

    torch.manual_seed(7)
    model.init_weights(gather)
    assert all(p.numel() == 0 for p in model.parameters())
    names = {p: n for n, p in model.named_parameters()}
    assert set(saved) == set(names)
    for p, name in names.items():
        assert torch.equal(saved[p], plain.get_parameter(name)), name


def test_init_reaches_blocks_inside_wrappers():
    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

    args = tiny()
    plain = initialised(args, 5)
    wrapped = Transformer(args)
    wrapped.layers = nn.ModuleList(Wrapper(layer) for layer in wrapped.layers)
    torch.manual_seed(5)
    wrapped.init_weights()
    for (name, p), q in zip(plain.state_dict().items(), wrapped.state_dict().values()):
        assert torch.equal(p, q), name


ZERO3_SCRIPT = textwrap.dedent("""
    import deepspeed, torch, torch.distributed as dist
    from pretrain.model.args import ModelArgs
    from pretrain.model.model import Transformer

    dist.init_process_group("gloo", rank=0, world_size=1)
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
    plain = Transformer(args)
    torch.manual_seed(3)
    plain.init_weights()
    # No dtype= here: DeepSpeed ignores it on accelerators without fp16 and picks bf16.
    with deepspeed.zero.Init(config_dict_or_path={"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
        model = Transformer(args)
    assert all(p.numel() == 0 for p in model.parameters()), "not partitioned"
    torch.manual_seed(3)
    model.init_weights(lambda ps: deepspeed.zero.GatheredParameters(ps, modifier_rank=0))
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            assert p.dtype == torch.float32 and torch.equal(p.detach(), q.detach()), name
    print("ZERO3-INIT-OK")
""")


@pytest.mark.slow
def test_real_zero3_partitioned_init_equals_plain_init():
    pytest.importorskip("deepspeed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    run = subprocess.run([sys.executable, "-c", ZERO3_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert "ZERO3-INIT-OK" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
