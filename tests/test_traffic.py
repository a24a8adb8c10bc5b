"""The collective count (pretrain/parallel/traffic.py): known collectives of known sizes on real ranks, intra-
and inter-node; one ZeRO-3 step of real training against the volume worked out by hand and against
the estimate; the comm/* metrics in metrics.jsonl."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import REPO, TINY, free_port, read_metrics, run_train, train_env
from pretrain.config import load_config
from pretrain.estimate.comm import comm_volume, zero3_gathered
from pretrain.model.args import PRESETS, ModelArgs
from pretrain.model.model import num_params

# Each rank runs known collectives under Traffic and writes what it counted. Groups: the world, and
# pairs of consecutive ranks (one node's when LOCAL_WORLD_SIZE=2), and each rank alone.
KNOWN = r"""
import json, os, sys
import torch
import torch.distributed as dist
from pretrain.parallel import distributed
from pretrain.parallel.traffic import Traffic

dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
pairs = [dist.new_group([r, r + 1]) for r in range(0, n, 2)]
alone = [dist.new_group([r]) for r in range(n)]
distributed._DEVICE_TYPE = "cpu"
with Traffic() as t:
    x = torch.ones(1000)                                    # 4000 bytes
    distributed.all_reduce(x)                               # ours: 2 (n-1)/n x 4000
    y = x * 2 + 1                                           # not a collective
    out = torch.empty(n * 250, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.ones(250, dtype=torch.bfloat16))  # (n-1)/n x 500 n
    dist.reduce_scatter_tensor(torch.empty(100), torch.ones(100 * n))       # (n-1)/n x 400 n
    dist.all_to_all_single(torch.empty(8 * n), torch.ones(8 * n))           # (n-1)/n x 32 n
    dist.broadcast(torch.ones(10), src=0)                                   # 40
    dist.all_reduce(torch.ones(64), group=pairs[rank // 2])                 # 2 x 1/2 x 256
    dist.all_reduce(torch.ones(64), group=alone[rank])                      # alone: nothing
dist.all_reduce(torch.ones(1000))                           # after: not counted
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump({"bytes": {f"{k} {w}": v for (k, w), v in t.bytes.items()}, "metrics": t.metrics()}, f)
dist.destroy_process_group()
"""


def known(n: int, per_node: int) -> list[dict]:
    """Run KNOWN on n processes, as a launcher with `per_node` ranks per node starts them
    (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); each rank's count."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "known.py"
        script.write_text(KNOWN)
        port = str(free_port())
        procs = [subprocess.Popen(
            [sys.executable, str(script), tmp], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=train_env({"PYTHONPATH": str(REPO), "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r % per_node),
                           "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}))
            for r in range(n)]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert all(p.returncode == 0 for p in procs), errors
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(n)]


def expected(n: int) -> dict:
    ring = (n - 1) / n
    return {"all_reduce": 2 * ring * 4000, "all_gather": ring * 500 * n, "reduce_scatter": ring * 400 * n,
            "all_to_all": ring * 32 * n, "broadcast": 40.0}


@pytest.mark.parametrize("per_node", [2, 1], ids=["one-node", "two-nodes"])
def test_known_collectives_counted_once_on_2_ranks(per_node):
    """Every kind at its exact bytes (none missed, none twice, the compute between not counted, the
    collective after the block not counted); a group of one moves nothing; on one node all of it is
    intra-node, with one rank per node all of it inter-node."""
    where, other = ("intra", "inter") if per_node == 2 else ("inter", "intra")
    for r in known(2, per_node):
        want = expected(2)
        want["all_reduce"] += 2 * 0.5 * 256  # the pair is the world here
        assert r["bytes"] == {f"{k} {where}": v for k, v in want.items()}, r
        m = r["metrics"]
        assert m["comm/bytes_per_step"] == sum(want.values())
        assert all(m[f"comm/{k}_{other}_bytes"] == 0 for k in want)


@pytest.mark.slow
def test_known_collectives_on_4_ranks_over_2_nodes():
    """4 ranks, 2 per node: the world's collectives cross nodes, a node's pair does not."""
    for r in known(4, 2):
        assert r["bytes"] == {**{f"{k} inter": v for k, v in expected(4).items()}, "all_reduce intra": 256.0}, r


def test_zero3_gathers_by_deepspeeds_reuse_rule():
    """Within stage3_max_reuse_distance every parameter is gathered once per micro-batch; at 0 twice;
    the norms (under the persistence threshold) never, and a 7B model at DeepSpeed's 1e9 re-gathers
    most blocks in backward."""
    args = ModelArgs(**PRESETS["tiny"], vocab_size=4096)
    N, P = num_params(args), 9 * 128
    assert zero3_gathered(args, 1280) == {"gathered": N - P, "persistent": P}
    assert zero3_gathered(args, 1280, 0) == {"gathered": 2 * (N - P), "persistent": P}
    big = ModelArgs(**PRESETS["7b"], vocab_size=32000)
    assert 1.9 < zero3_gathered(big, 40960)["gathered"] / num_params(big) < 1.95
    # Per kind, per GPU per step, k = 2 on 2 ranks, bf16 weights, fp32 gradients.
    assert comm_volume(N, 3, 2, 2, 2, 4, N - P, P) == {"all_gather": 0.5 * 2 * (2 * (N - P) + P),
                                                       "reduce_scatter": 2 * 0.5 * 4 * N}
    assert comm_volume(N, 2, 2, 2, 2, 4) == {"all_reduce": 2 * 2 * 0.5 * 4 * N, "all_gather": 0.5 * 2 * N}
    assert comm_volume(N, 1, 2, 2, 2, 4) == {"all_reduce": 2 * 0.5 * 4 * N, "all_gather": 0.5 * 2 * N}
    assert comm_volume(N, 0, 2, 2, 4) == {"all_reduce": 2 * 0.5 * 4 * N}


ZERO3 = ["model.vocab_size=4096", "data.seq_len=64", "train.micro_batch_size=1", "train.precision=bf16",
         "train.eval_every=0", "data.validation=[]", "logging.wandb=disabled", "logging.log_every=1",
         "train.max_steps=2", "distributed.zero_stage=3", "logging.comm_bytes=true"]


def zero3_step(nproc: int, k: int, ac: int) -> tuple[list[dict], dict, dict]:
    """Train the tiny model (4096 tokens: N = 1,836,160) 2 steps on `nproc` ranks, k micro-batches each;
    its training records, the volume by hand and the estimate's."""
    from pretrain.estimate.memory import GIB
    from pretrain.estimate.report import Assumptions, estimate

    overrides = ZERO3 + [f"train.global_batch_size={nproc * k}", f"train.activation_checkpointing={ac}"]
    with tempfile.TemporaryDirectory() as tmp:
        run_train(overrides + [f"train.run_dir={tmp}/run"], nproc=nproc, cwd=Path(tmp),
                  env={"PYTHONPATH": str(REPO)})
        records = [r for r in read_metrics(Path(tmp) / "run") if "train/loss" in r]
    cfg = load_config(TINY, overrides)
    N, P, psi = num_params(cfg.model), 9 * 128, (nproc - 1) / nproc
    # Forward gathers every partitioned parameter once; the whole model is within DeepSpeed's reuse
    # distance, so backward gathers nothing; the norms are gathered after the step.
    hand = {"all_gather": psi * 2 * (k * (N - P) + P), "reduce_scatter": k * psi * 4 * N}
    e = estimate(cfg, cfg.model, Assumptions(gpus=nproc))
    return records, hand, {"total": e["comm_gib_per_gpu"] * GIB}


@pytest.fixture(scope="module")
def two_micro_batches_with_checkpointing():
    return zero3_step(2, 2, 1)


def _bytes(record: dict, kind: str) -> float:
    return record[f"comm/{kind}_intra_bytes"] + record[f"comm/{kind}_inter_bytes"]


def test_zero3_step_counted_as_by_hand_and_estimated(two_micro_batches_with_checkpointing):
    """ZeRO-3, activation checkpointing, 2 micro-batches, 2 ranks: step 2 within 5% of the hand count
    and of `pretrain estimate`, kind by kind."""
    records, hand, est = two_micro_batches_with_checkpointing
    last = records[-1]
    assert last["step"] == 2
    for kind in ("all_gather", "reduce_scatter"):
        assert _bytes(last, kind) == pytest.approx(hand[kind], rel=0.05), (kind, last)
    assert last["comm/bytes_per_step"] == pytest.approx(est["total"], rel=0.05)
    # Step 1's first micro-batch traces the module order: it gathers everything in backward again.
    assert _bytes(records[0], "all_gather") > 1.4 * hand["all_gather"]
    assert last["comm/all_reduce_intra_bytes"] < 100  # only the loss and DeepSpeed's norm


def test_comm_metrics_at_log_steps(two_micro_batches_with_checkpointing):
    """Every logged training record carries the comm/* keys, all intra-node on one node."""
    records = two_micro_batches_with_checkpointing[0]
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")
    keys = {"comm/bytes_per_step"} | {f"comm/{k}_{w}_bytes" for k in kinds for w in ("intra", "inter")}
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert keys <= set(r), sorted(set(r) - keys)
        assert all(r[f"comm/{k}_inter_bytes"] == 0 for k in kinds)
        assert r["comm/bytes_per_step"] == pytest.approx(sum(r[f"comm/{k}_intra_bytes"] for k in kinds))


@pytest.mark.slow
@pytest.mark.parametrize("nproc,k,ac", [(2, 1, 0), (4, 2, 0)])
def test_zero3_step_without_checkpointing(nproc, k, ac):
    records, hand, est = zero3_step(nproc, k, ac)
    for kind in ("all_gather", "reduce_scatter"):
        assert _bytes(records[-1], kind) == pytest.approx(hand[kind], rel=0.05), (kind, records[-1])
    assert records[-1]["comm/bytes_per_step"] == pytest.approx(est["total"], rel=0.05)


def test_ranks_per_node_under_a_bare_srun(monkeypatch):
    """srun without torchrun: Slurm's tasks per node ("2(x2)": 2 on each of 2 nodes) become
    LOCAL_WORLD_SIZE, which tells nodes apart."""
    from pretrain.parallel import distributed
    from pretrain.parallel.traffic import local_world_size

    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2(x2)",
           "MASTER_ADDR": "node1"}
    monkeypatch.setattr(distributed.os, "environ", env)
    distributed._env_from_slurm()
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "2")
    assert local_world_size() == 2


def _counted_step(overrides: list[str], nproc: int = 2) -> dict:
    """Train the tiny model (vocabulary 4096) 2 steps on `nproc` ranks of one node with the
    collectives counted; step 2's record."""
    with tempfile.TemporaryDirectory() as tmp:
        run_train(ZERO3 + overrides + [f"train.run_dir={tmp}/run"], nproc=nproc, cwd=Path(tmp),
                  env={"PYTHONPATH": str(REPO)})
        records = [r for r in read_metrics(Path(tmp) / "run") if "train/loss" in r]
    assert records[-1]["step"] == 2
    return records[-1]


@pytest.mark.slow
def test_tensor_parallel_all_reduces_counted_as_estimated():
    """TP over both of 2 ranks (one data-parallel rank: no ZeRO traffic), 2 micro-batches, every other
    block checkpointed: the all-reduces counted are the estimate's, to the 24 bytes of the loss's and
    DeepSpeed's norm's. Per block and micro-batch that is 7 of the b T D activations (2 in forward
    after wo and w2, 5 in backward: AutoTP's wq, wk, wv, w1 and w3 each all-reduce their input's
    gradient) and 1 more in a checkpointed block's recomputation (wo's), not 4 + 2."""
    from pretrain.estimate.memory import GIB
    from pretrain.estimate.report import Assumptions, estimate

    overrides = ["distributed.tensor_parallel=2", "train.global_batch_size=2", "train.activation_checkpointing=2"]
    last = _counted_step(overrides)
    assert _bytes(last, "all_gather") == _bytes(last, "reduce_scatter") == 0
    cfg = load_config(TINY, ZERO3 + overrides)
    e = estimate(cfg, cfg.model, Assumptions(gpus=2))
    assert e["grad_accum"] == 2 and e["comm_gib_per_gpu"] == 0
    tp_bytes = e["tp_allreduce_gib_per_gpu"] * GIB
    assert 0 <= last["comm/all_reduce_intra_bytes"] - tp_bytes <= 24, (last, tp_bytes)
    one = 2 * 1 / 2 * 64 * cfg.model.dim * 2  # one all-reduce of 64 tokens x D in bf16 over 2 ranks
    assert tp_bytes == 2 * (7 * 4 + 2) * one  # 4 blocks, 2 of them recomputed


@pytest.mark.slow
def test_muon_step_all_to_all_counted_and_timed_within_the_node():
    """optimizer.name=muon at ZeRO-3 on 2 ranks of one node: the step's all-to-alls, counted, are
    the estimate's bytes (at 2 ranks every rank sends the same), all within the node, and the
    estimate times them at the in-node bandwidth, not the network's; across nodes at the network's.
    The reduce bucket holds every matrix: one batch of them, of which each rank owns some, so each
    sends in both all-to-alls (traffic.py fails to count an all-to-all with an empty input)."""
    from pretrain.estimate.report import Assumptions, estimate

    muon = ["optimizer.name=muon", "train.global_batch_size=2", "distributed.reduce_bucket_size=10000000"]
    last = _counted_step(muon)
    sent = last["comm/all_to_all_intra_bytes"]
    assert sent > 0 and last["comm/all_to_all_inter_bytes"] == 0
    cfg = load_config(TINY, ZERO3 + muon)
    a = Assumptions(gpus=2)
    m = estimate(cfg, cfg.model, a)["muon"]
    assert m["step_comm_gib_per_gpu"] * 2**30 == pytest.approx(sent, rel=1e-12)
    assert m["step_comm_s"] == pytest.approx(sent / (a.sp_gbps * 1e9 / 8))
    across = estimate(cfg, cfg.model, Assumptions(gpus=2, gpus_per_node=1))["muon"]  # one rank per node
    assert across["step_comm_s"] == pytest.approx(sent / (a.gbps * 1e9 / 8))


def test_an_all_to_all_that_sends_no_rows_counts_nothing():
    """A rank with nothing to send (Muon's step, when another rank owns a whole batch of matrices)
    gives an empty input: counted as 0 bytes, not an IndexError that ended the run under
    logging.comm_bytes."""
    import torch

    from pretrain.parallel.traffic import _alltoall_sent

    assert _alltoall_sent((None, torch.empty(0, 4), None, [0, 0], [0, 0]), 2, 0) == 0
    assert _alltoall_sent((None, torch.ones(6, 4), None, [3, 3], [2, 4]), 2, 0) == 4 * 4 * 4  # 4 rows of 4 floats


@pytest.mark.slow
def test_expert_parallel_traffic_counted_as_estimated():
    """A Mixture-of-Experts at expert_parallel=2 on 4 ranks of one node (ZeRO-3, bf16, 2
    micro-batches, every MoE block checkpointed), every token routed to all 4 experts so that the
    routing is balanced, as the estimate assumes: the all-to-alls counted are the estimate's (the
    rows to the other rank's experts and back: in forward, backward and the recomputation), to the
    bytes of the per-expert counts each forward exchanges; ZeRO-3's gathers and reduce-scatters
    (the experts' over their own group of 2) within 5% of it. Without expert parallelism the same
    model moves more ZeRO bytes (every rank gathers every expert) and no rows."""
    from pretrain.estimate.memory import GIB
    from pretrain.estimate.report import Assumptions, estimate

    moe = ["model.moe_experts=4", "model.moe_top_k=4", "model.moe_hidden_dim=64", "model.moe_dense_layers=1",
           "train.global_batch_size=4", "train.activation_checkpointing=1", "data.num_streams=4"]
    counted = {ep: _counted_step(moe + [f"distributed.expert_parallel={ep}"], nproc=4) for ep in (1, 2)}
    cfg = {ep: load_config(TINY, ZERO3 + moe + [f"distributed.expert_parallel={ep}"]) for ep in (1, 2)}
    est = {ep: estimate(cfg[ep], cfg[ep].model, Assumptions(gpus=4)) for ep in (1, 2)}
    e, last = est[2], counted[2]
    assert e["grad_accum"] == 1 and e["expert_parallel"] == 2
    rows = e["expert_all_to_all_gib_per_gpu"] * GIB
    moe_blocks = cfg[2].model.moe_layers
    # one row block: 64 tokens x 4 experts x D in bf16, half of it to the other rank, each way
    assert rows == 3 * moe_blocks * 2 * (1 / 2) * 64 * 4 * cfg[2].model.dim * 2
    counts = 2 * moe_blocks * (1 / 2) * 4 * 8  # the int64 counts: forward and recomputation, per block
    assert last["comm/all_to_all_intra_bytes"] - rows == pytest.approx(counts, abs=0.5), (last, rows)
    for ep in (1, 2):
        zero = _bytes(counted[ep], "all_gather") + _bytes(counted[ep], "reduce_scatter")
        assert zero == pytest.approx(est[ep]["comm_gib_per_gpu"] * GIB, rel=0.05), (ep, counted[ep])
        assert counted[ep]["comm/all_gather_inter_bytes"] == 0
    assert counted[1]["comm/all_to_all_intra_bytes"] == 0 and est[1]["expert_all_to_all_gib_per_gpu"] == 0
    zero = {ep: _bytes(counted[ep], "all_gather") + _bytes(counted[ep], "reduce_scatter") for ep in (1, 2)}
    assert zero[2] < 0.95 * zero[1] and est[2]["comm_gib_per_gpu"] < 0.95 * est[1]["comm_gib_per_gpu"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_expert_parallel_traffic_at_zero_1_and_2_counted_as_estimated(stage):
    """The same model at expert_parallel=2 on 4 ranks at ZeRO-1 (bf16 with fp32 gradients:
    DeepSpeed's bf16 optimizer) and ZeRO-2: the gradients' all-reduces and the weights' all-gathers
    counted are the estimate's within 0.1% (each rank's experts reduced and gathered over the 2 ranks
    that hold them, the rest over all 4), fewer than at expert_parallel=1; the all-to-alls as at
    ZeRO-3."""
    from pretrain.estimate.memory import GIB
    from pretrain.estimate.report import Assumptions, estimate

    moe = ["model.moe_experts=4", "model.moe_top_k=4", "model.moe_hidden_dim=64", "model.moe_dense_layers=1",
           "train.global_batch_size=4", "train.activation_checkpointing=1", "data.num_streams=4",
           f"distributed.zero_stage={stage}"]
    last = _counted_step(moe + ["distributed.expert_parallel=2"], nproc=4)
    est = {ep: estimate(cfg, cfg.model, Assumptions(gpus=4)) for ep in (1, 2)
           for cfg in [load_config(TINY, ZERO3 + moe + [f"distributed.expert_parallel={ep}"])]}
    zero = _bytes(last, "all_reduce") + _bytes(last, "all_gather")
    assert _bytes(last, "reduce_scatter") == 0
    assert zero == pytest.approx(est[2]["comm_gib_per_gpu"] * GIB, rel=1e-3), (last, est[2]["comm_gib_per_gpu"] * GIB)
    assert est[2]["comm_gib_per_gpu"] < 0.95 * est[1]["comm_gib_per_gpu"]
    rows = est[2]["expert_all_to_all_gib_per_gpu"] * GIB
    assert 0 < last["comm/all_to_all_intra_bytes"] - rows < 200, (last, rows)  # (the per-expert counts)
