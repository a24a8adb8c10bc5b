"""End-to-end training runs in real processes (DeepSpeed ZeRO-3 on CPU, gloo)."""

import json
import math
import re

import pytest
import torch

from helpers import losses, read_metrics, read_wandb_records, run_train, saved_for_backward, shared_file, wandb_history

pytestmark = pytest.mark.slow

# Small and deterministic: 4 sequences of 64 tokens per micro-batch, a global batch of 8.
SMALL = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.log_every=1",
         "logging.wandb=disabled", "schedule.warmup_steps=2", "schedule.decay_steps=10",
         "distributed.zero_stage=3", "distributed.param_persistence_threshold=0"]


def test_the_quick_start_trains_as_the_readme_says(tmp_path):
    """configs/tiny.yaml as shipped (the README's quick start: built-in corpus and tokenizer, 200
    steps): the loss starts at ln(4096) = 8.3 and ends near 4.1, held-out loss below 5.2."""
    run = tmp_path / "tiny"
    proc = run_train([f"train.run_dir={run}", "logging.wandb=disabled"])
    done = re.search(r"^done: 200 steps, loss ([\d.]+) -> ([\d.]+), eval loss ([\d.]+)", proc.stdout, re.M)
    assert done, proc.stdout[-1000:]
    first, last, final_eval = map(float, done.groups())  # step 1's loss, step 200's, the last eval
    assert first == pytest.approx(math.log(4096), abs=0.1)
    assert 3.8 < last < 4.4 and final_eval < 5.2
    records = [r for r in read_metrics(run) if "train/loss" in r]
    assert records[-1]["step"] == 200 and records[-1]["tokens_seen"] == 200 * 16 * 128
    assert 3.8 < records[-1]["train/loss"] < 4.5  # (the mean of steps 191-200)
    [logged_eval] = [r["eval/loss"] for r in read_metrics(run) if "eval/loss" in r and r["step"] == 200]
    assert logged_eval == pytest.approx(final_eval, abs=1e-3)


def test_tiny_preset_learns_shakespeare_with_gpt2_tokenizer(tmp_path):
    text, tok = shared_file("tinyshakespeare.txt"), shared_file("gpt2-tokenizer.json")
    run = tmp_path / "run"
    proc = run_train([f"data.sources=[{{path: {text}}}]", f"data.tokenizer={tok}", "data.seq_len=64",
                      "train.micro_batch_size=8", "train.max_steps=40", "optimizer.lr=3e-3",
                      "schedule.warmup_steps=5", "logging.log_every=5", "logging.wandb=disabled",
                      f"train.run_dir={run}"])
    records = [r for r in read_metrics(run) if "train/loss" in r]
    first, last = records[0], records[-1]
    # ln(50304) = 10.8 at init; a model that learns is several nats lower after 40 steps.
    assert first["train/loss"] > 9.0
    assert last["train/loss"] < first["train/loss"] - 3.0, [r["train/loss"] for r in records]
    assert last["tokens_seen"] == 40 * 8 * 64
    assert last["flops"] > 0 and last["perf/tokens_per_s"] > 0 and "memory/rss_gib" in last
    assert "done: 40 steps" in proc.stdout


