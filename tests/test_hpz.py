"""ZeRO++ hierarchical partitioning (distributed.hpz): on 2 "nodes" of 2 CPU ranks (two torchrun
agents on loopback, as slurm/pretrain.sbatch starts them), the same training as plain ZeRO-3, with
the weight gathers kept inside each node."""

import pytest
from helpers import REPO, losses, read_metrics, run_train_on_nodes

from pretrain.config import load_config
from pretrain.estimate.comm import zero3_gathered, zero_traffic
from pretrain.model.model import num_params

RUN = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "data.seq_len=1024",
       "model.max_seq_len=1024", "train.micro_batch_size=1", "train.global_batch_size=8", "train.max_steps=2",
       "logging.log_every=1", "logging.wandb=disabled", "train.eval_every=0", "distributed.zero_stage=3",
       "train.precision=bf16", "train.activation_checkpointing=1", "distributed.param_persistence_threshold=0",
       "schedule.warmup_steps=1", "data.num_streams=4", "checkpoint.every=0", "logging.comm_bytes=true",
       "data.tokenizer=builtin:python-bpe-512"]  # (a small head: bf16 matmuls are slow on a CPU)


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
    assert len(losses(plain)) == 2
    plain_c, hpz_c = (next(r for r in read_metrics(run) if r.get("step") == 2 and "comm/bytes_per_step" in r)
                      for run in (plain, hpz))
    for r in (plain_c, hpz_c):  # the gradients: reduce-scattered across the nodes alike
        assert r["comm/reduce_scatter_inter_bytes"] == plain_c["comm/reduce_scatter_inter_bytes"] > 0
        assert r["comm/reduce_scatter_intra_bytes"] == 0
    # Plain: every gather crosses nodes. hpZ: the first micro-batch's, of 2, crosses; the second's
    # stays in the node (over 2 ranks, not 4: (2-1)/2 of the weights, not (4-1)/4).
    assert plain_c["comm/all_gather_intra_bytes"] == 0
    assert hpz_c["comm/all_gather_inter_bytes"] == pytest.approx(plain_c["comm/all_gather_inter_bytes"] / 2)
    assert hpz_c["comm/all_gather_intra_bytes"] == pytest.approx(plain_c["comm/all_gather_inter_bytes"] / 2 * (1 / 2) / (3 / 4))
    # What pretrain estimate says of both (its counted ZeRO-3 rules, zero_traffic's split).
    cfg = load_config(REPO / "configs" / "tiny.yaml", [*RUN, "model.vocab_size=512"])  # (the tokenizer's)
    z = zero3_gathered(cfg.model, 0)
    for on, r in ((False, plain_c), (True, hpz_c)):
        intra, inter = zero_traffic(num_params(cfg.model), 3, 4, 2, 2, 4, 2, on, **z)
        assert r["comm/all_gather_intra_bytes"] == pytest.approx(intra, abs=0.5)  # to the byte
        assert r["comm/all_gather_inter_bytes"] + r["comm/reduce_scatter_inter_bytes"] == pytest.approx(inter, abs=0.5)
