"""The engine the trainer builds on the user's path (bf16, ZeRO-3, activation checkpointing, long
sequences), in a real DeepSpeed process on CPU: what it computes must be the model that eval,
generate and the HF export rebuild from its weights."""

import json
import subprocess
import sys

import pytest

from helpers import REPO, free_port, pretrain, train_env

pytestmark = pytest.mark.slow

SCRIPT = r"""
import json, sys
import deepspeed, torch
from pretrain.parallel import distributed
env = distributed.init("gloo")
from pretrain.config import load_config
from pretrain.model.model import Transformer
from pretrain.model.rope import precompute_freqs_cis
from pretrain.parallel.parallelize import build_engine, build_model, deepspeed_config

precision, stage = sys.argv[1], int(sys.argv[2])
cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256",
    "model.max_seq_len=2048", "data.seq_len=2048", "train.micro_batch_size=1", "train.activation_checkpointing=1",
    f"train.precision={precision}", f"distributed.zero_stage={stage}", "distributed.param_persistence_threshold=0"])
ds = deepspeed_config(cfg, 1, precision)
engine = build_engine(build_model(cfg.model, cfg, ds, seed=0), cfg, ds, env.device)
table = engine.module.freqs_cis
out = {"table_dtype": str(table.dtype),
       "table_error": (table.float() - precompute_freqs_cis(16, 2048)).abs().max().item(),
       "engine_optimizer": type(engine.optimizer).__name__,
       "communication_dtype": str(engine.communication_data_type),
       "grad_accum_dtype": str(engine.get_data_types()[1])}
tokens = torch.randint(0, 256, (1, 2048), generator=torch.Generator().manual_seed(0))
engine.eval()
with torch.no_grad():
    got = engine(tokens).float()
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
plain = Transformer(engine.module.args)  # what eval/generate/export build: a fresh fp32 table
plain.load_state_dict(state)
plain.to(next(iter(state.values())).dtype)
with torch.no_grad():
    want = plain(tokens).float()
out["logits_max_diff"] = (got - want).abs().max().item()
out["logits_max_diff_past_256"] = (got - want)[:, 256:].abs().max().item()
print("RESULT " + json.dumps(out))
"""


def _run(precision: str, stage: int) -> dict:
    env = train_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                     "LOCAL_RANK": "0"})
    script = f"from pathlib import Path\nREPO = Path({str(REPO)!r})\n" + SCRIPT
    proc = subprocess.run([sys.executable, "-c", script, precision, str(stage)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[0][len("RESULT "):])


def test_zero3_bf16_trains_the_model_that_is_exported():
    """deepspeed.zero.Init made the RoPE table bf16 (positions past 256 rounded to multiples of 8
    and 16: an error of 2.0 at 2048) while everything that rebuilds the model from its weights uses
    fp32, so the model trained was not the model evaluated. The engine's logits must equal those of
    a plain model given the engine's weights, at every position."""
    r = _run("bf16", 3)
    assert r["table_dtype"] == "torch.float32" and r["table_error"] == 0.0, r
    assert r["logits_max_diff"] == 0.0, r
    # bf16 gradients would be accumulated and reduced in bf16 (DeepSpeed's default for bf16).
    assert r["grad_accum_dtype"] == r["communication_dtype"] == "torch.float32", r


def test_bf16_on_one_device_runs_the_bf16_optimizer():
    """bf16 at stage 0 runs as stage 1 (DeepSpeed's bf16 optimizer: fp32 gradients) rather than
    DeepSpeed's stage-0 bf16 path, which accumulates in bf16 and checks every parameter on the host."""
    r = _run("bf16", 0)
    assert r["engine_optimizer"] == "BF16_Optimizer", r
    assert r["grad_accum_dtype"] == "torch.float32" and r["table_error"] == 0.0, r
    assert r["logits_max_diff"] == 0.0, r


FP16 = r"""
import sys
# DeepSpeed refuses fp16 on CPU, where torch computes it all the same: let it, so that the loss
# scaler's real code runs here; and start the scale at 2^24 so that the first steps overflow.
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
CPU_Accelerator.is_fp16_supported = lambda self: True
import pretrain.parallel.parallelize as parallelize
make = parallelize.deepspeed_config
def high_scale(*args, **kwargs):
    ds = make(*args, **kwargs)
    ds["fp16"]["initial_scale_power"] = 24
    return ds
parallelize.deepspeed_config = high_scale
parallelize.resolve_precision = lambda cfg, device: cfg.train.precision
from pretrain.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_fp16_loss_scale_skips_are_counted_not_failures(tmp_path):
    """Dynamic loss scaling drops updates while the scale comes down: with train.on_nonfinite=stop
    those used to end an fp16 run at its first step (exit 3)."""
    from helpers import read_metrics

    run = tmp_path / "run"
    args = ["train", str(REPO / "configs" / "tiny.yaml"), "logging.progress=false", "logging.wandb=disabled",
            "train.precision=fp16", "train.max_steps=8", "logging.log_every=1", "data.seq_len=64",
            "train.micro_batch_size=2", "distributed.zero_stage=3", f"train.run_dir={run}"]
    proc = subprocess.run([sys.executable, "-c", FP16, *args], cwd=REPO, env=train_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = [r for r in read_metrics(run) if "train/loss" in r][-1]
    assert last["train/skipped_steps"] == 0
    assert 1 <= last["train/loss_scale_skips"] < 8 and 0 < last["train/loss_scale"] < 2**24, last
    # Without the stand-in, fp16 on CPU is one line and exit 2, not DeepSpeed's traceback.
    plain = pretrain([*args[:-1], f"train.run_dir={tmp_path / 'cpu'}"], check=False)
    assert plain.returncode == 2, plain.stderr[-2000:]
    assert "train.precision=fp16 needs CUDA GPUs" in plain.stderr and "Traceback" not in plain.stderr
