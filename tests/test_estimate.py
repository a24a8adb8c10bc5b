"""`pretrain estimate`: its activation model against what autograd really saves (also per rank under
sequence parallelism), its memory against a measured peak RSS, and its ZeRO and all-to-all arithmetic."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import REPO, TINY, free_port, train_env
from pretrain.cli import main
from pretrain.config import load_config, zero_sizes
from pretrain.estimate.comm import (allreduced_params, comm_bytes, comm_volume, sequence_exchange_bytes,
                                    tensor_parallel_bytes, zero3_gathered, zero_traffic)
from pretrain.estimate.memory import (activation_bytes, block_matrices, largest_layer_params, model_state_bytes,
                                      tensor_parallel_params)
from pretrain.estimate.muon import muon_matrices, muon_step, newton_schulz_flops
from pretrain.estimate.report import Assumptions, estimate, fit_hint, report
from pretrain.model.args import PRESETS, ModelArgs
from pretrain.model.model import Transformer, matmul_params, num_params
from pretrain.parallel.parallelize import apply_activation_checkpointing


def saved_by_autograd(model, tokens, labels, chunk, mlp_chunk=0) -> int:
    """Bytes of every tensor autograd keeps for backward, parameters left out, shared storage once."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}
    for block in model.layers:
        block.feed_forward.chunk = mlp_chunk

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, labels, loss_chunk=chunk)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,ac,chunk,mlp_chunk", [
    (dict(dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384, vocab_size=512), 0, 0, 0),
    (dict(dim=192, n_layers=4, n_heads=6, n_kv_heads=6, ffn_hidden_dim=320, vocab_size=1024), 0, 32, 0),
    (dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=1, ffn_hidden_dim=768, vocab_size=512), 1, 0, 0),
    (dict(dim=128, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden_dim=256, vocab_size=512), 2, 48, 0),
    (dict(dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384, vocab_size=512), 0, 0, 32),
    (dict(dim=128, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden_dim=256, vocab_size=512), 2, 48, 40),
    # Mixture-of-Experts blocks (memory.moe_bytes_per_token): shared experts and a dense first block; top-1 alone
    (dict(dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384, vocab_size=512, moe_experts=4,
          moe_top_k=2, moe_hidden_dim=96, moe_shared_experts=1, moe_dense_layers=1), 0, 0, 0),
    (dict(dim=128, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384, vocab_size=512, moe_experts=8,
          moe_top_k=1, moe_hidden_dim=64), 0, 0, 0),
    (dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384, vocab_size=512, moe_experts=4,
          moe_top_k=2, moe_hidden_dim=96), 2, 0, 0),
])
def test_activation_model_matches_what_autograd_saves(dtype, shape, ac, chunk, mlp_chunk):
    args = ModelArgs(max_seq_len=64, **shape)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    model = model.to(dtype)
    apply_activation_checkpointing(model, ac)
    tokens, labels = torch.randint(0, args.vocab_size, (2, 64)), torch.randint(0, args.vocab_size, (2, 64))
    measured = saved_by_autograd(model, tokens, labels, chunk, mlp_chunk)
    predicted = activation_bytes(args, 128, dtype.itemsize, ac, chunk, mlp_chunk=mlp_chunk)["saved"]
    assert predicted == pytest.approx(measured, rel=0.02), (predicted, measured)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_window_changes_no_activation_but_the_cpu_paths_dense_mask(dtype):
    """Local (sliding-window) layers keep what global ones keep (the estimate is the same), but for
    the dense mask of the path without FlexAttention: one (T, T) in the training dtype per local layer."""
    T, shape = 96, dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384, vocab_size=512)
    tokens, labels = torch.randint(0, 512, (2, T)), torch.randint(0, 512, (2, T))
    saved, predicted = {}, {}
    for local, pattern in ((0, []), (2, ["local", "global"]), (4, ["local"])):  # local layers of 4
        args = ModelArgs(max_seq_len=T, **shape, sliding_window=16 if local else 0, layer_pattern=pattern)
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights()
        saved[local] = saved_by_autograd(model.to(dtype), tokens, labels, 0)
        predicted[local] = activation_bytes(args, 2 * T, dtype.itemsize, 0)["saved"]
    assert predicted[0] == predicted[2] == predicted[4] == pytest.approx(saved[0], rel=0.02)
    mask = dtype.itemsize * T * T
    assert saved[2] - saved[0] == 2 * mask and saved[4] - saved[0] == 4 * mask


def test_a_windowed_model_is_estimated_by_its_flops(capsys):
    """At seq_len 8192 a model whose local layers attend 1,024 tokens costs flops_per_token's share
    of the full model's step time (on one node the step is the compute), and the same memory; the
    report says how many layers are local and the FLOPs' ratio."""
    shape = ["model.vocab_size=32000", "data.seq_len=8192", "model.max_seq_len=8192"]
    window = ["model.layer_pattern=[local,local,local,global]", "model.sliding_window=1024"]
    full = load_config(REPO / "configs" / "7b.yaml", shape)
    local = load_config(REPO / "configs" / "7b.yaml", shape + window)
    e_full, e = (estimate(c, c.model, Assumptions(gpus=8)) for c in (full, local))
    a, T, W = full.model, 8192, 1024
    attention = 12 * a.n_heads * a.head_dim  # FLOPs per token per key a query attends
    local_keys = 2 * W - W * (W - 1) / T  # twice the causal band per query, as a global layer's T is twice its half
    ratio = (6 * matmul_params(a) + attention * (8 * T + 24 * local_keys)) / (6 * matmul_params(a) + attention * 32 * T)
    assert e["flops_per_token"] / e_full["flops_per_token"] == pytest.approx(ratio) and 0.85 < ratio < 0.9
    assert e["step_s"] == e["compute_s"] and e_full["step_s"] == e_full["compute_s"]
    assert e["step_s"] / e_full["step_s"] == pytest.approx(ratio)
    assert e["memory_gib_per_gpu"] == e_full["memory_gib_per_gpu"]
    assert e["window"] == {"local_layers": 24, "layers": 32, "sliding_window": 1024,
                           "flops_vs_full": pytest.approx(ratio)}
    assert e_full["window"] is None
    assert main(["estimate", str(REPO / "configs" / "7b.yaml"), "--gpus", "8", *shape, *window]) == 0
    assert (f"sliding window of 1,024 tokens in 24 of 32 layers: {ratio:.2f}x the FLOPs per token of full "
            "attention at seq_len 8,192") in capsys.readouterr().out


# `pretrain train` (alone or under torchrun) with the bytes autograd holds for backward followed as
# they come and go: a tensor counts from the first time it is saved until the last saved reference
# to its storage is released, parameters (and views of them) left out. Every rank writes its peak
# and the bytes it sent through all-to-alls (what it does not keep of each input) to PEAK_DIR.
PEAK_DRIVER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from pretrain.cli import main

live, state = {}, {"now": 0, "peak": 0, "sent": 0}


class Held:
    __slots__ = ("t", "ptr")

    def __init__(self, t, ptr):
        self.t, self.ptr = t, ptr

    def __del__(self):
        if self.ptr is not None:
            entry = live[self.ptr]
            entry[1] -= 1
            if entry[1] == 0:
                del live[self.ptr]
                state["now"] -= entry[0]


def pack(t):
    base = t if t._base is None else t._base
    if base.is_leaf and base.requires_grad:
        return Held(t, None)
    ptr = t.untyped_storage().data_ptr()
    if ptr not in live:
        live[ptr] = [t.untyped_storage().nbytes(), 0]
        state["now"] += live[ptr][0]
        state["peak"] = max(state["peak"], state["now"])
    live[ptr][1] += 1
    return Held(t, ptr)


