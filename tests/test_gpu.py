"""What only a GPU shows: bf16 training through DeepSpeed, SDPA's flash kernel, MFU. Skipped without CUDA."""

import pytest
import torch

from helpers import read_metrics, run_train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_flash_attention_kernel_serves_our_attention_in_bf16():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pretrain.model import ModelArgs, Transformer

    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=256)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    model = model.cuda().to(torch.bfloat16)
    tokens = torch.randint(0, 512, (2, 256), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if flash cannot take these inputs
        flash = model(tokens)
    with sdpa_kernel(SDPBackend.MATH):
        math = model(tokens)
    assert flash.dtype == torch.bfloat16
    torch.testing.assert_close(flash.float(), math.float(), atol=5e-2, rtol=5e-2)


def test_bf16_zero3_training_learns_and_reports_mfu(tmp_path):
    run_train(["data.seq_len=256", "train.micro_batch_size=16", "train.max_steps=30", "logging.log_every=10",
               "distributed.zero_stage=3",
               "logging.wandb=disabled", f"train.run_dir={tmp_path}"])
    records = [r for r in read_metrics(tmp_path) if "train/loss" in r]
    assert records[-1]["train/loss"] < records[0]["train/loss"] - 1.0
    assert "memory/gpu_peak_allocated_gib" in records[-1]
    name = torch.cuda.get_device_name()
    if any(gpu in name for gpu in ("H100", "H200", "A100")):
        assert 0 < records[-1]["perf/mfu"] < 1
