"""The per-layer description (pretrain/model/args.py): each option against a dense reference written
here from the papers' and Hugging Face's definitions (plain torch, no code of the model), and against
the same weights with the option off, so that an option made a no-op fails; sliding windows with
document masks through FlexAttention block masks and the dense mask; generation past the window with
the KV cache; the output z-loss; bad descriptions in one line. (Hugging Face parity of the families
built from these pieces: tests/model/test_hf_families.py.)"""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import data_pipeline as dp
import pretrain.model.attention as attention_module
from pretrain.config import load_config
from pretrain.errors import ConfigError
from pretrain.model.args import ModelArgs
from pretrain.model.attention import KVCache
from pretrain.model.model import Transformer, num_params

V = 96


def tiny(**kw) -> ModelArgs:
    base = dict(dim=48, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=V, multiple_of=16, max_seq_len=64)
    return ModelArgs(**{**base, **kw})


def build(args: ModelArgs, seed: int = 0) -> Transformer:
    """Initialised, then every vector (norms, biases, sinks, an MoE's expert biases) moved off its
    init, so that a norm's weight, a bias or a sink skipped changes the output."""
    model = Transformer(args)
    torch.manual_seed(seed)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or ".experts.b" in name:  # (an MoE's expert biases: (E, ...))
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


# -- the reference: a dense forward from the definitions --------------------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _norms_of(sd: dict, offset: float) -> dict:
    return {k: v + offset if k.endswith("norm.weight") else v for k, v in sd.items()}