all_to_all_single = dist.all_to_all_single


def counted(output, input, *args, group=None, **kwargs):
    n = dist.get_world_size(group)
    state["sent"] += input.numel() * input.element_size() * (n - 1) // n
    return all_to_all_single(output, input, *args, group=group, **kwargs)


dist.all_to_all_single = counted
with torch.autograd.graph.saved_tensors_hooks(pack, lambda held: held.t):
    rc = main(sys.argv[1:])
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(os.environ["PEAK_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, **state}, f)
sys.exit(rc)
"""


def peak_saved(nproc: int, overrides: list[str]) -> list[dict]:
    """Train `nproc` ranks (1: a plain process) for the config TINY + overrides and return each rank's
    {"rank", "peak" (bytes held for backward at once), "now" (held at the end: 0), "sent" (all-to-all
    bytes sent)}, in rank order."""
    with tempfile.TemporaryDirectory() as tmp:
        driver = Path(tmp) / "driver.py"
        driver.write_text(PEAK_DRIVER)
        launch = [sys.executable] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_port", str(free_port())]
        proc = subprocess.run([*launch, str(driver), "train", str(TINY), "logging.progress=false",
                               "logging.wandb=disabled", f"train.run_dir={tmp}/run", *overrides],
                              cwd=REPO, env=train_env({"PEAK_DIR": tmp}), capture_output=True, text=True, timeout=300)
        got = [json.loads(f.read_text()) for f in sorted(Path(tmp).glob("rank*.json"))]
    assert proc.returncode == 0 and [r["rank"] for r in got] == list(range(nproc)), \
        proc.stdout[-2000:] + proc.stderr[-4000:]
    return got


@pytest.mark.parametrize("ac,kv", [
    pytest.param(0, 2, marks=pytest.mark.slow),  # (2 ranks measuring: the full suite's; the fast tier keeps the model's)
    pytest.param(1, 2, marks=pytest.mark.slow),  # activation checkpointing: blocks keep their inputs
    pytest.param(0, 1, marks=pytest.mark.slow),  # one KV head over 2 ranks: replicated twice
], ids=["ac0", "ac1", "kv1"])
def test_sequence_parallel_activations_per_rank(ac, kv):
    """One sequence of 1024 tokens, the tiny preset, fp32, one step: the peak of what autograd holds
    for backward on each of 2 sequence-parallel ranks against one rank with the whole sequence, both
    against the estimate; and the all-to-all bytes each rank sent against the estimate's traffic."""
    from pretrain.build import tokenizer_and_model_args

    overrides = ["data.seq_len=1024", "model.max_seq_len=1024", "train.micro_batch_size=1",
                 "train.global_batch_size=1", "train.max_steps=1", "train.precision=fp32", "train.eval_every=0",
                 "data.validation=[]", f"train.activation_checkpointing={ac}", f"model.n_kv_heads={kv}"]
    whole = peak_saved(1, overrides)[0]
    split = peak_saved(2, overrides + ["distributed.sequence_parallel=2"])
    args = tokenizer_and_model_args(load_config(TINY, overrides))[1]
    for sp, ranks in ((1, [whole]), (2, split)):
        predicted = activation_bytes(args, 1024, 4, ac, 0, sp)["saved"]
        for r in ranks:
            assert r["now"] == 0  # everything held was released: the peak is of one step's tensors
            assert r["peak"] == pytest.approx(predicted, rel=0.003), (sp, r, predicted)  # (0.28% at most measured)
    for r in split:
        assert 0.45 <= r["peak"] / whole["peak"] <= 0.6, (r, whole)
        # forward and backward exchange in every layer, a checkpointed block's recomputation again
        exchanges = 2 * args.n_layers + (args.n_layers if ac else 0)
        assert r["sent"] == exchanges * sequence_exchange_bytes(args, 1024, 4, 2), r
    assert whole["sent"] == 0


def test_sequence_parallel_estimate():
    """Per-token parts divide by N; attention's tensors (all tokens, heads / N) too, keys and values
    times their replication; the exchange adds wo's copy of the output and the positions' RoPE rows;
    the traffic is 4 exchanges of (N - 1) / N of the rank's q, k, v and output per layer."""
    args = ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_hidden_dim=768, vocab_size=512)
    T, p, D, kvd = 4096, 2, 256, 64
    one = activation_bytes(args, T, p, 0)["saved"]
    exchange = p * D + 4 * args.head_dim / args.n_layers  # per layer per token of the slice
    for n, r in ((2, 1), (4, 2), (8, 4)):  # 2 KV heads: replicated once at N = 2, 2x at 4, 4x at 8
        replication = 2 * p * kvd * (r - 1)
        assert activation_bytes(args, T, p, 0, sp=n)["saved"] == pytest.approx(
            one / n + args.n_layers * (exchange + replication) * T / n)
        heads = 2 * args.n_heads + 2 * args.kv_heads * r
        assert sequence_exchange_bytes(args, T, p, n) == (n - 1) / n * T / n * heads * args.head_dim * p
    assert sequence_exchange_bytes(args, T, p, 1) == 0
    # Checkpointed blocks keep their input: per token of the slice, so the whole divides by N.
    ac = [activation_bytes(args, T, p, 1, sp=n)["saved"] for n in (1, 2)]
    assert ac[1] == pytest.approx(ac[0] / 2 + 4 * args.head_dim * T / 2)


def test_estimate_says_which_sequence_parallel_fits(capsys):
    """7b at 131k tokens per sequence: no fit on one GPU per sequence, 2 GPUs per sequence fit; the
    run at N = 8 reports its all-to-all and activations divided by 8."""
    long = ["model.vocab_size=32000", "data.seq_len=131072", "model.max_seq_len=131072",
            "train.global_batch_tokens=4194304"]
    assert main(["estimate", str(REPO / "configs" / "7b.yaml"), "--gpus", "64", *long,
                 "distributed.sequence_parallel=8"]) == 0
    out = capsys.readouterr().out
    assert "sequence_parallel: 2 needed for seq_len 131,072 to fit in 80 GiB per GPU" in out
    assert "Ulysses all-to-all over 8 GPUs" in out and "each sequence split over 8 GPUs" in out
    cfg = load_config(REPO / "configs" / "7b.yaml", long + ["distributed.sequence_parallel=8"])
    e = estimate(cfg, cfg.model, Assumptions(gpus=64))
    rows = {r["sequence_parallel"]: r for r in e["sequence_parallel_table"]}
    assert not rows[1]["fits"] and rows[2]["fits"] and e["sequence_parallel_needed"] == 2
    acts = {n: r["memory_parts_gib"]["activations"] for n, r in rows.items()}
    assert acts[2] / acts[8] == pytest.approx(4, rel=0.01)
    # 4 micro-batches per GPU, 32 layers, recomputed once under activation checkpointing (7b.yaml).
    per_layer = sequence_exchange_bytes(cfg.model, 131072, 2, 8)
    assert e["all_to_all_gib_per_gpu"] == pytest.approx(4 * 3 * 32 * per_layer / 2**30)
    assert e["step_s"] == pytest.approx(max(e["compute_s"], e["comm_s"]) + e["all_to_all_s"])
    short = load_config(REPO / "configs" / "7b.yaml", ["model.vocab_size=32000"])
    out = report(estimate(short, short.model, Assumptions(gpus=64)))
    assert "sequence_parallel: 1 is enough for seq_len 4,096" in out


def test_model_states_and_communication_follow_zero():
    n = 1_000_000
    # bf16 stages 0 and 1 run DeepSpeed's BF16_Optimizer: whole bf16 and fp32 gradients on every GPU.
    bf16_optimizer = {"weights": 2 * n, "gradients": 6 * n, "optimizer": 12 * n / 8}
    assert model_state_bytes(n, 0, 8, "bf16") == model_state_bytes(n, 1, 8, "bf16") == bf16_optimizer
    assert model_state_bytes(n, 1, 8, "bf16", "bf16") == {"weights": 2 * n, "gradients": 6 * n / 8,
                                                          "optimizer": 12 * n / 8}
    assert model_state_bytes(n, 2, 8, "bf16") == model_state_bytes(n, 1, 8, "bf16", "bf16")
    assert model_state_bytes(n, 3, 8, "bf16", largest_layer=1000) == {
        "weights": 2 * n / 8, "gradients": 4 * n / 8, "optimizer": 12 * n / 8, "gathered": 8 * 1000}
    assert model_state_bytes(n, 0, 1, "fp32") == {"weights": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}
    psi = 7 / 8 * n * 2
    assert comm_bytes(n, 0, 8, 4, 2) == 2 * psi  # all-reduce once per step
    assert comm_bytes(n, 3, 8, 4, 2) == 3 * 4 * psi  # two gathers and a reduce-scatter per micro-batch
    assert comm_bytes(n, 3, 8, 4, 2, 4) == 2 * 4 * psi + 4 * 2 * psi  # gradients reduced in fp32
    assert comm_bytes(n, 3, 1, 4, 2) == 0


def test_newton_schulz_flops_are_deepspeeds():
    """The matmul FLOPs torch's FlopCounterMode counts in DeepSpeed's two iterations (5 steps), wide,
    tall and square, against newton_schulz_flops."""
    from torch.utils.flop_counter import FlopCounterMode
    from deepspeed.runtime.zero.muon import original_muon

    for method, fn in (("gram", original_muon.zeropower_via_gram_newtonschulz),
                       ("standard", original_muon.zeropower_via_newtonschulz5)):
        fn = getattr(fn, "_torchdynamo_orig_callable", fn)  # DeepSpeed wraps them in torch.compile
        for shape in ((32, 96), (96, 32), (48, 48), (40, 56)):
            with FlopCounterMode(display=False) as counter:
                fn(torch.randn(*shape), steps=5)
            assert counter.get_total_flops() == newton_schulz_flops(*shape, method), (method, shape)
    assert newton_schulz_flops(64, 320) == 8 * 64**2 * 320 + 28 * 64**3
    assert newton_schulz_flops(64, 320, "standard") == 5 * (4 * 64**2 * 320 + 2 * 64**3)


def test_muon_costs_follow_our_zero3_step():
    """Muon's state, traffic and Newton-Schulz work by the rule of our ZeRO-3 step (pretrain/optim/muon.py;
    measured on 2 ranks in test_muon_states_and_traffic_are_what_deepspeed_allocates_and_sends and
    tests/test_muon.py test_muon_step_spreads_newton_schulz_and_sends_its_share): one momentum
    instead of two Adam moments; each matrix orthogonalised by one owner, its slices sent there and
    back by all-to-all."""
    n = 1_000_000
    assert model_state_bytes(n, 3, 8, "bf16", muon=600_000)["optimizer"] == (12 * n - 4 * 600_000) / 8
    assert model_state_bytes(n, 3, 8, "bf16", "bf16", muon=600_000)["optimizer"] == (12 * n - 6 * 600_000) / 8
    assert model_state_bytes(n, 0, 2, "fp32", muon=600_000)["optimizer"] == 8 * n - 4 * 600_000
    # 4 blocks of seven 256 x 256 matrices (MHA, hidden 256): one group, 28 equal matrices.
    square = ModelArgs(dim=256, n_layers=4, n_heads=4, ffn_hidden_dim=256, vocab_size=512)
    M, c = 28 * 256**2, 4
    # 7 ranks: 4 matrices each, whatever the bucket; each rank sends 2 c per slice, a slice of each
    # of the 24 matrices it does not own and 6 of each of its 4: 4 M c (n-1)/n^2, slices padded to
    # ceil(256^2 / 7) elements.
    for bucket in (256**2, 7 * 256**2):
        step = muon_step(square, 3, 7, bucket, c)
        assert step["params"] == M and step["flops_total"] == 28 * newton_schulz_flops(256, 256)
        assert step["flops"] == step["flops_total"] / 7
        assert step["comm"] == 2 * c * -(-256**2 // 7) * (24 + 4 * 6) == pytest.approx(4 * M * c * 6 / 49, rel=1e-4)
    # 8 ranks: 28 = 4 x 4 + 4 x 3; the busiest owns 4 matrices: (24 + 4 x 7) slices of 256^2 / 8.
    eight = muon_step(square, 3, 8, 256**2, c)
    assert eight["flops"] == 4 * newton_schulz_flops(256, 256)
    assert eight["comm"] == 2 * c * 256**2 / 8 * (24 + 4 * 7)
    # Unequal matrices: the owners balance Newton-Schulz work, largest first (GQA, hidden 704).
    gqa = ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512)
    step = muon_step(gqa, 3, 2, 256**2, c)
    largest = max(newton_schulz_flops(m, k) for g in muon_matrices(gqa) for m, k in g)
    assert step["flops_total"] / 2 <= step["flops"] <= step["flops_total"] / 2 + largest
    assert step["comm"] == pytest.approx(4 * step["params"] * c / 4, rel=0.1)
    assert muon_step(square, 3, 1, 256**2, c)["comm"] == muon_step(square, 0, 7, 256**2, c)["comm"] == 0
    assert muon_step(square, 0, 7, 256**2, c)["flops"] == eight["flops_total"]  # no ZeRO: every rank, every matrix
    # reduce_scatter=false: gradients that fit a bucket are all-reduced (2x), larger ones reduce-scattered.
    assert allreduced_params(square, 256**2) == num_params(square) - 2 * 512 * 256
    # The whole estimate: same gathers, the all-reduced gradients once more per micro-batch, the
    # step's time on top, and the optimizer state of the Muon matrices 8 bytes lighter.
    base = ["model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=4", "model.ffn_hidden_dim=256",
            "model.vocab_size=512", "distributed.zero_stage=3", "train.global_batch_size=256"]
    e = {o: estimate(cfg := load_config(TINY, base + [f"optimizer.name={o}"]), cfg.model, Assumptions(gpus=8))
         for o in ("adamw", "muon")}
    k, g = e["muon"]["grad_accum"], 4
    assert e["muon"]["comm_gib_per_gpu"] - e["adamw"]["comm_gib_per_gpu"] == pytest.approx(
        k * 7 / 8 * g * allreduced_params(square, 256**2) / 2**30)
    step = muon_step(square, 3, 8, 256**2, g)
    assert e["muon"]["muon"]["step_comm_gib_per_gpu"] == pytest.approx(step["comm"] / 2**30)
    assert e["muon"]["step_s"] == pytest.approx(max(e["muon"]["compute_s"], e["muon"]["comm_s"])
                                                + e["muon"]["optimizer_step_s"])
    assert e["adamw"]["memory_parts_gib"]["optimizer"] - e["muon"]["memory_parts_gib"]["optimizer"] == \
        pytest.approx(8 * M / 8 / 2**30 - 4 * M / 8 / 2**30)
    assert "optimizer_step" not in e["adamw"]["memory_parts_gib"] and e["adamw"]["optimizer_step_s"] == 0
    assert "Muon step (once per step" in report(e["muon"]) and "Muon step" not in report(e["adamw"])


@pytest.mark.parametrize("gpus", [8, 64])
@pytest.mark.parametrize("preset", ["125m", "1b", "7b"])
def test_model_states_match_deepspeeds_estimators(preset, gpus):
    """DeepSpeed's estimators (counts in, no model built), for 8 GPUs per node. Where DeepSpeed
    allocates more than its estimator says (test_model_states_are_what_deepspeed_allocates), the
    difference is the term named here."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    args = ModelArgs(**PRESETS[preset], vocab_size=32000)
    n, largest = num_params(args), largest_layer_params(args)
    zero2 = estimate_zero2_model_states_mem_needs(n, 8, gpus // 8, cpu_offload=False)[1]
    zero3 = estimate_zero3_model_states_mem_needs(n, largest, 8, gpus // 8, cpu_offload=False,
                                                  cpu_offload_params=False)[1]

    def ours(stage, grad_dtype="fp32"):
        return sum(model_state_bytes(n, stage, gpus, "bf16", grad_dtype, largest).values())

    assert ours(2) == pytest.approx(zero2, rel=0.05)
    assert ours(1, "bf16") == pytest.approx(zero2, rel=0.05)
    # BF16_Optimizer (stage 1, fp32 gradients): bf16 and fp32 gradients whole, not partitioned.
    assert ours(1) - 6 * n * (1 - 1 / gpus) == pytest.approx(zero2, rel=0.05)
    # The largest gradient cast to fp32 for the reduce-scatter, next to its bf16 self.
    assert ours(3) - 4 * largest == pytest.approx(zero3, rel=0.05)


def test_largest_layer_is_deepspeeds():
    from deepspeed.runtime.zero.stage3 import model_to_params

    for tie in (False, True):
        args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=320, vocab_size=100,
                         tie_embeddings=tie)
        assert model_to_params(Transformer(args)) == (num_params(args), largest_layer_params(args))
        args.vocab_size = 1000
        assert model_to_params(Transformer(args)) == (num_params(args), largest_layer_params(args))


CENSUS = r"""
import gc, json, sys
import torch
import deepspeed.comm as dcomm
from pretrain.parallel import distributed
env = distributed.init("gloo")
from pretrain.config import load_config, zero_sizes
from pretrain.estimate.comm import allreduced_params
from pretrain.estimate.memory import largest_layer_params, model_state_bytes
from pretrain.estimate.muon import muon_step
from pretrain.model.model import num_params
from pretrain.parallel.parallelize import build_engine, build_model, deepspeed_config

stage, grad_dtype, optimizer = int(sys.argv[1]), sys.argv[2], sys.argv[3]
n = env.world_size
cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [
    "model.dim=256", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=4096",
    "model.max_seq_len=64", "data.seq_len=64", "train.micro_batch_size=1", f"train.global_batch_size={n}",
    "train.precision=bf16", f"distributed.zero_stage={stage}", f"distributed.grad_dtype={grad_dtype}",
    f"optimizer.name={optimizer}"])