def test_two_processes_match_one_process(tmp_path):
    """Same global batch of 8: 1 rank x 2 accumulation steps vs 2 ranks x 1 (same micro-batch), on a
    mixture of two sources whose tokens are counted over all ranks."""
    one, two = tmp_path / "one", tmp_path / "two"
    (tmp_path / "files").mkdir()
    for f in range(8):  # as many files as streams: each stream reads its own
        (tmp_path / "files" / f"part-{f}.txt").write_text("".join(
            f"Paragraph {f}.{i}: the value of a list is returned by the function.\n\n" for i in range(200)))
    mixture = [f"data.sources=[{{path: builtin:python-docs, weight: 3}}, {{path: {tmp_path / 'files'}, weight: 1}}]"]
    run_train(SMALL + mixture + ["train.max_steps=6", f"train.run_dir={one}"])
    proc = run_train(SMALL + mixture + ["train.max_steps=6", f"train.run_dir={two}"], nproc=2)
    last = [[r for r in read_metrics(run) if "train/loss" in r][-1] for run in (one, two)]
    for record in last:
        drawn = {k: v for k, v in record.items() if k.startswith("data/tokens/")}
        assert sorted(drawn) == ["data/tokens/files", "data/tokens/python-docs"]
        assert sum(drawn.values()) == record["tokens_seen"] == 6 * 8 * 64
        assert record["data/share/python-docs"] == pytest.approx(0.75, abs=0.15)
        assert record["data/read_amplification"] >= 1
    assert {k: v for k, v in last[0].items() if k.startswith("data/tokens/")} == {
        k: v for k, v in last[1].items() if k.startswith("data/tokens/")}  # the same mixture at any world size
    assert "data: tokens drawn since the start of the run: python-docs" in proc.stderr + proc.stdout
    a, b = losses(one), losses(two)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, a[step], b[step])
    assert a[6] < a[1]
    assert "world size 2" in proc.stdout
    # The held-out batches are the same set at any world size: the same validation loss.
    [eval_one] = [r["eval/loss"] for r in read_metrics(one) if "eval/loss" in r]
    [eval_two] = [r["eval/loss"] for r in read_metrics(two) if "eval/loss" in r]
    assert eval_two == pytest.approx(eval_one, rel=1e-5) and eval_one < 8.0


def test_activation_checkpointing_gives_the_same_losses(tmp_path):
    """Recomputing every block (and every 2nd) in backward under ZeRO-3 changes memory, not numbers."""
    runs = {}
    for every in (0, 1, 2):
        runs[every] = tmp_path / f"ac{every}"
        run_train(SMALL + ["train.max_steps=3", f"train.activation_checkpointing={every}",
                           f"train.run_dir={runs[every]}"])
    assert losses(runs[1]) == losses(runs[0]) == losses(runs[2])


@pytest.fixture(scope="module")
def torchrun_group_of_two(tmp_path_factory):
    """The launchers' reference: the same 3 steps under torchrun."""
    run = tmp_path_factory.mktemp("torchrun") / "run"
    run_train(SMALL + ["train.max_steps=3", f"train.run_dir={run}"], nproc=2)
    return run


