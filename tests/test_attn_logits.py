"""logging.attn_logits (pretrain/metrics.py attention_logit_maxima): each layer's largest attention
logit equals a dense computation written here (every T x T logit of the q and k the layer uses,
masked by the definitions of causal, window and same-document), through SDPA's dense masks and
FlexAttention's block masks; planted logits in masked pairs are ignored and kept ones found; the
model is left as it was; and a 2-rank training run logs train/max_attn_logit at its log steps, the
same under ZeRO-3 as under ZeRO-0."""

import json
import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

import data_pipeline as dp
import pretrain.metrics as metrics
import pretrain.model.attention as attention_module
from pretrain.metrics import _max_logit, attention_logit_maxima
from pretrain.model.args import ModelArgs
from pretrain.model.attention import Attention
from pretrain.model.model import Transformer
from tests.helpers import run_train

V = 96


def tiny(**kw) -> ModelArgs:
    base = dict(dim=48, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=V, multiple_of=16, max_seq_len=64)
    return ModelArgs(**{**base, **kw})


def build(args: ModelArgs) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():  # larger q, k than at init: logits of a few units, that the masks decide
        for m in model.modules():
            if isinstance(m, Attention):
                m.wq.weight.mul_(8)
                m.wk.weight.mul_(8)
    return model.eval()


def reference_maxima(model: Transformer, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Each layer's max over heads and kept pairs of q.k x scale, all T x T at once."""
    out = []

    def hook(module, args):
        q, k, _ = module.qkv(args[0], args[1])  # (B, T, H, hd), (B, T, KV, hd)
        k = k.repeat_interleave(q.size(2) // k.size(2), dim=2)
        scale = module.scale if module.scale is not None else 1 / math.sqrt(module.head_dim)
        logits = torch.einsum("bthd,bshd->bhts", q, k) * scale  # (B, H, T, T)
        T = q.size(1)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        keep = (j <= i) & ((i - j < module.window) if module.window else True)
        if documents is not None:
            keep = keep & (documents[:, None, :, None] == documents[:, None, None, :])
        out.append(logits.masked_fill(~keep, -math.inf).amax())

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, Attention)]
    with torch.no_grad():
        model(tokens, **dp.document_inputs(tokens, model.args.document_eot, model.args.document_positions))
    for h in handles:
        h.remove()
    return torch.stack(out)


WINDOWED = dict(layer_pattern=["local", "global"], sliding_window=5)
CASES = {
    "llama": dict(),
    # (muP's softmax scale: sqrt(6) / 12, not 1 / sqrt(12))
    "qk_norm_window_scale": dict(qk_norm="head", parametrization="mup", mup_base_dim=24, mup_base_head_dim=6,
                                 **WINDOWED),
    "projection_norm_mha": dict(qk_norm="projection", n_kv_heads=0),
    "documents_window": dict(document_mask=True, eot_id=0, **WINDOWED),
}


@pytest.mark.parametrize("flex", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_maxima_equal_the_dense_computation(monkeypatch, case, flex):
    """Queries in blocks of 3 rows (the last one short), the layers' masks as SDPA's dense tensors
    and as FlexAttention's block masks (the GPU path, eager here)."""
    args = tiny(**CASES[case])
    model = build(args)
    tokens = torch.randint(1, V, (2, 32), generator=torch.Generator().manual_seed(1))
    tokens[0, [6, 17]] = 0  # (document ends where document_mask is on)
    tokens[1, 3] = 0
    documents = dp.document_inputs(tokens, args.document_eot, False).get("documents")
    expected = reference_maxima(model, tokens, documents)
    monkeypatch.setattr(attention_module, "FLEX_DEVICES", {"cpu"} if flex else set())
    monkeypatch.setattr(metrics, "ATTN_CHUNK_ELEMENTS", 2 * 4 * 32 * 3)  # B x H x S x 3 rows
    inputs = dp.document_inputs(tokens, args.document_eot, args.document_positions)
    maxima = attention_logit_maxima(model, lambda: model(tokens, **inputs))
    assert maxima.shape == (args.n_layers,)
    torch.testing.assert_close(maxima, expected, rtol=1e-5, atol=1e-5)


def test_masked_pairs_are_ignored_and_kept_ones_found():
    """Planted logits: a huge one just after the diagonal (a future key), one just outside the
    window, one in another document; the largest kept one sits on the window's edge."""
    B, T, H, KV, hd = 2, 12, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, T, H, hd, generator=g) * 0.1, torch.randn(B, T, KV, hd, generator=g) * 0.1

    def plant(b, t, s, head, value):  # q.k of pair (t, s) of query head `head` x scale becomes ~value
        q[b, t, head] = 0
        k[b, s, head // (H // KV)] = 0
        q[b, t, head, 0] = k[b, s, head // (H // KV), 0] = math.sqrt(value * math.sqrt(hd))

    plant(0, 5, 6, 3, 100.0)  # future key
    plant(1, 9, 4, 1, 90.0)  # 5 back: outside a window of 5
    plant(1, 9, 5, 2, 7.0)  # 4 back: the window's edge, kept
    causal = _max_logit(q, k, None, 0, None)
    assert causal.item() == pytest.approx(90.0, rel=1e-4)  # the future key ignored
    windowed = _max_logit(q, k, None, 5, None)
    assert windowed.item() == pytest.approx(7.0, rel=1e-4)
    documents = torch.zeros(B, T, dtype=torch.long)
    documents[1, 5:] = 1  # key 4 of row 1 is in the document before query 9's
    same = documents[:, None, :, None] == documents[:, None, None, :]
    keep = same & torch.ones(T, T, dtype=torch.bool).tril()
    assert _max_logit(q, k, None, 0, keep).item() == pytest.approx(7.0, rel=1e-4)
    # (a block mask of the same pairs)
    block = create_block_mask(
        lambda b, h, qi, kv: (documents[b, qi] == documents[b, kv]) & (kv <= qi), B, None, T, T, device="cpu")
    assert _max_logit(q, k, None, 0, block).item() == pytest.approx(7.0, rel=1e-4)


def test_the_model_is_left_as_it_was():
    model = build(tiny())
    tokens = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(tokens)
    attention_logit_maxima(model, lambda: model(tokens))
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert all("qkv" not in vars(m) and not m._forward_pre_hooks for m in attentions)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)


@pytest.mark.slow  # (two processes)
def test_a_training_run_logs_the_max_attention_logit(tmp_path):
    """Two ranks, a log step every 2 of 4 steps: train/max_attn_logit there, finite, the same under
    ZeRO-3 (its hooks gather each module's parameters inside the probe's forward, on every rank:
    one rank alone would hang) as under ZeRO-0."""
    common = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.n_kv_heads=1", "data.seq_len=32",
              "train.micro_batch_size=2", "train.global_batch_size=4", "train.max_steps=4", "logging.log_every=2",
              "logging.wandb=disabled", "train.eval_every=0", "data.validation=[]", "data.num_workers=0",
              "schedule.warmup_steps=1", "data.tokenizer=builtin:python-bpe-512", "logging.attn_logits=true"]
    logged = {}
    for stage in (0, 3):
        run_dir = tmp_path / f"zero{stage}"
        run_train([*common, f"distributed.zero_stage={stage}", f"train.run_dir={run_dir}"], nproc=2)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        logged[stage] = {r["step"]: r["train/max_attn_logit"] for r in records if "train/max_attn_logit" in r}
    assert sorted(logged[0]) == [2, 4]
    assert all(math.isfinite(v) and v > 0 for v in logged[0].values()), logged
    assert logged[3] == pytest.approx(logged[0], rel=1e-4)
