"""The peak FLOP/s that MFU divides by: looked up by the exact GPU name, no GPU needed."""

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
