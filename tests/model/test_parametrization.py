"""muP and CompleteP in the model and the optimizer groups: multipliers, init, groups, the base
model unchanged, and the HF export's folding against transformers' LlamaForCausalLM."""

import dataclasses
import math

import pytest
import torch

from pretrain.config import load_config
from pretrain.hf.mapping import fold_multipliers, to_hf_config, to_hf_state_dict
from pretrain.model.args import PRESETS, ModelArgs
from pretrain.model.model import Transformer
from pretrain.optim.optimizer import param_groups

transformers = pytest.importorskip("transformers")


def args_of(**kw) -> ModelArgs:
    base = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
    return ModelArgs(**{**base, **kw})


MUP = dict(parametrization="mup", mup_base_dim=32, mup_base_head_dim=8)  # head_dim grown 8 -> 32
COMPLETEP = dict(parametrization="completep", mup_base_dim=32, mup_base_layers=2, mup_base_head_dim=32)


def test_multipliers():
    a = args_of(**{**COMPLETEP, "mup_base_head_dim": 8})  # m = 4, m_L = 2, head_dim 32 grown from 8
    assert (a.width_mult, a.depth_mult) == (4.0, 2.0)
    assert a.attn_scale == pytest.approx(math.sqrt(8) / 32)
    assert (a.residual_scale, a.logit_scale) == (0.5, 0.25)
    assert a.hidden_init_std == pytest.approx(0.02 / 2)
    assert a.out_init_std == pytest.approx(0.02 / 2 / math.sqrt(2 * 2))  # the base depth's sqrt(2L)
    m = args_of(**MUP)
    assert m.depth_mult == 1.0 and m.residual_scale == 1.0
    assert m.out_init_std == pytest.approx(0.02 / 2 / math.sqrt(2 * 4))
    sp = args_of(mup_base_dim=32, mup_base_layers=2)  # base fields are ignored under sp
    assert (sp.width_mult, sp.attn_scale, sp.residual_scale, sp.logit_scale) == (1.0, None, 1.0, 1.0)
    assert sp.hidden_init_std == 0.02 and sp.out_init_std == 0.02 / math.sqrt(8)
    # heads added at a fixed head_dim: the scale stays 1/sqrt(head_dim)
    wide = args_of(dim=256, n_heads=8, n_kv_heads=2, parametrization="mup", mup_base_dim=128, mup_base_head_dim=32)
    assert wide.attn_scale == pytest.approx(1 / math.sqrt(32))


@pytest.mark.parametrize("bad,message", [
    (dict(parametrization="mu-p"), "is not one of sp, mup, completep"),
    (dict(parametrization="mup"), "needs model.mup_base_dim"),
    (dict(parametrization="completep", mup_base_dim=32), "needs model.mup_base_layers"),
    # 0 silently meant "this model's head_dim": a family growing head_dim got sp's attention scale
    (dict(parametrization="mup", mup_base_dim=32), "model.parametrization=mup at model.dim=128 (not the base's 32) "
     "needs model.mup_base_head_dim: the base's head_dim (model.mup_base_head_dim=32 if the family grows by heads"),
])
def test_parametrization_problems(bad, message):
    assert any(message in p for p in args_of(**bad).problems())


def _init_stds(args):
    model = Transformer(args)
    torch.manual_seed(0)
    model.init_weights()
    sd = model.state_dict()
    return {k: sd[k].std().item() for k in ("tok_embeddings.weight", "layers.0.attention.wq.weight",
                                            "layers.0.attention.wo.weight", "layers.0.feed_forward.w2.weight",
                                            "output.weight")}


def test_init_follows_the_parametrization():
    args = args_of(dim=512, n_heads=8, **MUP)  # m = 16
    stds = _init_stds(args)
    assert stds["tok_embeddings.weight"] == pytest.approx(0.02, rel=0.02)
    assert stds["output.weight"] == pytest.approx(0.02, rel=0.02)
    assert stds["layers.0.attention.wq.weight"] == pytest.approx(0.02 / 4, rel=0.02)
    assert stds["layers.0.attention.wo.weight"] == pytest.approx(0.02 / 4 / math.sqrt(8), rel=0.03)
    # w2 by its own fan-in multiplier: SwiGLU widths 1376 / 96 (multiple_of 32), not m = 16
    assert args.ffn_width_mult == pytest.approx(1376 / 96)
    assert stds["layers.0.feed_forward.w2.weight"] == pytest.approx(0.02 / math.sqrt(1376 / 96) / math.sqrt(8), rel=0.03)


