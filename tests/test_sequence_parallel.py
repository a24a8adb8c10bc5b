"""Ulysses sequence parallelism and document masking: exact against one rank, on the user's path
(ZeRO-3, activation checkpointing, bf16 and fp32, seq_len >= 1024), at 2 and 4 CPU ranks, and
resumable across sequence-parallel and data-parallel sizes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import data_pipeline as dp
from helpers import (REPO, free_port, losses, read_metrics, run_train, saved_for_backward, tokens_drawn_are_tokens_seen,
                     train_env)
from pretrain.config import load_config
from pretrain.model.args import ModelArgs
from pretrain.model.model import Transformer

# -- the data path: slices, positions, documents


def test_a_shard_is_the_ranks_slice_with_its_positions_and_the_whole_documents():
    tokens = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 3], [1, 2, 3, 4, 5, 6, 7, 8]])
    batch = {"input_ids": tokens, "labels": tokens.roll(-1, 1)}
    batch["labels"][0, :3] = -100
    parts = [dp.sequence_shard(batch, r, 2, eot=0) for r in range(2)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), tokens)
    assert parts[1]["positions"].tolist() == [[4, 5, 6, 7]] * 2  # where the tokens are, not 0..3
    assert parts[0]["documents"].tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0] * 8]  # whole, on every rank
    assert parts[0]["label_count"] == parts[1]["label_count"] == 13 / 2  # the group's scored labels per rank
    restarted = dp.sequence_shard(batch, 1, 2, eot=0, restart_positions=True)["positions"]
    assert restarted.tolist() == [[2, 3, 0, 1], [4, 5, 6, 7]]  # the separator opens a document at 0
    with pytest.raises(ValueError, match="not divisible"):
        dp.sequence_shard(batch, 0, 3)


@pytest.mark.parametrize("change, named", [
    ("distributed.sequence_parallel=3", "does not divide model.n_heads=4"),
    ("data.seq_len=129", "does not divide data.seq_len=129"),
    ("distributed.sequence_parallel=0", "must be >= 1"),
    ("model.document_positions=true", "only means something with model.document_mask=true"),
])
def test_an_impossible_layout_is_named_with_its_fix(change, named):
    base = ["distributed.sequence_parallel=2"]
    with pytest.raises(Exception, match=named):
        load_config(REPO / "configs" / "tiny.yaml", [*base, change], world_size=2)


def test_every_problem_of_a_layout_is_reported_at_once():
    """sequence_parallel=3 on 2 ranks: the heads, the sequence and the world size, together (the
    world size was checked only when nothing else was wrong)."""
    from pretrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / "tiny.yaml", ["distributed.sequence_parallel=3"], world_size=2)
    text = str(e.value)
    for named in ("does not divide model.n_heads=4", "does not divide data.seq_len=128",
                  "does not divide the world size 2"):
        assert named in text, text
    with pytest.raises(ConfigError, match="train.global_batch_size=0|not divisible by micro_batch_size") as e:
        load_config(REPO / "configs" / "tiny.yaml", ["model.n_heads=3", "train.global_batch_size=24"], world_size=5)
    assert "model.dim=128 is not divisible by model.n_heads=3" in str(e.value)


def test_a_size_that_does_not_divide_the_world_is_one_line_and_exit_2(tmp_path):
    proc = run_train([f"train.run_dir={tmp_path}", "distributed.sequence_parallel=2"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "does not divide the world size 1" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- the model: one process against a sequence-parallel group, gradients and all

_EXACT = r"""
import copy, json, sys, torch, torch.distributed as dist, torch.nn.functional as F
import data_pipeline as dp
from pretrain.model.args import ModelArgs
from pretrain.model.model import Transformer
from pretrain.parallel import distributed, ulysses

