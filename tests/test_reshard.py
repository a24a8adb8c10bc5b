"""A checkpoint at another layout (pretrain/checkpoint/reshard.py): its shards read back as whole tensors equal to
DeepSpeed's own consolidation, and a resume at another world size with the optimizers and stages
DeepSpeed's converter cannot convert (Muon at ZeRO-1, DeepSpeed's bf16 optimizer, AdamW at ZeRO-2),
against the uninterrupted run. Tensor-parallel layouts: tests/test_tensor_parallel.py; Muon at
ZeRO-3: tests/test_muon.py."""

import sys

import pytest
import torch
from helpers import REPO, TINY, losses, read_metrics, run_train

pytestmark = pytest.mark.slow

BASE = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.log_every=1",
        "logging.wandb=disabled", "schedule.warmup_steps=2", "train.max_steps=4", "train.eval_every=0",
        "checkpoint.every=2", "checkpoint.keep_last=5", "model.n_layers=3"]  # (3 layers: parameters straddle ZeRO-1/2 partitions)

# `pretrain train` converting every partitioned checkpoint it resumes, also at the layout it was saved at.
CONVERT_ALWAYS = ("import sys; import pretrain.checkpoint.manager as c; from pretrain.checkpoint.reshard import partitioned; "
                  "c.Start.universal = lambda self, env: self.meta is not None and partitioned(self.path); "
                  "from pretrain.cli import main; sys.exit(main())")


def _norms(run) -> dict[int, float]:
    return {r["step"]: r["train/grad_norm"] for r in read_metrics(run) if "train/grad_norm" in r}


@pytest.mark.parametrize("optimizer, stage, precision, first, then", [
    ("muon", 1, "fp32", 2, 1),  # ZeRO-1/2 keep Muon's momentum of whole parameters
    ("muon", 0, "bf16", 2, 1),  # (bf16 at stage 0 runs as DeepSpeed's bf16 optimizer)
    ("adamw", 2, "fp32", 1, 2),  # DeepSpeed's converter asserts on ZeRO-1/2 checkpoints
])
def test_a_run_resumes_at_another_world_size(tmp_path, optimizer, stage, precision, first, then):
    """Saved at step 2 on `first` ranks, resumed on `then`: steps 3-4 give the uninterrupted run's losses
    and gradient norms (fp32 within 1e-6; bf16 within its rounding); through the conversion at the
    same layout, bitwise. The step-4 checkpoint's weights are DeepSpeed's own consolidation of it
    (ZeRO), or the master weights of its bf16 model (DeepSpeed's bf16 optimizer, which its
    consolidation cannot read)."""
    common = [*BASE, f"optimizer.name={optimizer}", f"distributed.zero_stage={stage}", f"train.precision={precision}"]
    if precision == "bf16":  # (a small head: bf16 matmuls are slow on a CPU)
        common.append("data.tokenizer=builtin:python-bpe-512")
    straight = tmp_path / "straight"
    run_train([*common, f"train.run_dir={straight}"], nproc=first)
    step2 = straight / "checkpoints" / "step_00000002"
    moved = tmp_path / "moved"
    run_train([*common, f"train.run_dir={moved}", f"checkpoint.resume={step2}"], nproc=then)
    want, got = losses(straight), losses(moved)
    rel = 1e-6 if precision == "fp32" else 1e-4
    assert got.keys() == {3, 4}, got
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=rel), (step, want, got)
        assert _norms(moved)[step] == pytest.approx(_norms(straight)[step], rel=10 * rel), (step, _norms(moved))
    assert not (moved / "checkpoints" / ".universal" / "step_00000002").exists()  # (removed at the next save)

    if optimizer == "muon":  # converted at the same layout: bitwise
        same = tmp_path / "same"
        _convert_always([*common, f"train.run_dir={same}", f"checkpoint.resume={step2}"], first)
        assert losses(same) == {s: want[s] for s in (3, 4)}
        assert _norms(same) == {s: _norms(straight)[s] for s in (3, 4)}

    from pretrain.checkpoint.weights import consolidated_state_dict

    step4 = straight / "checkpoints" / "step_00000004"
    ours = consolidated_state_dict(step4)
    if precision == "fp32":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        theirs = get_fp32_state_dict_from_zero_checkpoint(str(step4.parent), tag=step4.name)
    else:
        theirs = torch.load(step4 / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
        ours = {k: v.to(torch.bfloat16) for k, v in ours.items()}
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def _convert_always(overrides: list[str], nproc: int) -> None:
    """`pretrain train` on `nproc` ranks converting the checkpoint it resumes even at its own layout."""
    import subprocess

    from helpers import free_port, train_env

    script = ["-c", CONVERT_ALWAYS, "train", str(TINY), "logging.progress=false", *overrides]
    cmd = [sys.executable, *script] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
        str(free_port()), "--no-python", sys.executable, *script]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env({"PYTHONPATH": str(REPO)}), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "converted" in proc.stdout and "to DeepSpeed's universal format" in proc.stdout, proc.stdout[-2000:]