ds = deepspeed_config(cfg, n, "bf16")
engine = build_engine(build_model(cfg.model, cfg, ds, seed=0), cfg, ds, env.device)

# Bytes out of each collective DeepSpeed runs (ZeRO-3's all-reduces of small buckets, reduce-scatters
# of larger ones, Muon's all-gathers), by phase.
counted_bytes, phase, during, a2a = {}, ["backward"], [0], [0]


def counted(name, nbytes, module=dcomm, attr=None):
    def call(*args, **kwargs):
        key = (phase[0], name)
        counted_bytes[key] = counted_bytes.get(key, 0) + nbytes(*args)
        if key == ("last step", "all_to_all_single"):
            a2a[0] += 1
            if a2a[0] == 2:  # Muon's first all-to-all back (a w1's, the largest matrix, owned by rank 0)
                during[0] = tensor_bytes()
        return original(*args, **kwargs)
    original = getattr(module, attr or name)
    setattr(module, attr or name, call)


size = lambda t: t.numel() * t.element_size()
counted("all_reduce", lambda t, *a: size(t))
counted("reduce_scatter_fn", lambda out, inp, *a: size(inp))
counted("all_gather_into_tensor", lambda out, inp, *a: size(out))
counted("all_gather", lambda outs, inp, *a: sum(size(o) for o in outs))
counted("all_to_all_single", lambda out, inp, outs, ins, group=None, *a: (sum(ins) - ins[dcomm.get_rank(group)])
        * inp.element_size(), module=distributed, attr="all_to_all")  # (Muon's, sent to the other ranks)


