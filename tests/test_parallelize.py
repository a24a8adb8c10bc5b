"""The pieces around DeepSpeed that need no process group: its generated config, activation
checkpointing, optimizer groups and the LR schedule."""

import pytest
import torch

from pretrain.config import load_config
from pretrain.model import ModelArgs, Transformer
from pretrain.optim.optimizer import param_groups
from pretrain.optim.schedule import lr_at
from pretrain.parallel.parallelize import apply_activation_checkpointing, deepspeed_config


def _model(seed=0):
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32))
    model.init_weights()
    return model


def test_deepspeed_config_from_ours():
    cfg = load_config(None, ["train.micro_batch_size=4", "data.seq_len=64", "train.global_batch_tokens=2048",
                             "optimizer.grad_clip=0.5", "distributed.param_persistence_threshold=0"])
    ds = deepspeed_config(cfg, world_size=2, precision="bf16")
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (32, 4, 4)
    assert ds["gradient_clipping"] == 0.5  # always explicit: DeepSpeed's default would be 1.0
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert "auto" not in str(ds)


def _saved_tensors(model, tokens):
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens).float().logsumexp(-1).mean()
    return loss, count


def test_activation_checkpointing_saves_less_and_changes_nothing():
    tokens = torch.randint(0, 128, (2, 32))
    plain, wrapped = _model(), _model()
    apply_activation_checkpointing(wrapped, 1)
    loss_a, saved_a = _saved_tensors(plain, tokens)
    loss_b, saved_b = _saved_tensors(wrapped, tokens)
    assert saved_b < saved_a / 2  # the blocks' activations are recomputed, not stored
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b)
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    # Names (and so checkpoints and exports) do not change.
    assert list(plain.state_dict()) == list(wrapped.state_dict())
    every_2nd = _model()
    apply_activation_checkpointing(every_2nd, 2)
    assert saved_b < _saved_tensors(every_2nd, tokens)[1] < saved_a


def test_no_weight_decay_on_norms_and_embeddings():
    cfg = load_config(None, ["optimizer.weight_decay=0.1"]).optimizer
    model = _model()
    decay, no_decay = param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 and "tok_embeddings" not in names[id(p)] for p in decay["params"])
    assert {names[id(p)] for p in no_decay["params"]} >= {"tok_embeddings.weight", "norm.weight"}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_warmup_then_cosine_to_the_floor():
    peak, floor = 1e-3, 1e-4
    lrs = [lr_at(s, peak, warmup=10, decay=90, floor=floor) for s in range(120)]
    assert lrs[0] == pytest.approx(peak / 10) and lrs[9] == pytest.approx(peak)
    assert lrs[10] == pytest.approx(peak) and lrs[55] == pytest.approx((peak + floor) / 2)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[100] == pytest.approx(floor) and lrs[119] == floor


def test_zero_sizes_follow_the_hidden_size_unless_set():
    from pretrain.config import zero_sizes

    cfg = load_config(None, ["model.dim=4096", "model.n_heads=32"])
    ds = deepspeed_config(cfg, world_size=8, precision="bf16")["zero_optimization"]
    assert (ds["reduce_bucket_size"], ds["stage3_prefetch_bucket_size"], ds["stage3_param_persistence_threshold"]) \
        == (4096 ** 2, int(0.9 * 4096 ** 2), 40960)
    assert ds["stage3_max_reuse_distance"] == 10**9  # DeepSpeed's default, written (pretrain estimate counts by it)
    cfg = load_config(None, ["distributed.reduce_bucket_size=1000", "distributed.prefetch_bucket_size=500",
                             "distributed.param_persistence_threshold=0"])
    assert zero_sizes(cfg) == {"reduce_bucket_size": 1000, "prefetch_bucket_size": 500,
                               "param_persistence_threshold": 0}
