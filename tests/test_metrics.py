"""The peak FLOP/s that MFU divides by: looked up by the exact GPU name, no GPU needed. And the
metrics of a real run against what they measure (slow): MFU, the time shares, checkpoint size,
perplexity, per-source labels, read amplification across a resume."""

import json
import logging

import pytest
import torch

from pretrain.metrics import peak_flops, peak_flops_for


@pytest.mark.parametrize("name, bf16", [
    ("NVIDIA H100 80GB HBM3", 989.4e12),  # SXM
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989.4e12),
    ("NVIDIA GH200 480GB", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-SXM4-40GB", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12),
])
def test_each_variant_gets_its_own_dense_peak_and_fp16_equals_bf16(name, bf16):
    assert peak_flops_for(name, "bf16") == bf16
    assert peak_flops_for(name, "fp16") == bf16


def test_fp32_is_the_plain_fp32_rate_not_tf32():
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "fp32") == 67e12
    assert peak_flops_for("NVIDIA H100 PCIe", "fp32") == 51e12
    assert peak_flops_for("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12


@pytest.mark.parametrize("name, precision", [
    ("NVIDIA H100", "bf16"),  # a part of the name is not enough
    ("NVIDIA H20", "bf16"),  # not an H200
    ("NVIDIA GeForce RTX 4090", "bf16"),
    ("Tesla V100-SXM2-32GB", "bf16"),  # fp16 only
    ("NVIDIA B200", "fp32"),
    ("NVIDIA H100 80GB HBM3", "int8"),
])
def test_unknown_names_and_precisions_give_zero(name, precision):
    assert peak_flops_for(name, precision) == 0.0


def test_peak_flops_prefers_the_configured_value_and_is_zero_on_cpu():
    assert peak_flops(torch.device("cpu"), "bf16", 0.0) == 0.0
    assert peak_flops(torch.device("cpu"), "bf16", 123e12) == 123e12


def test_peak_flops_looks_up_the_device_name(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    with caplog.at_level(logging.WARNING, logger="pretrain.metrics"):
        assert peak_flops(torch.device("cuda", 0), "bf16", 0.0) == 756e12
    assert caplog.records == []


def test_an_unknown_gpu_warns_once_how_to_get_mfu(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Future GPU")
    with caplog.at_level(logging.WARNING, logger="pretrain.metrics"):
        assert peak_flops(torch.device("cuda", 0), "bf16", 0.0) == 0.0
    [record] = caplog.records
    assert "NVIDIA Future GPU" in record.message and "distributed.peak_flops" in record.message
    assert "\n" not in record.message


def test_peak_rss_is_the_process_own_not_its_parents():
    """getrusage's ru_maxrss carries over exec: a trainer started by a 1.5 GiB parent (a sweep runner,
    a test session) reported 1.5 GiB as its own peak, and the memory estimate's check measured 0."""
    import subprocess
    import sys

    ballast = bytearray(3 * 2**29)
    ballast[::4096] = b"\1" * len(ballast[::4096])  # resident, not just reserved
    child = subprocess.run([sys.executable, "-c", "import torch; from pretrain.metrics import memory_stats; "
                            "print(memory_stats(torch.device('cpu'))['memory/rss_peak_gib'])"],
                           capture_output=True, text=True, check=True)
    assert float(child.stdout.strip()) < 1.0, child.stdout
    del ballast


# ------------------------------------------------------------------ the metrics of a real run
# A 4-step run on two labelled sources (the built-in docs and a file of short documents) with a
# configured peak (so MFU is reported on CPU), an eval at step 2 and at the end, checkpoints at 2
# and 4; then the same run resumed from step 2. Few streams and short shuffle blocks, so that the
# streams' saved cursors already hold document counts at step 2.
RUN = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.wandb=disabled",
       "logging.log_every=1", "train.max_steps=4", "train.eval_every=2", "train.eval_batches=1",
       "distributed.peak_flops=1e12", "checkpoint.every=2", "checkpoint.keep_last=5", "data.num_streams=2",
       "data.shuffle_blocks=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import random
    import shutil

    from helpers import run_train

    short = tmp_path_factory.mktemp("data") / "short.jsonl"
    rng = random.Random(0)
    words = "the value of a list is returned by the function when its name is called".split()
    short.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))}) + "\n"
                             for _ in range(3000)))
    sources = f"data.sources=[{{path: builtin:python-docs, label: docs}}, {{path: {short}, label: short}}]"
    straight, resumed = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("resumed")
    run_train(RUN + [sources, f"train.run_dir={straight}"])
    shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    run_train(RUN + [sources, f"train.run_dir={resumed}", "checkpoint.resume=auto"])
    return straight, resumed


def _records(run_dir, key):
    from helpers import read_metrics

    return [r for r in read_metrics(run_dir) if key in r]