def tensor_bytes():
    gc.collect()
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                storages[o.untyped_storage().data_ptr()] = o.untyped_storage().nbytes()
            except RuntimeError:  # torch.compile's fake tensors (DeepSpeed compiles muon_update)
                pass
    return sum(storages.values())


alive = []
tokens = torch.randint(0, 4096, (1, 64), generator=torch.Generator().manual_seed(0))
for i in range(2):  # two steps of one micro-batch: Muon's momentum and AdamW's moments exist after the first
    phase[0] = "backward"
    engine.backward(engine(tokens, tokens))
    alive.append(tensor_bytes())
    phase[0] = "last step" if i else "step"
    engine.step()
    alive.append(tensor_bytes())
args, sizes = cfg.model, zero_sizes(cfg)
muon = muon_step(args, stage, n, sizes["reduce_bucket_size"], 4 if grad_dtype == "fp32" else 2) \
    if optimizer == "muon" else {"params": 0, "comm": 0, "transient": 0}
states = model_state_bytes(num_params(args), stage, n, "bf16", grad_dtype, largest_layer_params(args), muon["params"])
states.pop("gathered", None)  # transient, inside backward
adamw = dict(model_state_bytes(num_params(args), stage, n, "bf16", grad_dtype), gathered=0)
sent = {}
for (when, name), v in counted_bytes.items():  # per step
    sent[f"{when.split()[-1]} {name}"] = sent.get(f"{when.split()[-1]} {name}", 0) + v / 2
if env.rank == 0:
    print("RESULT " + json.dumps({"measured": max(alive), "predicted": sum(states.values()),
                                  "adamw": sum(adamw.values()), "sent": sent, "muon_comm": muon["comm"],
                                  "allreduced": allreduced_params(args, sizes["reduce_bucket_size"]),
                                  "during": during[0], "transient": muon["transient"]}))