def test_sp_is_unchanged_and_the_base_model_is_the_same_in_every_parametrization():
    """Under sp the base fields change nothing, bitwise; mup and completep at their base shape draw
    the same weights and compute the same logits (the attention scale is 1/sqrt(head_dim) there)."""
    tokens = torch.randint(0, 256, (2, 40))
    outs = {}
    for name, kw in {"sp": {}, "sp+fields": dict(mup_base_dim=64, mup_base_layers=2),
                     "mup": dict(parametrization="mup", mup_base_dim=128),
                     "completep": dict(parametrization="completep", mup_base_dim=128, mup_base_layers=4)}.items():
        model = Transformer(args_of(**kw))
        torch.manual_seed(3)
        model.init_weights()
        with torch.no_grad():
            outs[name] = (model.state_dict(), model(tokens))
    for name in ("sp+fields", "mup", "completep"):
        sd, logits = outs[name]
        assert all(torch.equal(sd[k], v) for k, v in outs["sp"][0].items()), name
        if name == "sp+fields":
            assert torch.equal(logits, outs["sp"][1])
        else:
            torch.testing.assert_close(logits, outs["sp"][1], rtol=0, atol=1e-6)


def _groups(args, **opt):
    cfg = load_config(None, [f"optimizer.{k}={v}" for k, v in {"weight_decay": 0.1, "eps": 1e-8, **opt}.items()])
    model = Transformer(args)
    names = {id(p): n for n, p in model.named_parameters()}
    return [({names[id(p)] for p in g["params"]}, {k: v for k, v in g.items() if k != "params"})
            for g in param_groups(model, cfg.optimizer)]


def test_optimizer_groups():
    sp = _groups(args_of())
    assert [g for _, g in sp] == [{"lr_scale": 1.0, "eps": 1e-8, "weight_decay": 0.1},
                                  {"lr_scale": 1.0, "eps": 1e-8, "weight_decay": 0.0}]
    assert "output.weight" in sp[0][0] and {"tok_embeddings.weight", "norm.weight"} <= sp[1][0]

    groups = _groups(args_of(**COMPLETEP))  # m = 4, m_L = 2; w2's fan-in 352 / 96 (multiple_of 32)
    by_name = {n: g for names, g in groups for n in names}
    hidden, w2 = by_name["layers.1.attention.wq.weight"], by_name["layers.1.feed_forward.w2.weight"]
    assert hidden["lr_scale"] == 0.25 and hidden["weight_decay"] == pytest.approx(0.4)
    assert hidden["eps"] == pytest.approx(1e-8 / 8)
    r = 352 / 96
    assert w2 == {"lr_scale": pytest.approx(1 / r), "eps": pytest.approx(1e-8 / 8), "weight_decay": pytest.approx(0.1 * r)}
    # every role's eps / m (its gradient shrinks as 1/m), hidden matrices' and norms' / m_L too
    assert by_name["output.weight"] == {"lr_scale": 1.0, "eps": pytest.approx(2.5e-9), "weight_decay": 0.1}
    assert by_name["tok_embeddings.weight"] == {"lr_scale": 1.0, "eps": pytest.approx(2.5e-9), "weight_decay": 0.0}
    assert by_name["layers.0.attention_norm.weight"] == {"lr_scale": 1.0, "eps": pytest.approx(1.25e-9),
                                                         "weight_decay": 0.0}
    # every attention matrix and w1, w3 in the hidden group, every w2 in its own, nothing twice
    assert all(by_name[n] is hidden for n in by_name if ".attention.w" in n or ".feed_forward.w1" in n
               or ".feed_forward.w3" in n)
    assert all(by_name[n] is w2 for n in by_name if ".feed_forward.w2" in n)
    assert sum(len(names) for names, _ in groups) == len(by_name) == len(list(Transformer(args_of()).parameters()))
    mup = {n: g for names, g in _groups(args_of(**MUP)) for n in names}
    assert mup["layers.0.attention_norm.weight"]["eps"] == 2.5e-9 and mup["layers.0.attention.wq.weight"]["eps"] == 2.5e-9
    # where w2's fan-in grows as dim does (512 / 128 = 128 / 32), it shares the hidden group
    even = {n: g for names, g in _groups(args_of(ffn_hidden_dim=512, parametrization="mup", mup_base_dim=32,
                                                 mup_base_head_dim=32, mup_base_hidden_dim=128)) for n in names}
    assert even["layers.0.feed_forward.w2.weight"] is even["layers.0.attention.wq.weight"]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kw", [MUP, COMPLETEP, dict(COMPLETEP, tie_embeddings=True)], ids=["mup", "completep", "tied"])
def test_folded_export_gives_our_logits_in_hf(kw, attn):
    args = args_of(**kw)
    ours = Transformer(args)
    torch.manual_seed(0)
    ours.init_weights()
    with torch.no_grad():  # trained-like weights: multipliers must matter everywhere
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * p.std().clamp(min=0.05))
    state, sp_args = fold_multipliers(ours.state_dict(), args)
    assert sp_args.parametrization == "sp" and not sp_args.tie_embeddings
    cfg = to_hf_config(sp_args)
    cfg._attn_implementation = attn
    hf = transformers.LlamaForCausalLM(cfg).float().eval()
    hf.load_state_dict(to_hf_state_dict(state, sp_args), strict=True)
    tokens = torch.randint(0, 256, (2, 48))
    with torch.no_grad():
        ref = ours(tokens)
        torch.testing.assert_close(hf(tokens).logits, ref, rtol=0, atol=1e-5)
        plain = Transformer(dataclasses.replace(args, parametrization="sp", tie_embeddings=False))
        plain.load_state_dict({k: v for k, v in ours.state_dict().items()} | {"output.weight": ours.output.weight},
                              strict=True)
        assert (plain(tokens) - ref).abs().max() > 0.1  # unfolded, the multipliers would be missed
    with pytest.raises(ValueError, match="fold its multipliers first"):
        to_hf_config(args)