world = distributed.init("gloo")
T, B, EOT = 1024, 2, 0
out, env = [], None
for sp, kv, mask, positions in [(int(sp), *case) for sp in sys.argv[1:] for case in
                                [(4, False, False), (2, False, False), (1, True, True), (2, True, False)]]:
    if env is None or env.sp != sp:  # (another size of group in the same world: its groups made anew)
        distributed._SEQUENCE_GROUP = None
        env = distributed.init_layout(world, sp, 1)
        group = distributed.sequence_group()
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=kv, vocab_size=128, multiple_of=32, max_seq_len=T,
                     document_mask=mask, document_positions=positions, eot_id=EOT)
    torch.manual_seed(0)
    whole = Transformer(args)
    whole.init_weights()
    model = copy.deepcopy(whole)
    ulysses.apply(model, group, sp)
    g = torch.Generator().manual_seed(7 + env.dp_rank)  # each data-parallel group its own sequences
    tokens = torch.randint(1, 128, (B, T + 1), generator=g)
    if mask:  # documents of random lengths
        tokens[torch.rand(B, T + 1, generator=g) < 0.01] = EOT
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, : 3 * T // 8] = -100  # unscored labels, all on the first ranks' slices
    ref = whole(inputs, labels, **dp.document_inputs(inputs, EOT if mask else None, positions))
    ref.backward()
    shard = dp.sequence_shard({"input_ids": inputs, "labels": labels}, env.sp_rank, sp, EOT if mask else None,
                              positions)
    extra = {k: v for k, v in shard.items() if k not in ("input_ids", "labels")}
    loss = model(shard["input_ids"], shard["labels"], **extra)
    loss.backward()
    # What DeepSpeed does over the ranks: average the losses and the gradients.
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=group)
    mean /= sp
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), whole.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=group)
        grad /= sp
        worst = max(worst, ((grad - q.grad).abs().max() / q.grad.abs().max()).item())
    case = {"sp": sp, "kv": kv, "mask": mask, "positions": positions, "loss": mean.item(), "ref": ref.item(),
            "grad": worst}
    if mask:  # the packed sequence scores token for token like each document alone
        with torch.no_grad():
            logits = model(shard["input_ids"], positions=shard["positions"], documents=shard["documents"])
            parts = [torch.empty_like(logits) for _ in range(sp)]
            dist.all_gather(parts, logits.contiguous(), group=group)
            packed = F.cross_entropy(torch.cat(parts, 1).flatten(0, 1), tokens[:, 1:].flatten(),
                                     reduction="none").view(B, T)
            alone = torch.empty(B, T)
            plain = copy.deepcopy(whole)
            plain.args.document_mask = False
            docs = dp.document_ids(inputs, EOT)
            for b in range(B):
                for d in docs[b].unique():
                    idx = (docs[b] == d).nonzero().flatten()
                    start, end = idx[0].item(), idx[-1].item() + 1
                    pos = torch.arange(0 if positions else start, (0 if positions else start) + end - start)
                    lg = plain(inputs[b:b + 1, start:end], positions=pos[None])
                    alone[b, start:end] = F.cross_entropy(lg[0], tokens[b, start + 1:end + 1], reduction="none")
            case["alone"] = (packed - alone).abs().max().item()
            case["documents"] = int(docs.max()) + 1
    out.append(case)
if world.rank == 0:
    print("RESULT " + json.dumps(out))
distributed.shutdown()
"""


def _exact(nproc: int, sps: list[int], tmp_path) -> list[dict]:
    script = tmp_path / "exact.py"
    script.write_text(_EXACT)
    cmd = [sys.executable, str(script), *map(str, sps)]
    if nproc > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env({"PYTHONPATH": str(REPO)}), capture_output=True, text=True,
                          timeout=300)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("nproc, sps", [  # (4 ranks on 2 cores, and the reference alone: the full suite's)
    pytest.param(1, [1], marks=pytest.mark.slow, id="1-1"), pytest.param(2, [2], id="2-2"),
    pytest.param(4, [4, 2], marks=pytest.mark.slow, id="4-4-and-2")])  # (both layouts of 4 ranks in one launch)
def test_a_sequence_parallel_group_computes_what_one_process_does(nproc, sps, tmp_path):
    """Loss within 1e-6 (relative, fp32) and every gradient within 1e-5 of its tensor's largest entry,
    with MHA, GQA, KV heads replicated (1 and 2 KV heads at N = 4), unscored labels on some ranks
    only (the mean is over the group's tokens, not of the ranks' means), positions offset to the
    slice's place, and document masking: token for token like each document alone."""
    cases = _exact(nproc, sps, tmp_path)
    assert [c["sp"] for c in cases] == [sp for sp in sps for _ in range(4)]
    for case in cases:
        assert case["loss"] == pytest.approx(case["ref"], rel=1e-6), case
        assert case["grad"] < 1e-5, case
        if case["mask"]:
            assert case["documents"] > 10, case
            assert case["alone"] < 1e-5, case