"""


def census(nproc: int, stage: int, grad_dtype: str, optimizer: str) -> dict:
    script = f"from pathlib import Path\nREPO = Path({str(REPO)!r})\n" + CENSUS
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(script)
        f.flush()
        launch = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                                                      str(nproc), "--master_port", str(free_port())]
        proc = subprocess.run([*launch, f.name, str(stage), grad_dtype, optimizer],
                              cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("stage,grad_dtype", [(1, "fp32"), (3, "fp32"), (3, "bf16")])
def test_model_states_are_what_deepspeed_allocates(stage, grad_dtype):
    """Two ranks, bf16, a 5M-parameter model: every tensor alive after backward and after the step
    (parameters, gradients, DeepSpeed's flat buffers, optimizer state; activations are gone by
    then), counted once per storage, against the model states the estimate predicts."""
    r = census(2, stage, grad_dtype, "adamw")
    assert r["measured"] == pytest.approx(r["predicted"], rel=0.02), r


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_muon_states_and_traffic_are_what_deepspeed_allocates_and_sends(nproc):
    """optimizer.name=muon, ZeRO-3, bf16 with fp32 gradients, the model above (2.9M of its 5.0M
    parameters on Muon): the tensors alive after each step against the model states with one fp32
    momentum instead of two Adam moments (AdamW's 12 bytes for every parameter would be 10-15% off);
    and the bytes of each collective: per micro-batch, gradients that fit the reduce bucket (D^2)
    all-reduced and larger ones reduce-scattered; per step, our Muon step's all-to-alls (pretrain/optim/muon.py:
    gradient and momentum slices to each matrix's owner, update and momentum slices back)."""
    r = census(nproc, 3, "fp32", "muon")
    assert r["measured"] == pytest.approx(r["predicted"], rel=0.02), r
    assert r["measured"] != pytest.approx(r["adamw"], rel=0.05), r
    # At the last step's first all-to-all back (a w1's, 704 x 256, the largest, owned by rank 0): the
    # step's transient, less muon_update's temporaries (2 of the 5 matrices the estimate allows).
    temporaries = 2 * 4 * 704 * 256
    assert r["during"] == pytest.approx(r["predicted"] + r["transient"] - temporaries, rel=0.03), r
    assert "step all_gather" not in r["sent"]  # (DeepSpeed's Muon step does not run)
    if nproc == 2:
        n_total = 5_048_576
        assert r["sent"]["backward all_reduce"] == 4 * r["allreduced"]
        assert r["sent"]["backward reduce_scatter_fn"] == 4 * (n_total - r["allreduced"])
        persistent = 9 * 256 * 2  # the norms (below the persistence threshold), gathered whole after the step
        assert r["sent"]["step all_gather_into_tensor"] == persistent
        # Rank 0's all-to-all bytes to rank 1: the estimate's busiest rank (both own half the work).
        assert r["sent"]["step all_to_all_single"] == pytest.approx(r["muon_comm"], rel=0.05), r


def test_estimate_report_and_json(tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["estimate", str(REPO / "configs" / "7b.yaml"), "--gpus", "64", "model.vocab_size=32000",
                 "--json", str(out)]) == 0
    report = capsys.readouterr().out
    e = json.loads(out.read_text())
    cfg = load_config(REPO / "configs" / "7b.yaml", ["model.vocab_size=32000"])
    from pretrain.model.model import flops_per_token, num_params

    assert e["params"] == num_params(cfg.model) and 7.2e9 < e["params"] < 7.3e9
    assert e["flops_per_token"] == flops_per_token(cfg.model, 4096)
    parts = e["memory_parts_gib"]
    # ZeRO-3, bf16, fp32 gradients: (2 + 4 + 12) / 64 bytes per parameter, and the head gathered.
    assert parts["weights"] + parts["gradients"] + parts["optimizer"] == pytest.approx(18 * e["params"] / 64 / 2**30)
    assert parts["gathered"] == 8 * 32000 * 4096 / 2**30
    assert e["fits"] and "per GPU): use" not in report
    assert e["memory_gib_per_gpu"] == pytest.approx(sum(parts.values()))
    assert e["tokens_per_step"] == 4194304 and e["grad_accum"] == 16
    assert e["step_s"] == pytest.approx(max(e["compute_s"], e["comm_s"]))
    assert [r["gpus"] for r in e["scaling"]][:3] == [1, 2, 4] and "efficiency" in report
    assert not e["scaling"][0]["fits"] and "| 1 | 1024 | 125.13, does not fit (> 80 GiB) |" in report


def test_a_run_over_the_gpu_memory_is_flagged():
    cfg = load_config(REPO / "configs" / "7b.yaml", ["model.vocab_size=32000", "train.global_batch_tokens=65536"])
    e = estimate(cfg, cfg.model, Assumptions(gpus=1))
    assert e["memory_gib_per_gpu"] > 80 and not e["fits"]
    assert "does not fit (125 GiB > 80 GiB per GPU): use more GPUs\n" in report(e)
    assert estimate(cfg, cfg.model, Assumptions(gpus=1, gpu_memory_gib=141))["fits"]  # an H200
    cfg = load_config(REPO / "configs" / "7b.yaml", ["model.vocab_size=32000", "distributed.zero_stage=1",
                                                      "train.activation_checkpointing=0"])
    assert "per GPU): use" in report(estimate(cfg, cfg.model, Assumptions(gpus=8)))
    assert fit_hint(cfg) == "more GPUs, distributed.zero_stage=3 or train.activation_checkpointing=1"


def test_bad_estimate_inputs_are_one_line(capsys):
    assert main(["estimate", str(TINY), "--gpus", "0"]) == 2
    assert capsys.readouterr().err.strip() == "pretrain: error: --gpus must be >= 1, --mfu in (0, 1], " \
                                              "--peak-tflops and --gbps > 0"
    assert main(["estimate", str(TINY), "--gpus", "3", "train.micro_batch_size=4", "train.global_batch_size=8"]) == 2
    assert "not divisible by micro_batch_size 4 x world size 3" in capsys.readouterr().err


BIG = ["model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=2", "model.multiple_of=256",
       "model.max_seq_len=128"]
SMALL = ["model.dim=64", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.multiple_of=64"]


def _peak_rss_gib(overrides) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pretrain", "train", str(TINY), "train.max_steps=3", "logging.log_every=3",
                        "logging.wandb=disabled", "logging.progress=false", f"train.run_dir={tmp}",
                        "data.validation=[]", "train.eval_every=0", *overrides],
                       check=True, capture_output=True, cwd=REPO, env=train_env())
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    # the last training record: before the final save's host copy
    return [r for r in records if "memory/rss_peak_gib" in r][-1]["memory/rss_peak_gib"]


@pytest.mark.slow
@pytest.mark.parametrize("ac", [0, 1])
def test_memory_estimate_within_25_percent_of_the_measured_peak(ac):
    """CPU, fp32, ZeRO stage 0, one process: the peak RSS of a 28M-parameter model minus that of a
    tiny one (the interpreter, torch and the data cancel out) against the estimate's difference."""
    from pretrain.build import tokenizer_and_model_args

    extra = [f"train.activation_checkpointing={ac}"]
    measured = _peak_rss_gib(BIG + extra) - _peak_rss_gib(SMALL + extra)
    estimated = []
    for shape in (BIG, SMALL):
        cfg = load_config(TINY, shape + extra)
        estimated.append(estimate(cfg, tokenizer_and_model_args(cfg)[1],
                                  Assumptions(gpus=1, precision="fp32"))["memory_gib_per_gpu"])
    assert estimated[0] - estimated[1] == pytest.approx(measured, rel=0.25), (estimated, measured)


def test_gpu_memory_flag(capsys):
    """--gpu-memory sets what "does not fit" is measured against (an H200 has 141 GiB)."""
    args = ["estimate", str(REPO / "configs" / "7b.yaml"), "--gpus", "1", "model.vocab_size=32000",
            "train.global_batch_tokens=65536"]
    assert main(args) == 0 and "does not fit (125 GiB > 80 GiB per GPU)" in capsys.readouterr().out
    assert main(args + ["--gpu-memory", "141"]) == 0 and "does not fit" not in capsys.readouterr().out
    assert main(args + ["--gpu-memory", "0"]) == 2


# Tensor parallelism, hpZ and the choice between layouts (parallel_options): arithmetic only.
SHAPE = ["model.vocab_size=32000", "data.seq_len=4096", "model.max_seq_len=4096"]


def _row(e: dict, option: str) -> dict:
    return next(r for r in e["parallel_options"] if r["option"] == option)