@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_launcher_forms_one_group_of_two(tmp_path, launcher, torchrun_group_of_two):
    """accelerate launch on CPU must not start two processes that each think they are rank 0; the
    deepspeed launcher's extra --local_rank argument must be accepted."""
    acc, tr = tmp_path / launcher, torchrun_group_of_two
    proc = run_train(SMALL + ["train.max_steps=3", f"train.run_dir={acc}"], nproc=2, launcher=launcher)
    assert "world size 2" in proc.stdout
    ckpt = acc / "checkpoints" / "step_00000003"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["world_size"] == 2
    # One ZeRO shard per rank, ranks 0 and 1: two distinct ranks in one group.
    shards = sorted(p.name for p in ckpt.glob("zero_pp_rank_*_optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    # Distinct data per rank: every stream's position was reported by exactly one rank, and
    # the two ranks together consumed the global batches.
    state = json.loads((ckpt / "data_state.json").read_text())
    assert state["consumed"] == 3 * 8
    # Same group, same data, same numbers as torchrun's group of two.
    assert losses(acc) == losses(tr)


def test_unknown_override_fails_fast_with_one_line():
    proc = run_train(["train.max_step=5"], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("pretrain: error: unknown key 'train.max_step'")
    assert "Traceback" not in proc.stderr


def test_batch_not_divisible_by_world_size(tmp_path):
    proc = run_train(["train.micro_batch_size=2", "train.global_batch_size=3", f"train.run_dir={tmp_path}"],
                     nproc=2, check=False)
    assert proc.returncode != 0
    assert "not divisible by micro_batch_size 2 x world size 2" in proc.stderr
    # torchrun prints its own ChildFailedError traceback; ours must not print one.
    assert not [line for line in proc.stderr.splitlines() if line.strip().startswith("File") and "/pretrain/" in line]


def test_nonfinite_loss_stops_before_corrupting(tmp_path):
    proc = run_train(SMALL + ["optimizer.lr=1e30", "schedule.warmup_steps=0", "train.max_steps=20",
                              f"train.run_dir={tmp_path}"], check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "stopped before the update" in proc.stderr
    assert not list((tmp_path / "checkpoints").glob("step_*"))


def test_nonfinite_loss_skip_leaves_weights_untouched(tmp_path):
    """lr=1e30 makes step 1's update blow the weights up, so every later loss is NaN: with skip,
    the run goes on, and none of those steps changes a weight."""
    from pretrain.checkpoint.weights import consolidated_state_dict

    run_train(SMALL + ["optimizer.lr=1e30", "schedule.warmup_steps=0", "train.max_steps=4",
                       "train.on_nonfinite=skip", "checkpoint.every=1", "checkpoint.keep_last=10",
                       f"train.run_dir={tmp_path}"])
    records = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    assert [r["train/skipped_steps"] for r in records] == [0, 1, 2, 3]
    after_1 = consolidated_state_dict(tmp_path / "checkpoints" / "step_00000001")
    after_4 = consolidated_state_dict(tmp_path / "checkpoints" / "step_00000004")
    assert all(torch.equal(after_1[k], after_4[k]) for k in after_1)
    assert all(torch.isfinite(v).all() for v in after_4.values())


def test_wandb_offline_run_logs_scaling_law_fields(tmp_path):
    run_train(SMALL + ["logging.wandb=offline", "train.max_steps=4", f"train.run_dir={tmp_path}", "scaling.sweep=s1"])
    records = read_wandb_records(tmp_path)
    config = next(r.run.config for r in records if r.WhichOneof("record_type") == "run")
    values = {item.key: json.loads(item.value_json) for item in config.update}
    scaling = values["scaling"].get("value", values["scaling"])
    assert values["train"].get("value", values["train"])["max_steps"] == 4  # the resolved config
    assert scaling["n_params"] > scaling["n_params_non_embedding"] > 0
    assert scaling["flops_per_token"] > 6 * scaling["n_params_matmul"] >= 6 * scaling["n_params_non_embedding"]
    assert scaling["sweep"] == "s1"  # the config's own scaling section is kept
    # the parallel layout (a single process here)
    assert (scaling["data_parallel"], scaling["tensor_parallel"], scaling["sequence_parallel"]) == (1, 1, 1)
    provenance = values["provenance"].get("value", values["provenance"])  # which code trained it
    assert provenance["pretrain_version"] and "git_commit" in provenance
    metrics = {(r.metric.name or r.metric.glob_name): r.metric.step_metric
               for r in records if r.WhichOneof("record_type") == "metric"}
    assert metrics["train/*"] == "tokens_seen" and metrics["compute/*"] == "flops"
    rows = [row for row in wandb_history(tmp_path) if "train/loss" in row]
    local = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    assert [row["train/loss"] for row in rows] == pytest.approx([r["train/loss"] for r in local])
    assert [row["tokens_seen"] for row in rows] == [s * 8 * 64 for s in (1, 2, 3, 4)]
    assert rows[-1]["flops"] == rows[-1]["tokens_seen"] * scaling["flops_per_token"]


def test_zero_stage_0_trains_like_zero_3_with_clipping(tmp_path):
    """At stage 0 (fp32) the trainer clips with the norm it computes, at stage 3 DeepSpeed does:
    the same losses (to summation order). Once: stage 0 never clipped (the clip was handed the
    gradients instead of the parameters), and the tiny config ended at 5.0 instead of 4.1."""
    runs = {}
    for stage in (0, 3):
        runs[stage] = tmp_path / f"stage{stage}"
        run_train(SMALL + [f"distributed.zero_stage={stage}", "train.max_steps=6", "optimizer.lr=3e-3",
                           "optimizer.grad_clip=0.5", f"train.run_dir={runs[stage]}"])
    norms = [r["train/grad_norm"] for r in read_metrics(runs[0]) if "train/grad_norm" in r]
    assert max(norms) > 0.5  # clipping was active
    for step, loss in losses(runs[3]).items():
        assert losses(runs[0])[step] == pytest.approx(loss, rel=1e-5), step


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (3, "fp32")])
def test_compile_trains_to_the_same_losses(tmp_path, stage, precision):
    """train.compile=true really compiles (DeepSpeed's engine.compile(): torch.compile of the model,
    ZeRO-3's hooks outside the graphs) and trains to the eager losses within 1e-3. (bf16 at ZeRO-3:
    tests/test_user_path.py, on the user's path.)"""
    runs = {}
    for compiled in (False, True):
        runs[compiled] = tmp_path / f"compile{compiled}"
        proc = run_train(SMALL + [f"distributed.zero_stage={stage}", "train.max_steps=4", "train.activation_checkpointing=1",
                                  f"train.precision={precision}",
                                  f"train.compile={str(compiled).lower()}", f"train.run_dir={runs[compiled]}"])
    eager, compiled = losses(runs[False]), losses(runs[True])
    assert sorted(compiled) == [1, 2, 3, 4]
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-3, abs=1e-3)
    # Graphs were compiled (dynamo's own counters): eager equals eager, so without this a
    # train.compile that compiled nothing would pass.
    graphs = re.search(r"train.compile: the first step \(compiling\) took .* s: (\d+) graphs compiled", proc.stdout)
    assert graphs and int(graphs.group(1)) >= 1, proc.stdout[-2000:]


def test_switches_change_what_is_saved_for_backward(tmp_path):
    """Through the whole trainer (config -> build -> engine -> step): activation checkpointing saves
    far less for backward, and loss chunks leave no (N, V) tensor of logits saved, where one chunk
    (the default at this vocabulary) saves it. Each fails if its field is not passed through."""
    tokens, vocab = 4 * 64, 4096  # a micro-batch's tokens (SMALL), the built-in tokenizer's vocabulary
    base = SMALL + ["train.max_steps=1", "distributed.zero_stage=0", "train.eval_every=0"]
    plain = saved_for_backward(base + [f"train.run_dir={tmp_path / 'plain'}"])
    ac = saved_for_backward(base + ["train.activation_checkpointing=1", f"train.run_dir={tmp_path / 'ac'}"])
    chunked = saved_for_backward(base + ["train.loss_chunk_tokens=32", f"train.run_dir={tmp_path / 'chunk'}"])
    assert plain["biggest"] >= tokens * vocab  # the fp32 logits, saved by the cross-entropy
    assert chunked["biggest"] < tokens * vocab
    # (the blocks' activations are most of what is saved; the logits and weights stay)
    assert ac["bytes"] < 0.75 * plain["bytes"] and ac["count"] < plain["count"] / 2


def test_chunked_loss_trains_like_the_full_one(tmp_path):
    """Under ZeRO-3 (the head's weight gathered for the chunks, also when they are recomputed in
    backward): loss chunks of 48 tokens give the losses of one chunk."""
    runs = {}
    for chunk in (0, 48):
        runs[chunk] = tmp_path / f"chunk{chunk}"
        run_train(SMALL + ["train.max_steps=4", f"train.loss_chunk_tokens={chunk}", f"train.run_dir={runs[chunk]}"])
    for step, loss in losses(runs[0]).items():
        assert losses(runs[48])[step] == pytest.approx(loss, rel=1e-5)


def test_optimizer_offload_trains_like_the_device_optimizer(tmp_path):
    """distributed.offload_optimizer=true (ZeRO-3, bf16): the master weights and moments in host
    memory, stepped there by the same AdamW, train as on the device. (DeepSpeed refused our
    optimizer with offload unless told that is intended.)"""
    runs = {}
    for offload in (False, True):
        runs[offload] = tmp_path / f"offload{offload}"
        run_train(SMALL + ["train.max_steps=3", "train.precision=bf16", f"distributed.offload_optimizer={str(offload).lower()}",
                           f"train.run_dir={runs[offload]}"])
    offloaded, on_device = losses(runs[True]), losses(runs[False])
    assert sorted(offloaded) == [1, 2, 3]
    for step, loss in on_device.items():  # (measured: within 4e-7; the host path rounds differently)
        assert offloaded[step] == pytest.approx(loss, rel=1e-5, abs=0), step