def test_a_hugging_face_start_is_refused_under_mup(tmp_path):
    """An HF model's weights are sp: fine-tuning it under mup would run another model."""
    from pretrain.build import hf_model_args
    from pretrain.errors import ConfigError

    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(to_hf_config(args_of())).save_pretrained(hf)
    cfg = load_config(None, ["model.parametrization=mup", "model.mup_base_dim=64", "model.mup_base_head_dim=64",
                             f"checkpoint.init_from={hf}"])
    with pytest.raises(ConfigError, match="is a Hugging Face model, whose weights are in the standard parametrization"):
        hf_model_args(cfg)
    assert hf_model_args(load_config(None, [f"checkpoint.init_from={hf}"])).parametrization == "sp"  # accepted


@pytest.mark.parametrize("shape", [
    dict(dim=512, n_heads=16, n_kv_heads=8, multiple_of=64),  # SwiGLU 1408 from 192: 7.33, m = 8
    dict(dim=512, n_heads=16, n_kv_heads=8, multiple_of=256, ffn_hidden_dim=1792),  # explicit: 1792 / 256 = 7
], ids=["multiple_of", "ffn_hidden_dim"])
def test_every_matrix_takes_microsofts_rate_and_decay(shape):
    """microsoft/mup's MuAdamW, its base shapes set from our model at the base width (64, grown by
    heads as the planner grows it), gives each matrix lr / (its fan-in / the base's) and decay x
    that ratio: ours are the same for every matrix, w2 included (its rate was lr / m before, 9% off
    here; 18.7 against 16 for the 7b preset from a 256-wide base). Vectors and the head keep lr."""
    mup = pytest.importorskip("mup")
    from pretrain.scaling.plan import grown

    args = args_of(**shape, parametrization="mup", mup_base_dim=64, mup_base_head_dim=32, vocab_size=512)
    model, base = Transformer(args), Transformer(grown(args, args.n_layers, 1))
    assert base.args.dim == 64
    mup.set_base_shapes(model, base, do_assert=False)  # (do_assert asks for its MuReadout head; ours is plain)
    cfg = load_config(None, ["optimizer.weight_decay=0.1"])
    theirs = {id(p): g for g in mup.MuAdamW(model.parameters(), lr=1.0, weight_decay=0.1).param_groups
              for p in g["params"]}
    ours = {id(p): g for g in param_groups(model, cfg.optimizer) for p in g["params"]}
    for name, p in model.named_parameters():
        assert ours[id(p)]["lr_scale"] == pytest.approx(theirs[id(p)]["lr"], rel=1e-12), name
        if p.ndim == 2 and "tok_embeddings" not in name:  # (we decay neither norms nor, by default, embeddings)
            assert ours[id(p)]["weight_decay"] == pytest.approx(theirs[id(p)]["weight_decay"], rel=1e-12), name
    seven_b = ModelArgs(**PRESETS["7b"], parametrization="mup", mup_base_dim=256, mup_base_head_dim=128)
    assert seven_b.ffn_width_mult == pytest.approx(14336 / 768) and seven_b.width_mult == 16


def test_every_roles_gradient_shrinks_as_one_over_m():
    """Why every role's Adam eps is eps / m under muP: at widths 64-512 (grown by heads, as the
    planner grows them) the RMS gradient of every role, the embedding, head and norm gains
    included, falls as 1/m (log-log slopes near -1), so an eps kept at the base's would weigh m
    times more in a wide model's update."""
    from pretrain.mup import slope
    from pretrain.optim.optimizer import role
    from pretrain.scaling.plan import grown

    base = args_of(dim=64, n_heads=2, n_kv_heads=1, multiple_of=64, parametrization="mup", mup_base_dim=64,
                   mup_base_head_dim=32, vocab_size=512)
    widths, rms = [64, 128, 256, 512], {}
    tokens = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    for w in widths:
        per_role = {}
        for seed in range(2):
            torch.manual_seed(seed)
            model = Transformer(grown(base, base.n_layers, w // 64))
            model.init_weights()
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            for name, p in model.named_parameters():
                per_role.setdefault(role(name, p.ndim), []).append(p.grad.pow(2).mean().item())
        for r, sq in per_role.items():
            rms.setdefault(r, []).append((sum(sq) / len(sq)) ** 0.5)
    slopes = {r: slope(widths, v) for r, v in rms.items()}
    print("gradient RMS slopes against width:", {r: round(s, 3) for r, s in slopes.items()})
    assert set(slopes) == {"hidden", "ffn_out", "head", "embedding", "norm"}
    for r, s in slopes.items():
        assert s == pytest.approx(-1.0, abs=0.15), (r, slopes)