def test_tensor_parallel_splits_the_block_matrices():
    """TP over t: a rank holds 1/t of the block matrices and the whole embedding, head and norms,
    ZeRO shards that over the n/t ranks of its slice, every GPU runs t times the micro-batches; the
    split activations divide by t, the norms' and the block input do not; 7 all-reduces per block
    per micro-batch plus 1 in the recomputation (as counted: tests/test_traffic.py), added to the
    step; the head computed t times."""
    cfg = load_config(REPO / "configs" / "7b.yaml", SHAPE)
    args, n, gpus = cfg.model, num_params(cfg.model), 64
    e = estimate(cfg, args, Assumptions(gpus=gpus))
    block = args.n_layers * sum(m * k for m, k in block_matrices(args))
    plain = _row(e, "ZeRO-3")
    for t in (2, 4, 8):
        r = _row(e, f"TP {t} + ZeRO-3")
        local, dp, k = n - block + block // t, gpus // t, plain["grad_accum"] * t
        assert tensor_parallel_params(args, n, t) == local and r["grad_accum"] == k
        assert r["memory_parts_gib"]["weights"] == pytest.approx(2 * local / dp / 2**30)
        assert r["memory_parts_gib"]["optimizer"] == pytest.approx(12 * local / dp / 2**30)
        # ZeRO-3's gathers of a rank's 1/t of each block matrix (counted rule: zero3_gathered)
        z = zero3_gathered(args, zero_sizes(cfg)["param_persistence_threshold"], cfg.distributed.max_reuse_distance, t)
        assert r["comm_gib_per_gpu"] == pytest.approx(comm_bytes(local, 3, dp, k, 2, 4, **z) / 2**30)
        # Per micro-batch 1/t of the block matrices, t times the micro-batches: per step the block
        # matrices' gradients move what plain ZeRO-3 moves, the rest (embedding, head, norms) t times that.
        k_plain = plain["grad_accum"]
        assert comm_volume(local, 3, dp, k, 2, 4, **z)["reduce_scatter"] == pytest.approx(
            4 * k_plain * (dp - 1) / dp * (block + t * (n - block)))
        allreduce = 2 * (t - 1) / t * 4096 * args.dim * 2
        assert tensor_parallel_bytes(args, 4096, 2, t) == allreduce
        assert r["tp_allreduce_gib_per_gpu"] == pytest.approx(k * (7 + 1) * args.n_layers * allreduce / 2**30)
        assert r["step_s"] == pytest.approx(max(r["compute_s"], r["comm_s"]) + r["tp_allreduce_s"])
        head = 6 * args.vocab_size * args.dim
        assert r["compute_s"] / plain["compute_s"] == pytest.approx(1 + (t - 1) * head / e["flops_per_token"])
    # Activations without checkpointing: (2p D + 2p KVd + 4 H + 4p F) per token per block split.
    T, p, D = 4096, 2, args.dim
    split = 2 * p * D + 2 * p * args.kv_heads * args.head_dim + 4 * args.n_heads + 4 * p * args.hidden_dim
    one, eight = (activation_bytes(args, T, p, 0, tp=t)["saved"] for t in (1, 8))
    assert one - eight == args.n_layers * T * split * 7 / 8
    assert activation_bytes(args, T, p, 1, tp=8)["saved"] == activation_bytes(args, T, p, 1)["saved"]  # inputs whole
    assert largest_layer_params(args, 8) == args.vocab_size * D  # the embedding is not split


def test_hpz_gathers_within_the_node_and_keeps_a_secondary_copy():
    """hpZ: of a step's 2k gathers the first crosses nodes (it builds the secondary partition), the
    other 2k - 1 run over the node's 8 GPUs; the reduce-scatters cross; 2 bytes per parameter over
    the node's GPUs more memory. ZeRO within one node runs at the in-node bandwidth."""
    n, k, world = 10**9, 4, 32
    psi = (world - 1) / world * n
    intra, inter = zero_traffic(n, 3, world, k, 2, 4, 8, hpz=True)
    assert intra == pytest.approx((2 * k - 1) * 7 / 8 * n * 2)
    assert inter == pytest.approx(k * psi * 4 + psi * 2)
    assert zero_traffic(n, 3, world, k, 2, 4, 8, hpz=False) == (0.0, comm_bytes(n, 3, world, k, 2, 4))
    assert zero_traffic(n, 3, 8, k, 2, 4, 8, hpz=False) == (comm_bytes(n, 3, 8, k, 2, 4), 0.0)
    cfg = load_config(REPO / "configs" / "7b.yaml", SHAPE)
    a = Assumptions(gpus=64)
    e = estimate(cfg, cfg.model, a)
    plain, hpz = _row(e, "ZeRO-3"), _row(e, "ZeRO-3 + hpZ")
    params = e["params"]
    assert hpz["memory_parts_gib"]["hpz_secondary"] == pytest.approx(2 * params / 8 / 2**30)
    assert hpz["memory_gib_per_gpu"] == pytest.approx(plain["memory_gib_per_gpu"] + 2 * params / 8 / 2**30)
    assert hpz["comm_gib_per_gpu"] < plain["comm_gib_per_gpu"]  # node gathers: 7/8 of the parameters, not 63/64
    assert hpz["comm_inter_node_gib_per_gpu"] < plain["comm_inter_node_gib_per_gpu"] / 1.9
    assert hpz["comm_s"] == pytest.approx(hpz["comm_inter_node_gib_per_gpu"] * 2**30 / (a.gbps / 8 * 1e9)
                                          + hpz["comm_intra_node_gib_per_gpu"] * 2**30 / (a.sp_gbps / 8 * 1e9))
    assert hpz["step_s"] < plain["step_s"] and e["recommended"] == "ZeRO-3 + hpZ"
    # The run's own figures follow distributed.hpz.
    on = load_config(REPO / "configs" / "7b.yaml", SHAPE + ["distributed.hpz=true"])
    assert estimate(on, on.model, a)["comm_s"] == pytest.approx(hpz["comm_s"])


def test_70b_config_and_its_layout_at_256_gpus(capsys):
    """configs/70b.yaml: the Llama 3 70B shape, valid on 32 nodes of 8 GPUs (plain, hpZ or TP 8).
    At 256 GPUs with 4M-token steps every layout fits; TP 8 needs less memory than plain ZeRO-3
    (one recomputed block's activations split, 7.5 GiB of peak less) but is slower (its all-reduces
    and the head computed 8 times, ZeRO's traffic per step no smaller): hpZ, compute-bound, is the
    fastest. Where the batch does not split over the GPUs (1024: 512 sequences), TP is what fits."""
    path = REPO / "configs" / "70b.yaml"
    cfg = load_config(path, [])
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.kv_heads, m.hidden_dim, m.vocab_size) == (8192, 80, 64, 8, 28672, 128256)
    assert cfg.data.seq_len == 8192 and cfg.global_batch(256) == 512 and cfg.train.activation_checkpointing
    for overrides in ([], ["distributed.hpz=true"], ["distributed.tensor_parallel=8"]):
        load_config(path, overrides).validate(256)
    e = estimate(cfg, m, Assumptions(gpus=256))
    assert 70.5e9 < e["params"] < 70.6e9
    plain, hpz, tp8 = _row(e, "ZeRO-3"), _row(e, "ZeRO-3 + hpZ"), _row(e, "TP 8 + ZeRO-3")
    assert all(r["fits"] for r in e["parallel_options"])
    assert tp8["memory_parts_gib"]["activations"] < plain["memory_parts_gib"]["activations"] - 3
    assert tp8["memory_gib_per_gpu"] < plain["memory_gib_per_gpu"] < hpz["memory_gib_per_gpu"] < 80
    assert tp8["step_s"] > plain["step_s"] > hpz["step_s"] == pytest.approx(hpz["compute_s"])
    assert e["recommended"] == "ZeRO-3 + hpZ"
    wide = load_config(path, ["distributed.tensor_parallel=2"])
    e = estimate(wide, wide.model, Assumptions(gpus=1024))
    assert "is not divisible by" in _row(e, "ZeRO-3")["error"] and e["recommended"] == "TP 2 + ZeRO-3"
    assert main(["estimate", str(path), "--gpus", "256"]) == 0
    out = capsys.readouterr().out
    assert "| TP 8 + ZeRO-3 | distributed.tensor_parallel=8 |" in out
    assert "recommended: ZeRO-3 + hpZ (the fastest that fits: 19.9 s per step): distributed.hpz=true" in out