def _rope(x, theta, rd, pos):
    """x (B, T, h, hd): the first rd dims rotated, pairs (i, i + rd/2), positions pos (T,)."""
    inv = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = pos[:, None].double() * inv  # (T, rd/2)
    cos, sin = ang.cos()[:, None].float(), ang.sin()[:, None].float()
    r, rest = x[..., :rd], x[..., rd:]
    x1, x2 = r.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def reference_logits(model: Transformer, tokens: torch.Tensor, documents: torch.Tensor | None = None):
    a, sd = model.args, {k: v.float() for k, v in model.state_dict().items()}
    sd = _norms_of(sd, 1.0 if a.norm_unit_offset else 0.0)  # (Gemma's norms: x (1 + w))
    B, T = tokens.shape
    H, KV, hd, eps = a.n_heads, a.kv_heads, a.head_dim, a.norm_eps
    pos = torch.arange(T)
    lim, alpha = a.swiglu_limit, a.swiglu_alpha
    glu = {"silu": lambda g, u: F.silu(g) * u, "gelu_tanh": lambda g, u: F.gelu(g, approximate="tanh") * u,
           "clamped_swiglu": lambda g, u: g.clamp(max=lim) * torch.sigmoid(g.clamp(max=lim) * alpha)
           * (u.clamp(-lim, lim) + 1)}[a.ffn_activation]
    pre, post = a.norm_placement in ("pre", "sandwich"), a.norm_placement in ("post", "sandwich")

    def lin(x, name):
        return x @ sd[name + ".weight"].T + (sd[name + ".bias"] if name + ".bias" in sd else 0)

    h = sd["tok_embeddings.weight"][tokens] * a.embed_scale
    for i in range(a.n_layers):
        p = f"layers.{i}."
        x = _rms(h, sd[p + "attention_norm.weight"], eps) if pre else h
        q, k, v = lin(x, p + "attention.wq"), lin(x, p + "attention.wk"), lin(x, p + "attention.wv")
        if a.qk_norm == "projection":
            q, k = _rms(q, sd[p + "attention.q_norm.weight"], eps), _rms(k, sd[p + "attention.k_norm.weight"], eps)
        q, k, v = q.view(B, T, H, hd), k.view(B, T, KV, hd), v.view(B, T, KV, hd)
        if a.qk_norm == "head":
            q, k = _rms(q, sd[p + "attention.q_norm.weight"], eps), _rms(k, sd[p + "attention.k_norm.weight"], eps)
        local = a.layer_pattern and a.layer_pattern[i % len(a.layer_pattern)] == "local"
        if not (a.nope_period and (i + 1) % a.nope_period == 0):
            theta = a.rope_local_theta if local and a.rope_local_theta else a.rope_theta
            rd = 2 * int(hd * a.rope_fraction / 2)
            q, k = _rope(q, theta, rd, pos), _rope(k, theta, rd, pos)
        k, v = k.repeat_interleave(H // KV, dim=2), v.repeat_interleave(H // KV, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(a.query_scale_dim or hd)  # (B, H, T, S)
        allowed = pos[None, :] <= pos[:, None]
        if local:
            allowed = allowed & (pos[:, None] - pos[None, :] < a.sliding_window)
        allowed = allowed.expand(B, 1, T, T)
        if documents is not None:
            allowed = allowed & (documents[:, None, :, None] == documents[:, None, None, :])
        scores = scores.masked_fill(~allowed, float("-inf"))
        if a.attn_sinks:
            sink = sd[p + "attention.sinks"][None, :, None, None].expand(B, H, T, 1)
            probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        o = lin(torch.einsum("bhts,bshd->bthd", probs, v).reshape(B, T, H * hd), p + "attention.wo")
        h = h + (_rms(o, sd[p + "attention_out_norm.weight"], eps) if post else o)
        x = _rms(h, sd[p + "ffn_norm.weight"], eps) if pre else h
        if a.is_moe_layer(i):
            f = _moe_reference(x.flatten(0, 1), sd, p + "feed_forward.", a, glu).view_as(x)
        else:
            f = lin(glu(lin(x, p + "feed_forward.w1"), lin(x, p + "feed_forward.w3")), p + "feed_forward.w2")
        h = h + (_rms(f, sd[p + "ffn_out_norm.weight"], eps) if post else f)
    h = _rms(h, sd["norm.weight"], eps)
    return h @ sd.get("output.weight", sd["tok_embeddings.weight"]).T


def _moe_reference(x, sd, p, a, glu):
    """Every token through its top k experts by a softmax router (with its bias), weights renormalised
    over the k; each expert glu(w1 x + b1, w3 x + b3) w2 + b2, the biases where the model has them."""
    logits = x @ sd[p + "router.weight"].T + sd.get(p + "router.bias", 0)
    probs = logits.softmax(-1)
    top, chosen = probs.topk(a.moe_top_k, -1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for n in range(x.size(0)):
        for weight, e in zip(top[n], chosen[n].tolist()):
            def b(name, e=e):
                return sd[p + f"experts.{name}"][e] if p + f"experts.{name}" in sd else 0
            h = glu(sd[p + "experts.w1"][e] @ x[n] + b("b1"), sd[p + "experts.w3"][e] @ x[n] + b("b3"))
            out[n] += weight * (sd[p + "experts.w2"][e] @ h + b("b2"))
    return out


# Each option, and the value that turns it off with the same weights (None: the weights differ).
WINDOWED = dict(layer_pattern=["local", "local", "global"], sliding_window=5)
MOE = dict(moe_experts=4, moe_top_k=2, moe_hidden_dim=16, moe_dense_layers=1)
OPTIONS = {
    "head_size": (dict(head_size=16), None),
    "qk_norm_head": (dict(qk_norm="head"), None),
    "qk_norm_projection": (dict(qk_norm="projection"), None),
    "post_norm": (dict(norm_placement="post"), None),
    "sandwich_norm": (dict(norm_placement="sandwich"), None),
    "qkv_bias": (dict(qkv_bias=True), None),
    "attn_out_bias": (dict(attn_out_bias=True), None),
    "sliding_window": (WINDOWED, dict(layer_pattern=[], sliding_window=0)),
    "rope_local_theta": (dict(WINDOWED, rope_local_theta=100.0), dict(rope_local_theta=0.0)),
    "nope_period": (dict(nope_period=2), dict(nope_period=0)),
    "rope_fraction": (dict(rope_fraction=0.5), dict(rope_fraction=1.0)),
    "attn_sinks": (dict(attn_sinks=True), None),
    "gelu_tanh": (dict(ffn_activation="gelu_tanh"), dict(ffn_activation="silu")),
    "embed_scale": (dict(embed_scale=4.0, tie_embeddings=True), dict(embed_scale=1.0)),
    "norm_unit_offset": (dict(norm_unit_offset=True, qk_norm="head", norm_placement="sandwich"),
                         dict(norm_unit_offset=False)),
    "query_scale_dim": (dict(query_scale_dim=5), dict(query_scale_dim=0)),
    # GPT-OSS's feed-forward: the clamped SwiGLU (a limit of 0.5 that the activations reach), its MoE's
    # router and expert biases
    "clamped_swiglu": (dict(ffn_activation="clamped_swiglu", swiglu_limit=0.5, swiglu_alpha=1.5),
                       dict(swiglu_limit=100.0)),
    "swiglu_alpha": (dict(ffn_activation="clamped_swiglu", swiglu_alpha=3.0), dict(swiglu_alpha=1.702)),
    "moe_biases": (dict(MOE, moe_router_bias=True, moe_expert_bias=True, ffn_activation="clamped_swiglu"), None),
    "everything": (dict(WINDOWED, head_size=16, qk_norm="head", norm_placement="sandwich", qkv_bias=True,
                        attn_out_bias=True, rope_local_theta=100.0, nope_period=4, rope_fraction=0.5, attn_sinks=True,
                        ffn_activation="gelu_tanh", embed_scale=2.0, norm_unit_offset=True, query_scale_dim=20), None),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_each_option_computes_its_definition(name):
    """The model's logits equal the reference's for every option (T = 20 > the window of 5)."""
    on, off = OPTIONS[name]
    model = build(tiny(**on))
    tokens = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(tokens)
    torch.testing.assert_close(out, reference_logits(model, tokens), rtol=1e-4, atol=1e-4)
    if off is not None:  # the same weights with the option off compute something else
        other = Transformer(dataclasses.replace(model.args, **off))
        other.load_state_dict(model.state_dict())
        with torch.no_grad():
            assert (other.eval()(tokens) - out).abs().max() > 1e-3
    if name == "attn_sinks":  # sinks at zero are another model (the trained value matters)
        with torch.no_grad():
            for layer in model.layers:
                layer.attention.sinks.zero_()
            assert (model(tokens) - out).abs().max() > 1e-3


def test_the_parameters_each_option_adds_are_counted_and_named():
    for on, _ in OPTIONS.values():
        model = Transformer(tiny(**on))
        assert num_params(model.args) == sum(p.numel() for p in model.parameters()), on
    names = set(Transformer(tiny(**OPTIONS["everything"][0])).state_dict())
    for name in ("layers.0.attention.q_norm.weight", "layers.0.attention.k_norm.weight", "layers.0.attention.wq.bias",
                 "layers.0.attention.wo.bias", "layers.0.attention.sinks", "layers.0.attention_out_norm.weight",
                 "layers.0.ffn_out_norm.weight"):
        assert name in names
    assert not any("norm" in n and "attention_norm" not in n and "ffn_norm" not in n and n != "norm.weight"
                   for n in Transformer(tiny()).state_dict())  # (the Llama block has no other norm)


@pytest.mark.parametrize("sinks", [False, True])
def test_windows_with_documents_equal_the_dense_reference_through_flex_and_sdpa(monkeypatch, sinks):
    """Packed documents and sliding windows together: FlexAttention's block masks (the GPU path, run
    eager here) and the dense masks give the reference's logits; so does the structured (no
    document) block mask of the windowed layers."""
    args = tiny(**WINDOWED, document_mask=True, eot_id=0, attn_sinks=sinks)
    model = build(args)
    tokens = torch.randint(1, V, (2, 32), generator=torch.Generator().manual_seed(2))
    tokens[0, [6, 17]] = 0
    tokens[1, [3]] = 0
    inputs = dp.document_inputs(tokens, 0, False)
    ref = reference_logits(model, tokens, inputs["documents"])
    for flex in (False, True):
        monkeypatch.setattr(attention_module, "FLEX_DEVICES", {"cpu"} if flex else set())
        with torch.no_grad():
            torch.testing.assert_close(model(tokens, **inputs), ref, rtol=1e-4, atol=1e-4)
    plain = build(tiny(**WINDOWED, attn_sinks=sinks))
    with torch.no_grad():
        dense = plain(tokens)
        monkeypatch.setattr(attention_module, "FLEX_DEVICES", {"cpu"})
        torch.testing.assert_close(plain(tokens), dense, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dense, reference_logits(plain, tokens), rtol=1e-4, atol=1e-4)


def test_generation_past_the_window_equals_the_full_forward():
    """Prefill then one token at a time with the KV cache, 40 tokens past a window of 5 (local and
    global layers, sinks, a NoPE layer): each step's logits are the full forward's at that position."""
    model = build(tiny(**OPTIONS["everything"][0]))
    tokens = torch.randint(0, V, (1, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.args, batch_size=1, max_len=48)
        steps = [model(tokens[:, :8], cache=cache, start_pos=0)]
        for t in range(8, 48):
            steps.append(model(tokens[:, t:t + 1], cache=cache, start_pos=t))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_the_z_loss_is_added_in_training_from_every_chunk_and_kept_apart():
    """loss = cross-entropy + z_loss x mean logsumexp^2 over the scored tokens, the same chunked; the
    z-loss alone in `output.last_z_loss`; evaluation (no grad) is the cross-entropy."""
    model = build(tiny(z_loss=1e-2))
    model.train()
    tokens = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(4))
    labels = tokens.roll(-1, dims=1)
    labels[:, -3:] = -100
    with torch.no_grad():
        logits = model(tokens).float()
    scored = labels != -100
    ce = F.cross_entropy(logits[scored], labels[scored])
    z = logits.logsumexp(-1)[scored].pow(2).mean()
    for chunk in (0, 7):
        loss = model(tokens, labels, loss_chunk=chunk)
        torch.testing.assert_close(loss.detach(), ce + 1e-2 * z, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model.output.last_z_loss, z, rtol=1e-5, atol=1e-5)
    loss.backward()  # (a gradient through both terms)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, labels), ce, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("override, named", [
    (["model.layer_pattern=[local,global]", "model.sliding_window=4096"], "model.sliding_window=4096 must be between 0 and model.max_seq_len"),
    (["model.layer_pattern=[local,glob]", "model.sliding_window=64"], "model.layer_pattern=['local', 'glob']: each entry is one of global, local"),
    (["model.layer_pattern=[local,global]"], "local layers but model.sliding_window is 0"),
    (["model.sliding_window=64"], "no local layer in model.layer_pattern"),
    (["model.qk_norm=heads"], "model.qk_norm='heads' is not one of none, head, projection"),
    (["model.norm_placement=postnorm"], "model.norm_placement='postnorm' is not one of pre, post, sandwich"),
    (["model.ffn_activation=gelu"], "model.ffn_activation='gelu' is not one of silu, gelu_tanh"),
    (["model.rope_fraction=0"], "model.rope_fraction=0.0 must be in (0, 1]"),
    (["model.head_size=-8"], "model.head_size=-8 must be >= 0"),
    (["model.qk_norm=head", "distributed.tensor_parallel=2"], "tensor_parallel=2 does not split model.qk_norm=head"),
])
def test_a_bad_description_is_one_line(override, named):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.vocab_size=256", "model.max_seq_len=1024", *override])
    assert named in str(e.value), str(e.value)


def test_the_cli_says_a_bad_description_in_one_line_with_exit_2(capsys):
    from pretrain.cli import main

    tiny_yaml = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
    assert main(["config", "show", tiny_yaml, "model.layer_pattern=[local,glob]", "model.sliding_window=8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.layer_pattern=['local', 'glob']: each entry is one of global, local" in err


def test_a_pattern_need_not_divide_the_layers():
    """Gemma 3 1B: 26 layers under a pattern of 6; the pattern repeats and the last block is local."""
    args = tiny(n_layers=5, layer_pattern=["local", "local", "global"], sliding_window=4)
    assert not args.problems()
    assert [args.layer_kind(i) for i in range(5)] == ["local", "local", "global", "local", "local"]


def test_flops_count_a_local_layers_window_not_the_whole_sequence():
    """6N + 12 H hd x (keys per query, summed over layers): T for a global layer (PaLM's full T x T, twice
    the causal half), twice the causal band for a local one, 2 W - W (W - 1) / T."""
    from pretrain.model.model import flops_per_token, matmul_params

    args = tiny(n_layers=4, layer_pattern=["local", "local", "local", "global"], sliding_window=16)
    full = dataclasses.replace(args, layer_pattern=[], sliding_window=0)
    attn = 12 * args.n_heads * args.head_dim
    band = sum(min(i + 1, 16) for i in range(64))  # query-key pairs of the causal window band at T = 64
    assert band == 16 * 64 - 16 * 15 // 2
    assert flops_per_token(args, 64) == 6 * matmul_params(args) + round(attn * (3 * 2 * band / 64 + 64))
    assert flops_per_token(full, 64) == 6 * matmul_params(args) + attn * 4 * 64
    assert flops_per_token(args, 8) == flops_per_token(full, 8)  # (a window past the sequence is the whole)


def test_every_recipe_field_is_a_resume_check_and_an_option_here():
    """A field of the description is listed once (args.RECIPE_FIELDS), and the resume checks, the HF
    families and the start from an HF model read it: each is shape or function, and each is tested above."""
    from pretrain.checkpoint.layout import FUNCTION_FIELDS, SHAPE_FIELDS
    from pretrain.model.args import RECIPE_FIELDS

    checked = {"head_size" if f == "head_dim" else f for f in SHAPE_FIELDS + FUNCTION_FIELDS}
    assert set(RECIPE_FIELDS) <= checked
    tested = {k for on, _ in OPTIONS.values() for k in on}
    assert set(RECIPE_FIELDS) <= tested
