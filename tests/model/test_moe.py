"""pretrain/model/moe.py against transformers' Mixtral (its sparse block and
load_balancing_loss_func), the dense model at E = 1, k = 1, and the routing's own rules (dropless,
shared experts, the sigmoid router, DeepSeek-V3's bias, the grouped kernel against the loop)."""

import dataclasses

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from pretrain.model import moe as moe_module
from pretrain.model.args import ModelArgs
from pretrain.model.model import Transformer
from pretrain.model.moe import MoE

TINY = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=32)


def moe_args(**kw) -> ModelArgs:
    return dataclasses.replace(TINY, **{"moe_experts": 4, "moe_top_k": 2, "moe_hidden_dim": 24, **kw})


def built(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def test_one_expert_of_one_is_the_dense_model():
    dense = built(TINY)
    moe = built(moe_args(moe_experts=1, moe_top_k=1, moe_hidden_dim=TINY.hidden_dim, moe_aux_loss=0.0))
    state = dense.state_dict()
    for i in range(TINY.n_layers):
        for w in ("w1", "w2", "w3"):
            state[f"layers.{i}.feed_forward.experts.{w}"] = state.pop(f"layers.{i}.feed_forward.{w}.weight")[None]
        state[f"layers.{i}.feed_forward.router.weight"] = moe.state_dict()[f"layers.{i}.feed_forward.router.weight"]
        state[f"layers.{i}.feed_forward.expert_bias"] = torch.zeros(1)
    moe.load_state_dict(state)
    tokens = torch.randint(0, 64, (2, 16))
    assert torch.equal(moe(tokens), dense(tokens))
    assert torch.equal(moe(tokens[:, :-1], labels=tokens[:, 1:]), dense(tokens[:, :-1], labels=tokens[:, 1:]))


def _mixtral_block(layer: MoE, args: ModelArgs):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=args.dim, intermediate_size=args.moe_expert_hidden_dim,
                           num_local_experts=args.moe_experts, num_experts_per_tok=args.moe_top_k)
    block = MixtralSparseMoeBlock(config).eval()
    with torch.no_grad():
        block.gate.weight.copy_(layer.router.weight)
        block.experts.gate_up_proj.copy_(torch.cat([layer.experts.w1, layer.experts.w3], dim=1))
        block.experts.down_proj.copy_(layer.experts.w2)
    return block


@pytest.mark.parametrize("experts, k", [(4, 2), (8, 1), (8, 3)])
def test_the_block_is_mixtrals_sparse_block(experts, k):
    """Softmax router, top-k renormalised: Mixtral's sparse block with the same weights."""
    args = moe_args(moe_experts=experts, moe_top_k=k)
    layer = built(args).layers[0].feed_forward
    x = torch.randn(3, 10, args.dim)
    with torch.no_grad():
        want = _mixtral_block(layer, args)(x)
        got = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_balancing_loss_is_load_balancing_loss_func():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    args = moe_args(moe_experts=8, moe_top_k=2)
    layer = built(args).layers[0].feed_forward
    x = torch.randn(4, 16, args.dim)
    layer(x)
    logits = torch.nn.functional.linear(x.reshape(-1, args.dim), layer.router.weight)
    aux = layer.aux_loss()
    want = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    torch.testing.assert_close(layer.stats["balance_loss"], want)
    torch.testing.assert_close(aux, args.moe_aux_loss * want + args.moe_z_loss * torch.logsumexp(logits, -1).square().mean())
    # A perfectly balanced router scores k (f_i = k / E, P_i = 1 / E).
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(x)
    layer.aux_loss()
    assert layer.stats["balance_loss"].item() == pytest.approx(2.0)


def test_the_training_loss_adds_each_moe_blocks_aux_loss_and_eval_does_not():
    args = moe_args(moe_z_loss=1e-3, moe_dense_layers=1, n_layers=3)
    model = built(args)
    tokens = torch.randint(0, 64, (2, 17))
    loss = model(tokens[:, :-1], labels=tokens[:, 1:])
    layers = model.moe_layers()
    assert len(layers) == 2 and not isinstance(model.layers[0].feed_forward, MoE)
    aux = sum(layer.aux_coef * layer.stats["balance_loss"] + layer.z_coef * layer.stats["z_loss"] for layer in layers)
    with torch.no_grad():
        plain = model(tokens[:, :-1], labels=tokens[:, 1:])
    torch.testing.assert_close(loss.detach(), plain + aux)
    assert aux > 0.01  # (each block's balance loss is >= 1 at k = 2: 0.01 x 2 blocks at least)


def test_the_counts_are_reduced_where_the_parallel_wing_says():
    """f_i over the global batch: `reduce_counts` (an all-reduce in training) sees the counts and
    the token count, and the loss uses what it returns."""
    args = moe_args()
    layer = built(args).layers[1].feed_forward
    seen = []
    layer.reduce_counts = lambda t: seen.append(t.clone()) or t * 3  # three ranks alike
    layer(torch.randn(2, 8, args.dim))
    layer.aux_loss()
    assert seen[0][-1] == 16 and seen[0][:-1].sum() == 32  # 16 tokens, 2 experts each
    torch.testing.assert_close(layer.stats["counts"], seen[0][:-1] * 3)