def test_gpus_per_node_bounds_tensor_parallelism(tmp_path):
    out = tmp_path / "e.json"
    assert main(["estimate", str(REPO / "configs" / "7b.yaml"), "--gpus", "64", *SHAPE, "--gpus-per-node", "4",
                 "--json", str(out)]) == 0
    e = json.loads(out.read_text())
    assert [r["option"] for r in e["parallel_options"]] == ["ZeRO-3", "ZeRO-3 + hpZ", "TP 2 + ZeRO-3", "TP 4 + ZeRO-3"]
    assert _row(e, "ZeRO-3 + hpZ")["memory_parts_gib"]["hpz_secondary"] == pytest.approx(2 * e["params"] / 4 / 2**30)


def _accepted(path, overrides: list[str], row: dict, gpus: int = 0, sp: int = 0) -> list[str]:
    """The config's own problems with a table row's layout on the row's GPUs ([] = it runs)."""
    layout = [f"{k}={str(v).lower()}" for k, v in row.get("overrides", {}).items()]
    layout += [f"distributed.sequence_parallel={sp}"] if sp else []
    return load_config(path, overrides + layout).problems(gpus or row["gpus"])


def test_a_world_the_batch_does_not_split_over_gets_the_layouts(capsys):
    """configs/70b.yaml on 1024 GPUs: 512 sequences do not split over 1024 data-parallel ranks (nor
    do its 512 data streams), so the config as it is does not run there; the estimate says so in
    its run line and still gives the layouts, recommending TP 2 (512 data-parallel ranks), which the
    config accepts on 1024 GPUs. Where no layout runs, it still refuses in one line (exit 2)."""
    path = REPO / "configs" / "70b.yaml"
    assert main(["estimate", str(path), "--gpus", "1024"]) == 0
    out = capsys.readouterr().out
    assert "run: 1024 GPU(s), ZeRO-3, bf16, adamw, 4,194,304 tokens per step: not as configured: global batch of " \
           "512 sequences is not divisible by micro_batch_size 1 x world size 1024" in out
    assert "recommended: TP 2 + ZeRO-3 (the fastest that fits: " in out and "distributed.tensor_parallel=2\n" in out
    cfg = load_config(path, [])
    e = estimate(cfg, cfg.model, Assumptions(gpus=1024))
    assert e["refused"] and "step_s" not in e and e["recommended"] == "TP 2 + ZeRO-3"
    assert "is not divisible" in _row(e, "ZeRO-3")["error"] and "step_s" not in _row(e, "ZeRO-3")
    for r in e["parallel_options"]:
        assert ("error" in r) == bool(_accepted(path, [], r, 1024)), r
    assert main(["estimate", str(TINY), "--gpus", "3", "train.micro_batch_size=4", "train.global_batch_size=8"]) == 2
    assert "pretrain: error: global batch of 8 sequences is not divisible" in capsys.readouterr().err


@pytest.mark.parametrize("path,overrides,gpus", [
    ("70b.yaml", ["data.seq_len=131072", "model.max_seq_len=131072", "distributed.sequence_parallel=8"], 256),
    ("70b.yaml", ["distributed.tensor_parallel=2"], 256),
    ("7b.yaml", SHAPE + ["distributed.hpz=true"], 64),
    ("7b.yaml", ["model.vocab_size=32000", "data.seq_len=131072", "model.max_seq_len=131072",
                 "train.global_batch_tokens=4194304", "distributed.sequence_parallel=8"], 64),
], ids=["70b-sp8", "70b-tp2", "7b-hpz", "7b-sp8"])
def test_the_tables_list_only_layouts_the_config_accepts(path, overrides, gpus, capsys):
    """Every row of the layout table and of the sequence-parallel table is a layout the config's own
    validation (Config.problems) accepts on the row's GPUs, at the configured sequence_parallel.
    70B at 131k tokens per sequence over 8 GPUs fits (47 GiB): so must the layout table's
    recommendation, at sequence_parallel=8, without tensor parallelism (which the config refuses
    with it); under TP the sequence-parallel table has no SP > 1 row (refused with it)."""
    path = REPO / "configs" / path
    cfg = load_config(path, overrides)
    e = estimate(cfg, cfg.model, Assumptions(gpus=gpus))
    sp = cfg.distributed.sequence_parallel
    for r in e["parallel_options"]:
        assert "error" not in r and r["sequence_parallel"] == sp, r
        assert _accepted(path, overrides, r) == [], r
    for r in e["sequence_parallel_table"]:
        assert _accepted(path, overrides, r, sp=r["sequence_parallel"]) == [], r
    if sp > 1:
        assert [r["option"] for r in e["parallel_options"]] == ["ZeRO-3", "ZeRO-3 + hpZ"]
        assert {"TP 2 + ZeRO-3", "TP 8 + ZeRO-3"} <= set(e["not_listed"])
    if cfg.distributed.tensor_parallel > 1:
        assert [r["sequence_parallel"] for r in e["sequence_parallel_table"]] == [1]
    if e["fits"]:
        assert e["recommended"] is not None
        assert "recommended: none" not in report(e)
    if path.name == "70b.yaml" and sp == 8:
        assert 45 < e["memory_gib_per_gpu"] < 50 and e["recommended"] == "ZeRO-3"


def test_muon_step_all_to_all_within_a_node_at_the_in_node_bandwidth():
    """Muon's all-to-alls run over the ZeRO ranks: on the GPUs of one node at the in-node bandwidth
    (Assumptions.sp_gbps), over more at the network's (the counted bytes: tests/test_traffic.py)."""
    cfg = load_config(REPO / "configs" / "1b.yaml", ["model.vocab_size=50304", "optimizer.name=muon"])
    for gpus, gbps in ((8, Assumptions(gpus=8).sp_gbps), (16, Assumptions(gpus=16).gbps)):
        e = estimate(cfg, cfg.model, Assumptions(gpus=gpus))
        m = e["muon"]
        assert m["step_comm_s"] == pytest.approx(m["step_comm_gib_per_gpu"] * 2**30 / (gbps * 1e9 / 8))
        assert e["optimizer_step_s"] == pytest.approx(m["ns_s"] + m["step_comm_s"])
        assert f"s at {gbps:g} Gbit/s; " in report(e)


@pytest.mark.parametrize("stage", [1, 2])
def test_expert_parallelism_at_zero_1_and_2_holds_a_gpus_experts_whole_and_their_states_sharded(stage):
    """Mixtral 8x7B on 64 GPUs in bf16 at ZeRO-1/2: with expert parallelism 8 a GPU holds the dense
    weights and its 1/8 of the experts whole (16-bit), not all of them, while the optimizer state
    stays sharded 1/64 either way (an expert's over the 8 GPUs that hold it); the option is listed
    under the config's stage."""
    from pretrain.estimate.comm import expert_params
    from pretrain.estimate.memory import GIB

    over = ["model.vocab_size=32000", f"distributed.zero_stage={stage}", "distributed.grad_dtype=bf16"]
    est = {ep: estimate(cfg, cfg.model, Assumptions(gpus=64)) for ep in (1, 8)
           for cfg in [load_config(REPO / "configs" / "mixtral_8x7b.yaml", over + [f"distributed.expert_parallel={ep}"])]}
    args = load_config(REPO / "configs" / "mixtral_8x7b.yaml", over).model
    n, experts = num_params(args), expert_params(args)
    parts = {ep: est[ep]["memory_parts_gib"] for ep in (1, 8)}
    assert parts[1]["weights"] * GIB == pytest.approx(2 * n)
    assert parts[8]["weights"] * GIB == pytest.approx(2 * (n - experts + experts / 8))
    assert parts[8]["optimizer"] == pytest.approx(parts[1]["optimizer"]) == pytest.approx(12 * n / 64 / GIB)
    rows = {r["option"] for r in est[1]["parallel_options"]}
    assert f"EP 8 + ZeRO-{stage}" in rows
    assert "each holds 1/8 of the experts whole, their optimizer state split over the 8 GPUs" in report(est[8])