@pytest.mark.slow
def test_mfu_is_tokens_per_device_times_flops_per_token_over_the_peak(runs):
    """perf/mfu with distributed.peak_flops on CPU, against FLOPs per token counted on the model
    itself (every parameter but the embedding lookup, 6 N + 12 L H Q T) and the record's own
    throughput; the throughput against the step time and the global batch."""
    import yaml

    from pretrain.config import config_from_dict
    from pretrain.model.model import Transformer

    straight, _ = runs
    m = config_from_dict(yaml.safe_load((straight / "checkpoints" / "step_00000004" / "config.yaml").read_text())).model
    with torch.device("meta"):
        total = sum(p.numel() for p in Transformer(m).parameters())
    n = total - (0 if m.tie_embeddings else m.vocab_size * m.dim)
    fpt = 6 * n + 12 * m.n_layers * m.n_heads * (m.dim // m.n_heads) * 64
    records = _records(straight, "train/loss")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["perf/mfu"] == pytest.approx(r["perf/tokens_per_s_per_device"] * fpt / 1e12, rel=1e-12)
        assert r["perf/tokens_per_s_per_device"] == r["perf/tokens_per_s"]  # one device
        assert r["perf/tokens_per_s"] * r["perf/step_time_s"] == pytest.approx(8 * 64, rel=1e-9)
        assert r["flops"] == r["tokens_seen"] * fpt and r["tokens_seen"] == r["step"] * 8 * 64


@pytest.mark.slow
def test_data_wait_and_outside_compute_shares_are_consistent(runs):
    """Both are shares of the logging window: in [0, 1], and the wait for data is part of the time
    outside the model's compute."""
    for run in runs:
        for r in _records(run, "train/loss"):
            wait, outside = r["perf/data_wait_share"], r["perf/outside_compute_share"]
            assert 0 < wait <= outside < 1, r


@pytest.mark.slow
def test_checkpoint_size_is_the_size_on_disk(runs):
    straight, _ = runs
    saves = _records(straight, "checkpoint/size_mb")
    assert sorted(r["checkpoint/step"] for r in saves) == [2, 4]
    for r in saves:
        folder = straight / "checkpoints" / f"step_{r['checkpoint/step']:08d}"
        files = {p.name: p.stat().st_size for p in folder.iterdir()}
        assert r["checkpoint/size_mb"] == sum(v for k, v in files.items() if k != "manifest.json") / 1e6
        assert r["checkpoint/size_mb"] == pytest.approx(sum(files.values()) / 1e6, abs=0.01)  # du, within rounding


@pytest.mark.slow
def test_eval_perplexity_is_exp_of_the_eval_loss(runs):
    import math

    evals = _records(runs[0], "eval/loss")
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["eval/perplexity"] == pytest.approx(math.exp(r["eval/loss"]), rel=1e-12)


@pytest.mark.slow
def test_source_labels_name_the_per_source_metrics(runs):
    for r in _records(runs[0], "train/loss"):
        drawn = {k: v for k, v in r.items() if k.startswith(("data/tokens/", "data/share/"))}
        assert set(drawn) == {"data/tokens/docs", "data/tokens/short", "data/share/docs", "data/share/short"}
        assert drawn["data/tokens/docs"] + drawn["data/tokens/short"] == r["tokens_seen"]
        assert drawn["data/share/docs"] == drawn["data/tokens/docs"] / r["tokens_seen"]


def _read_counts(ckpt) -> tuple[int, int]:
    """(documents used, rows parsed) of the text streams, summed over the saved data position."""
    state = json.loads((ckpt / "data_state.json").read_text())
    reads = [s["read"] for s in state["streams"].values() if "read" in s]
    return sum(r[0] + r[1] for r in reads), sum(r[2] for r in reads)


@pytest.mark.slow
def test_read_amplification_carries_over_a_resume(runs):
    """data/read_amplification counts since the start of the run: its counts are part of the saved
    position. The resumed run reports the documents used before the resume too (the same count as
    the uninterrupted run: they depend on the position only), plus the rows it parsed again to get
    back to its cursors; the metric is parsed / used of the position saved with it."""
    straight, resumed = runs
    at_2 = _read_counts(straight / "checkpoints" / "step_00000002")
    used, parsed = _read_counts(resumed / "checkpoints" / "step_00000004")
    assert at_2[0] > 0 and at_2[1] > 0
    cursors = json.loads((straight / "checkpoints" / "step_00000002" / "data_state.json").read_text())["streams"]
    assert all(cursors[f"1/{s}"]["docs"] > 0 for s in (0, 1))  # (at the start of each stream's block)
    assert used == _read_counts(straight / "checkpoints" / "step_00000004")[0] >= at_2[0]
    assert parsed >= at_2[1]
    [last] = [r for r in _records(resumed, "train/loss") if r["step"] == 4]
    assert last["data/read_amplification"] == parsed / used
    assert [r["step"] for r in _records(resumed, "train/loss")] == [3, 4]
    # the per-source counts come from the position too: the same as the uninterrupted run's
    [want] = [r for r in _records(straight, "train/loss") if r["step"] == 4]
    assert {k: v for k, v in last.items() if k.startswith("data/tokens/")} == {
        k: v for k, v in want.items() if k.startswith("data/tokens/")}