def test_no_token_is_dropped_however_unbalanced():
    """Every token goes to k experts even when the router sends all of them to the same ones (no
    capacity): the output is those experts' weighted sum for every token."""
    args = moe_args(moe_experts=4, moe_top_k=2)
    layer = built(args).layers[0].feed_forward
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = layer.router.weight[1, 0] = 5.0  # a positive first feature: experts 0 and 1
    x = torch.randn(64, args.dim)
    x[:, 0] = x[:, 0].abs() + 1
    with torch.no_grad():
        y = layer(x)
        swiglu = lambda e: torch.nn.functional.linear(  # noqa: E731
            torch.nn.functional.silu(x @ layer.experts.w1[e].T) * (x @ layer.experts.w3[e].T), layer.experts.w2[e])
        torch.testing.assert_close(y, 0.5 * swiglu(0) + 0.5 * swiglu(1))
    assert layer.routed["counts"].tolist() == [64, 64, 0, 0]


def test_shared_experts_see_every_token():
    args = moe_args(moe_shared_experts=2)
    layer = built(args).layers[0].feed_forward
    assert layer.shared.w1.weight.shape == (2 * 24, args.dim)
    x = torch.randn(2, 5, args.dim)
    with torch.no_grad():
        y = layer(x)
        shared, layer.shared = layer.shared, None
        torch.testing.assert_close(y, layer(x) + shared(x))


def test_the_sigmoid_router_and_the_bias_only_select():
    """Sigmoid scores; the bias changes which experts are chosen, not their weights (the unbiased
    scores, renormalised); an update moves it towards the mean load."""
    args = moe_args(moe_router="sigmoid", moe_experts=4, moe_top_k=1, moe_norm_topk=False, moe_bias_rate=0.1)
    layer = built(args).layers[0].feed_forward
    x = torch.randn(32, args.dim)
    logits, _, chosen, weights = layer.route(x)
    torch.testing.assert_close(weights[:, 0], logits.sigmoid().gather(1, chosen)[:, 0])
    layer.expert_bias[:] = torch.tensor([10.0, 0, 0, 0])
    _, _, chosen, biased = layer.route(x)
    assert (chosen == 0).all()
    torch.testing.assert_close(biased[:, 0], logits.sigmoid()[:, 0])
    layer.update_bias(torch.tensor([32, 0, 0, 0]), rate=0.1)
    torch.testing.assert_close(layer.expert_bias, torch.tensor([9.9, 0.1, 0.1, 0.1]))


def test_a_cast_keeps_the_bias_fp32():
    model = built(moe_args(moe_bias_rate=1e-3)).to(torch.bfloat16)
    layer = model.layers[0].feed_forward
    assert layer.experts.w1.dtype == torch.bfloat16 and layer.expert_bias.dtype == torch.float32
    assert "layers.0.feed_forward.expert_bias" in model.state_dict()  # (in checkpoints: a resume selects alike)


def test_the_grouped_kernel_computes_what_the_loop_does(monkeypatch):
    """torch._grouped_mm (CUDA's path; its forward runs on CPU) against the loop over experts."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is not in this torch")
    args = moe_args(moe_experts=4, moe_top_k=2, dim=64, moe_hidden_dim=32)
    layer = built(args).layers[0].feed_forward
    x = torch.randn(40, 64)
    with torch.no_grad():
        loop = layer(x)
        monkeypatch.setattr(moe_module, "grouped_mm_available", lambda x: True)
        grouped = layer(x)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_recomputes_the_same_loss_and_gradients():
    """A checkpointed block's aux loss is read once, after the block; its gradients are those of the
    plain model."""
    args = moe_args(moe_z_loss=1e-3)
    tokens = torch.randint(0, 64, (2, 17))
    grads = []
    for ac in (False, True):
        model = built(args)
        if ac:
            for block in model.layers:
                block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
        seen = []
        for layer in model.moe_layers():
            layer.reduce_counts = lambda t, seen=seen: seen.append(1) or t
        model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
        assert len(seen) == 2  # once per block, not again in the recomputation
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)
    assert grads[0]["layers.0.feed_forward.router.weight"].abs().sum() > 0


@pytest.mark.parametrize("change, named", [
    ({"moe_top_k": 5}, "model.moe_top_k=5 must be between 1 and model.moe_experts=4"),
    ({"moe_router": "relu"}, "model.moe_router='relu' is not one of softmax, sigmoid"),
    ({"moe_dense_layers": 2}, "leave at least one of model.n_layers=2 blocks"),
    ({"moe_aux_loss": -1.0}, "must be finite and >= 0"),
    ({"parametrization": "mup", "mup_base_dim": 32}, "muP's rules for experts are not derived"),
])
def test_an_impossible_moe_is_named(change, named):
    assert any(named in p for p in moe_args(**change).problems()), moe_args(**change).problems()


def test_parameter_counts_total_and_active():
    """num_params counts every expert; active=True the k a token goes through (what FLOPs and MFU use)."""
    from pretrain.model.model import flops_per_token, matmul_params, num_params

    args = moe_args(moe_experts=8, moe_top_k=2, moe_shared_experts=1, moe_dense_layers=1, n_layers=3)
    model = built(args)
    assert num_params(args) == sum(p.numel() for p in model.parameters())
    one_expert = 3 * args.dim * 24
    assert num_params(args) - num_params(args, active=True) == 2 * (8 - 2) * one_expert  # two MoE blocks
    dense = dataclasses.replace(TINY, n_layers=3)
    assert matmul_params(args) - matmul_params(dense) == 2 * (args.dim * 8 + 3 * one_expert - 3 * args.dim * TINY.hidden_dim)
    assert flops_per_token(args, 32) - flops_per_token(dense, 32) == 6 * (matmul_params(args) - matmul_params(dense))