def test_mixtral_8x7b_config_counts_every_expert_and_prices_the_active_ones():
    """configs/mixtral_8x7b.yaml: Mixtral 8x7B's published counts (46.7B parameters, 12.9B active
    with its 32k vocabulary); FLOPs per token and the compute time follow the active ones, memory and
    ZeRO-3's traffic every expert (without expert parallelism each is gathered on every GPU); expert
    parallelism gathers a GPU's share of the experts only (ZeRO traffic falls with its size, the
    tokens' all-to-all grows towards 1 of k x D per token), and on 64 GPUs the estimate recommends
    8 (a node's GPUs); the layouts the config refuses (tensor parallelism with stacked experts) are
    not recommended."""
    cfg = load_config(REPO / "configs" / "mixtral_8x7b.yaml", ["model.vocab_size=32000"])
    e = estimate(cfg, cfg.model, Assumptions(gpus=64))
    assert 46.6e9 < e["params"] < 46.8e9 and 12.8e9 < e["params_active"] < 13.0e9
    dense = load_config(REPO / "configs" / "7b.yaml", ["model.vocab_size=32000", "model.rope_theta=1000000.0"])
    d = estimate(dense, dense.model, Assumptions(gpus=64))
    # the active FFN is two experts of the 7B's width: twice its FFN FLOPs, far from 8 times
    assert 1.5 < e["flops_per_token"] / d["flops_per_token"] < 2.0
    assert e["params"] / d["params"] > 6 and e["memory_gib_per_gpu"] > 2.5 * d["memory_gib_per_gpu"]
    assert all(not r["option"].startswith("TP") for r in e["parallel_options"])
    rows = {r["option"]: r for r in e["parallel_options"]}
    assert [n for n in rows if n.startswith("EP")] == ["EP 2 + ZeRO-3", "EP 4 + ZeRO-3", "EP 8 + ZeRO-3"]
    zero = [rows[n]["comm_gib_per_gpu"] for n in ("ZeRO-3", "EP 2 + ZeRO-3", "EP 4 + ZeRO-3", "EP 8 + ZeRO-3")]
    assert zero == sorted(zero, reverse=True) and zero[-1] < zero[0] / 4
    assert rows["ZeRO-3"]["expert_all_to_all_s"] == 0
    a2a = [rows[f"EP {n} + ZeRO-3"]["expert_all_to_all_gib_per_gpu"] for n in (2, 4, 8)]
    assert a2a == sorted(a2a) and a2a[0] > 0
    # 16 micro-batches of 4,096 tokens, 32 MoE blocks, recomputed: 3 exchanges of 2 x 7/8 of k = 2 rows of D in bf16
    assert a2a[2] * 2**30 == pytest.approx(16 * 32 * 3 * 2 * 7 / 8 * 4096 * 2 * 4096 * 2)
    assert all(rows[f"EP {n} + ZeRO-3"]["memory_gib_per_gpu"] == pytest.approx(rows["ZeRO-3"]["memory_gib_per_gpu"])
               for n in (2, 4, 8))  # (each GPU still holds 1/64 of every expert's states)
    assert e["recommended"] == "EP 8 + ZeRO-3"
    text = report(e)
    assert "12,879.9M active per token" in text and "recommended: EP 8 + ZeRO-3" in text
    ep = load_config(REPO / "configs" / "mixtral_8x7b.yaml", ["model.vocab_size=32000", "distributed.expert_parallel=8"])
    assert "expert parallelism over 8 GPUs" in report(estimate(ep, ep.model, Assumptions(gpus=64)))


def test_muon_estimate_counts_each_expert_as_the_optimizer_steps_it():
    """An MoE model under Muon: the estimate's matrices are the optimizer's, in its order (the
    routers, each block's stacked experts, the shared experts, a dense first block's FFN), and the
    Newton-Schulz FLOPs count each expert apart, as pretrain/optim/muon.py costs them for its owners."""
    from pretrain.optim.muon import matrix_flops
    from pretrain.optim.optimizer import muon_param_groups

    cfg = load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_hidden_dim=64",
                             "model.moe_shared_experts=1", "model.moe_dense_layers=1", "optimizer.name=muon",
                             "model.vocab_size=512"])
    groups = muon_param_groups(Transformer(cfg.model), cfg.optimizer)
    muon = [p for g in groups if g["use_muon"] for p in g["params"]]
    assert sum(p.is_expert_group for p in muon) == 3 * (cfg.model.n_layers - 1)
    step = muon_step(cfg.model, 0, 1, 10**9, 4)
    assert sorted(tuple(p.shape) for p in muon) == sorted(s for g in muon_matrices(cfg.model) for s in g)
    assert step["params"] == sum(p.numel() for p in muon)
    assert step["flops_total"] == sum(matrix_flops(p.shape, None, "gram", p.is_expert_group) for p in muon)
    stacked = next(p for p in muon if p.is_expert_group)
    assert matrix_flops(stacked.shape, experts=True) == 4 * newton_schulz_flops(*stacked.shape[1:])


def test_muon_step_under_expert_parallelism_runs_per_partition_group():
    """Muon's ZeRO-3 step under expert parallelism (pretrain/optim/muon.py runs it per partition
    group): the dense matrices over the world, each rank's E/ep experts over the world/ep ranks that
    hold them. The same matrices and Newton-Schulz work in all; the experts' part of the busiest
    rank's work is that of E/ep experts over world/ep owners. (Priced, not counted on ranks.)"""
    cfg = load_config(TINY, ["model.moe_experts=4", "model.moe_top_k=2", "model.moe_hidden_dim=64",
                             "model.moe_dense_layers=1", "optimizer.name=muon", "model.vocab_size=512"])
    args, bucket = cfg.model, 10**9
    one, two = muon_step(args, 3, 4, bucket, 4), muon_step(args, 3, 4, bucket, 4, ep=2)
    assert two["params"] == one["params"] and two["flops_total"] == one["flops_total"]
    stacked = [s for g in muon_matrices(args) for s in g if len(s) == 3]
    dense = [s for g in muon_matrices(args) for s in g if len(s) == 2]
    assert len(stacked) == 3 * (args.n_layers - 1)
    # each of the 2 owners of an expert-data-parallel group takes whole stacks of 2 experts
    expert_flops = sorted((2 * newton_schulz_flops(*s[1:]) for s in stacked), reverse=True)
    load = [0, 0]
    for f in expert_flops:
        load[load.index(min(load))] += f
    dense_only = muon_step(args, 3, 4, bucket, 4)  # (every stack over 4 ranks: another assignment)
    assert two["flops"] <= max(load) + sum(newton_schulz_flops(*s) for s in dense)
    assert two["flops"] > max(load) and dense_only["flops"] > 0
    assert muon_step(args, 0, 4, bucket, 4, ep=2)["flops"] == one["flops_total"]  # (below ZeRO-3: every rank, every matrix)