def test_document_masking_scores_like_each_document_alone_in_one_process():
    args = ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, multiple_of=32, max_seq_len=64,
                     document_mask=True, document_positions=True, eot_id=0)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.tensor([[3, 4, 5, 0, 6, 7, 8, 9, 0, 10, 11]])
    packed = model(tokens, **dp.document_inputs(tokens, 0, restart_positions=True))
    with pytest.raises(ValueError, match="needs the batch's `documents`"):  # the model computes no boundaries
        model(tokens)
    unmasked = Transformer(ModelArgs(**{**args.__dict__, "document_mask": False, "document_positions": False}))
    unmasked.load_state_dict(model.state_dict())
    for start, end in [(0, 3), (3, 8), (8, 11)]:
        alone = unmasked(tokens[:, start:end])
        torch.testing.assert_close(packed[:, start:end], alone, rtol=0, atol=1e-5)
    assert not torch.allclose(packed, unmasked(tokens), atol=1e-3)  # the mask does something


@pytest.mark.parametrize("positions", [False, True])
def test_the_flex_attention_mask_equals_the_dense_one(monkeypatch, positions):
    """GPUs get FlexAttention's block mask, CPUs a dense boolean one: the same attention. Here both run
    on the CPU (FlexAttention eagerly, forward only: it has no backward on CPU), with GQA, documents
    of several lengths and, with `positions`, RoPE positions restarting in each document."""
    import pretrain.model.attention as m

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=256,
                     document_mask=True, document_positions=positions, eot_id=0)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(1, 64, (2, 256), generator=torch.Generator().manual_seed(1))
    tokens[0, ::37] = 0
    tokens[1, [5, 6, 100, 230]] = 0
    out = {}
    for flex in (True, False):
        monkeypatch.setattr(m, "FLEX_DEVICES", {"cpu"} if flex else set())
        assert isinstance(m.document_mask(dp.document_ids(tokens, 0)), m.BlockMask) == flex
        with torch.no_grad():
            out[flex] = model(tokens, **dp.document_inputs(tokens, 0, positions))
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)
    args.document_mask = args.document_positions = False
    with torch.no_grad():
        assert not torch.allclose(out[True], model(tokens), atol=1e-3)  # (the mask changes the logits)


