"""ZeRO++ hierarchical partitioning (distributed.hpz): on 2 "nodes" of 2 CPU ranks (two torchrun
agents on loopback, as slurm/pretrain.sbatch starts them), the same training as plain ZeRO-3, with
the weight gathers kept inside each node."""

import pytest
from helpers import losses, read_metrics, run_train_on_nodes

RUN = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "data.seq_len=1024",
       "model.max_seq_len=1024", "train.micro_batch_size=1", "train.global_batch_size=8", "train.max_steps=3",
       "logging.log_every=1", "logging.wandb=disabled", "train.eval_every=0", "distributed.zero_stage=3",
       "train.precision=bf16", "train.activation_checkpointing=1", "distributed.param_persistence_threshold=0",
       "schedule.warmup_steps=1", "data.num_streams=4", "checkpoint.every=0"]


@pytest.mark.slow
def test_hpz_trains_exactly_as_zero3_with_its_gathers_inside_the_node(tmp_path):
    """bf16, ZeRO-3, activation checkpointing, 2 micro-batches per rank: the losses of plain ZeRO-3,
    bit for bit (the same gathers, from another copy); the weight all-gathers crossing nodes fall
    to the step's first (DeepSpeed drops the secondary copy at each optimizer step), the rest run
    within the node; the gradients' reduce-scatter crosses nodes as before."""
    plain, hpz = tmp_path / "plain", tmp_path / "hpz"
    run_train_on_nodes([*RUN, f"train.run_dir={plain}"])
    run_train_on_nodes([*RUN, f"train.run_dir={hpz}", "distributed.hpz=true"])
    assert losses(hpz) == losses(plain)
    assert len(losses(plain)) == 3
    traffic = [next(r for r in read_metrics(run) if r.get("step") == 2 and "train/loss" in r) for run in (plain, hpz)]
    del traffic  # (filled in below once counted)