def test_mlp_tiles_compute_the_same_and_keep_only_their_inputs(tmp_path):
    """train.mlp_chunk_tokens: the same loss and gradients as the whole MLP, and through the trainer
    the (tokens, hidden_dim) intermediates of the 4 layers are not saved for backward; it fails if
    the field is not passed."""
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=128, multiple_of=32, max_seq_len=512)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, 128, (2, 257), generator=torch.Generator().manual_seed(3))
    grads = {}
    for chunk in (0, 96):  # (a tile size that does not divide the 512 tokens)
        for block in model.layers:
            block.feed_forward.chunk = chunk
        model.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads[chunk] = (loss.item(), [p.grad.clone() for p in model.parameters()])
    assert grads[96][0] == pytest.approx(grads[0][0], rel=1e-6)
    for a, b in zip(grads[0][1], grads[96][1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)

    base = ["data.seq_len=64", "train.micro_batch_size=4", "train.max_steps=1", "distributed.zero_stage=0",
            "train.eval_every=0", "logging.wandb=disabled", "train.loss_chunk_tokens=32"]
    hidden, n = ModelArgs(**{**ModelArgs().__dict__, "dim": 128, "multiple_of": 64}).hidden_dim, 4 * 64
    whole = saved_for_backward([*base, f"train.run_dir={tmp_path / 'whole'}"])
    tiled = saved_for_backward([*base, "train.mlp_chunk_tokens=32", f"train.run_dir={tmp_path / 'tiled'}"])
    # per layer the whole MLP saves w1's and w3's outputs, silu's and the product (fp32); tiles their inputs only
    assert whole["bytes"] - tiled["bytes"] >= 4 * 3 * n * hidden * 4, (whole, tiled)


# -- training: the user's path


def _losses_and_eval(run):
    records = read_metrics(run)
    return losses(run), [r["eval/loss"] for r in records if "eval/loss" in r]


# (a narrower, shallower model and the 512-token vocabulary: the layout is the subject, not the shape; 4 heads,
# so that SP=2 splits them)
SP_RUN = ["data.seq_len=1024", "model.max_seq_len=1024", "train.micro_batch_size=1", "train.global_batch_size=2",
          "train.max_steps=3", "logging.log_every=1", "logging.wandb=disabled", "train.eval_every=3",
          "train.eval_batches=1", "distributed.zero_stage=3", "train.activation_checkpointing=1",
          "schedule.warmup_steps=1", "data.num_streams=4", "model.dim=64", "model.n_layers=2",
          "data.tokenizer=builtin:python-bpe-512"]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """SP_RUN at one rank in fp32 (ZeRO-3) with a checkpoint after every step, all kept: the reference of the
    fp32 runs below with no other setting, and the uninterrupted run the resumes are held against
    (its step-1 checkpoint the start of one)."""
    run = tmp_path_factory.mktemp("sp") / "one"
    run_train([*SP_RUN, "train.precision=fp32", "checkpoint.every=1", "checkpoint.keep_last=3", f"train.run_dir={run}"])
    return run


def _norms(run) -> dict[int, float]:
    return {r["step"]: r["train/grad_norm"] for r in read_metrics(run) if "train/grad_norm" in r}


@pytest.mark.slow
@pytest.mark.parametrize("precision, stage, extra, rel", [
    ("fp32", 3, ["model.document_mask=true", "model.document_positions=true"], 1e-6),
    ("bf16", 3, ["train.mlp_chunk_tokens=256"], 5e-3),
    ("fp32", 3, ["optimizer.name=muon"], 1e-4),  # (Newton-Schulz magnifies the reductions' rounding)
    ("fp32", 0, [], 1e-6),
    ("fp32", 2, [], 1e-6),
])
def test_sequence_parallel_training_equals_one_rank(request, tmp_path, precision, stage, extra, rel):
    """SP=2 against one rank: the loss and the global gradient norm of every step (a gradient off by
    a factor the loss and Adam's normalised update would hide shows in the norm), the weights after
    the last step, the in-loop eval, and the tokens drawn (one count per sequence). The fp32 runs
    with no other setting (ZeRO-0 and ZeRO-2) share one reference, one rank at ZeRO-3 (`one_rank`):
    one rank computes the same at every stage."""
    if precision == "fp32" and not extra:
        one = request.getfixturevalue("one_rank")
    else:
        one = tmp_path / "sp1"
        run_train([*SP_RUN, *extra, f"train.precision={precision}", f"train.run_dir={one}",
                   f"distributed.zero_stage={stage}"])
    run_train([*SP_RUN, *extra, f"train.precision={precision}", f"train.run_dir={tmp_path / 'sp2'}",
               f"distributed.zero_stage={stage}", "distributed.sequence_parallel=2"], nproc=2)
    (one_losses, one_eval), (two, two_eval) = _losses_and_eval(one), _losses_and_eval(tmp_path / "sp2")
    assert one_losses.keys() == two.keys() == {1, 2, 3}
    norms = _norms(one), _norms(tmp_path / "sp2")
    for step in one_losses:
        assert two[step] == pytest.approx(one_losses[step], rel=rel), (step, one_losses, two)
        # (the first step's norm is of the same weights' gradients; later ones of weights that
        # Adam's eps-scale updates moved apart by a few 1e-6)
        assert norms[1][step] == pytest.approx(norms[0][step], rel=rel if step == 1 else max(rel, 1e-4)), (step, norms)
    assert two_eval == pytest.approx(one_eval, rel=rel)
    from pretrain.checkpoint.weights import consolidated_state_dict

    a, b = (consolidated_state_dict(run / "checkpoints" / "step_00000003") for run in (one, tmp_path / "sp2"))
    bound = 2e-2 if precision == "bf16" else 1e-4
    if "optimizer.name=muon" in extra:  # DeepSpeed's Newton-Schulz in fp16 where the CPU has it (AVX512-FP16): 1.1e-4
        from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

        bound = bound if ns_compute_dtype("gram") == torch.float32 else 1e-3
    for name in a:  # (relative Frobenius norm: Adam magnifies gradients near its eps; bf16 its rounding)
        assert ((b[name] - a[name]).norm() / a[name].norm()).item() < bound, name
    tokens_drawn_are_tokens_seen(tmp_path / "sp2")


@pytest.mark.slow
def test_sequence_and_data_parallel_on_four_ranks_equal_one_rank(one_rank, tmp_path):
    """SP=2 x DP=2: two groups read different sequences, each split in two; in-loop eval too (one
    rank: the shared `one_rank` run)."""
    run_train([*SP_RUN, "train.precision=fp32", f"train.run_dir={tmp_path / 'four'}",
               "distributed.sequence_parallel=2"], nproc=4, timeout=600)
    (one, one_eval), (four, four_eval) = _losses_and_eval(one_rank), _losses_and_eval(tmp_path / "four")
    assert one.keys() == four.keys() == {1, 2, 3}
    for step in one:
        assert four[step] == pytest.approx(one[step], rel=1e-6), (step, one, four)
    assert four_eval == pytest.approx(one_eval, rel=1e-6)


@pytest.mark.slow
def test_a_run_resumes_across_sequence_and_data_parallel_sizes(one_rank, tmp_path):
    """Saved at (DP 1, SP 2), resumed at (DP 1, SP 1); saved at (DP 1, SP 1) (the step-1 checkpoint of
    the shared `one_rank` run), resumed at (DP 2, SP 2): the losses of the uninterrupted `one_rank`
    run, the data position exact, two steps after each resume (the second one's loss is of an update
    with Adam's restored moments)."""
    want = losses(one_rank)
    common = [*SP_RUN, "train.precision=fp32", "train.eval_every=0"]
    first = tmp_path / "from2x2to1x1"
    run_train([*common, "train.max_steps=1", f"train.run_dir={first}", "distributed.sequence_parallel=2"], nproc=2)
    second, start = tmp_path / "from1x1to4x2", one_rank / "checkpoints" / "step_00000001"
    for ckpt, dp_sp in [(first / "checkpoints" / "step_00000001", (1, 2)), (start, (1, 1))]:
        meta = json.loads((ckpt / "meta.json").read_text())
        assert (meta["step"], meta["data_parallel"], meta["sequence_parallel"], meta["tensor_parallel"]) == \
            (1, *dp_sp, 1)
    run_train([*common, "checkpoint.resume=auto", f"train.run_dir={first}"])
    run_train([*common, f"checkpoint.resume={start}", f"train.run_dir={second}",
               "distributed.sequence_parallel=2"], nproc=4, timeout=600)
    for run, steps in [(first, {1, 2, 3}), (second, {2, 3})]:  # (the second run dir holds only the resumed steps)
        got = losses(run)
        assert got.keys() == steps and steps <= want.keys(), (run.name, got, want)
        for step in steps:
            assert got[step] == pytest.approx(want[step], rel=1e-6), (run.name, step, got, want)


@pytest.mark.slow
def test_sequence_parallel_with_everything_else_on(tmp_path):
    """SP=2 with ZeRO-1, bf16, compile, muP, gradient accumulation, a chunked loss, a WSD-S decay
    branch, in-loop and task evaluation and the fault switch (a NaN step dropped) trains like one
    rank without any of the parallelism (bf16: within 5e-3)."""
    tasks = tmp_path / "mine.jsonl"
    tasks.write_text("".join(json.dumps({"context": c, "continuation": x}) + "\n" for c, x in
                             [("The function", " returns"), ("A list is", " mutable"), ("import", " os")]))
    common = ["train.max_steps=4", "logging.log_every=1", "logging.wandb=disabled", "data.seq_len=256",
              "train.micro_batch_size=1", "train.global_batch_size=2", "distributed.zero_stage=1",
              "train.precision=bf16", "model.parametrization=mup", "model.mup_base_dim=64",
              "model.mup_base_head_dim=32", "schedule.kind=wsd", "schedule.decay_points=[3]",
              "schedule.warmup_steps=1", "train.eval_every=4", "train.eval_batches=1", f"train.eval_tasks=[{tasks}]",
              "train.loss_chunk_tokens=64", "train.on_nonfinite=skip", "data.num_streams=4",
              "model.n_layers=2", "data.tokenizer=builtin:python-bpe-512"]  # (64: two chunks of a rank's 128 tokens)
    fault = {"PRETRAIN_FAULT": "nan@step=2"}
    run_train([*common, f"train.run_dir={tmp_path / 'one'}"], env=fault)
    run_train([*common, f"train.run_dir={tmp_path / 'two'}", "distributed.sequence_parallel=2", "train.compile=true"],
              nproc=2, env=fault, timeout=600)
    one, two = (read_metrics(tmp_path / name) for name in ("one", "two"))
    train = [[(r["step"], r["train/loss"]) for r in m if "train/loss" in r] for m in (one, two)]
    assert [s for s, _ in train[0]] == [s for s, _ in train[1]] == [1, 2, 3, 4]
    assert all(a != a and b != b for (s, a), (_, b) in zip(*train) if s == 2)  # the NaN step, dropped on both
    for (step, a), (_, b) in zip(*train):
        if step != 2:
            assert b == pytest.approx(a, rel=5e-3), (step, train)
    final = [next(r for r in m if "eval/mine/acc" in r) for m in (one, two)]
    for key in ("eval/loss", "eval/mine/loss", "eval/mine/bpb"):
        assert final[1][key] == pytest.approx(final[0][key], rel=5e-3), key
    branch = [next(r for r in m if "branch/eval_loss" in r) for m in (one, two)]
    assert branch[1]["branch/end_step"] == branch[0]["branch/end_step"] == 3
    assert branch[1]["branch/eval_loss"] == pytest.approx(branch[0]["branch/eval_loss"], rel=5e-3)
