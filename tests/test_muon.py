"""optimizer.name=muon: the config checks, the groups by role, and real DeepSpeed engine steps
against torch.optim.Muon + torch.optim.AdamW from the same weights, at ZeRO-0, ZeRO-3 and ZeRO-3
under zero.Init on 2 ranks (clipping, gradient accumulation, a dropped update); the singular values
show Muon is active, on the user's path too (bf16, ZeRO-3, activation checkpointing, 2 ranks, 1024
tokens); checkpoints resume bitwise and refuse what they cannot; `pretrain train` on the user's path
with compile, WSD-S, spikes and a rollback.

Offload is refused (DeepSpeed clips the Muon updates there). muP's rates are here, its coordinate
check with Muon in test_mup.py."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, free_port, train_env

SCRIPT = r"""
import json, os, sys
import deepspeed, torch
import torch.optim._muon as torch_muon
from pretrain.parallel import distributed
env = distributed.init("gloo")
from pretrain.config import load_config
from pretrain.model.model import Transformer
from pretrain.optim.optimizer import MUON_ROLES, role, set_lr
from pretrain.parallel.parallelize import build_engine, build_model, deepspeed_config

ws = int(os.environ["WORLD_SIZE"])

# The reference: the same weights in a plain model, the whole global batch, torch's optimizers.
# torch.optim.Muon's Newton-Schulz casts to bf16 (_muon.py:55), which alone moves an update by
# 1.4-3.4% (relative Frobenius norm, measured on random 64x64..176x64 matrices); DeepSpeed's Gram
# iteration runs in fp16 where the accelerator reports fp16 (GPUs, and CPUs with AVX512-FP16, whose
# mkldnn does: there the AdamW part drifted 2e-4..7e-3 through the second step's gradients), else
# fp32 (ns_compute_dtype). These scenarios compare the algorithm (rates, clipping, momentum), so both
# iterations run in fp32, same coefficients and steps: they then agree to ~2e-6 per matrix.
import deepspeed.runtime.zero.muon.original_muon as ds_muon
ds_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
def newton_schulz_fp32(grad, coefficients, steps, eps):
    x = grad.float().T if grad.size(0) > grad.size(1) else grad.float()
    x = x / x.norm().clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x
torch_muon._zeropower_via_newtonschulz = newton_schulz_fp32


def run(stage, name, steps, clip, drop_first, precision, accum, seq, moe=False):
    # One scenario: its own engine (built as a fresh process would build it: seeded weights, seeded
    # batches) against the reference. moe: every block's feed-forward 2 experts, both for every token
    # (each expert full-rank), whose stacked (2, out, in) tensors Muon steps expert by expert.
    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [*(["model.moe_experts=2", "model.moe_top_k=2",
        "model.moe_hidden_dim=96", "model.moe_aux_loss=0"] if moe else []),
        "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256",
        f"model.max_seq_len={seq}", f"data.seq_len={seq}", "train.micro_batch_size=2", f"train.precision={precision}",
        "train.activation_checkpointing=1",
        f"distributed.zero_stage={stage}", "distributed.param_persistence_threshold=0", f"optimizer.name={name}",
        "optimizer.muon_ns_method=gram", f"optimizer.grad_clip={clip}", "optimizer.lr=0.02", "optimizer.weight_decay=0.1",
        f"train.global_batch_size={2 * ws * accum}"])
    rank, o = env.rank, cfg.optimizer
    ds = deepspeed_config(cfg, ws, precision)
    engine = build_engine(build_model(cfg.model, cfg, ds, seed=0), cfg, ds, env.device)

    def weights():
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {k: v.detach().clone().float() for k, v in engine.module.named_parameters()}

    w0 = weights()
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    step = inner.step
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (2 * ws * accum, seq + 1), generator=g) for _ in range(steps)]
    norms = []
    for k, b in enumerate(batches):
        # drop_first: the first update dropped as the trainer's guard drops one (its inner step not run)
        inner.step = (lambda *a, **kw: None) if drop_first and k == 0 else step
        before = weights()  # (the last step's update is checked for orthogonality)
        set_lr(engine.optimizer, o.lr)
        for m in range(accum):  # micro-batch m of this rank: rows of chunk m x ws + rank
            mine = b[(m * ws + rank) * 2:(m * ws + rank + 1) * 2]
            engine.backward(engine(mine[:, :-1], labels=mine[:, 1:]))
            engine.step()
        norm = engine.get_global_grad_norm()  # (None at ZeRO-0 in fp32: the trainer takes it there)
        norms.append(None if norm is None else float(norm))
    w1 = weights()

    ref = Transformer(engine.module.args)
    ref.load_state_dict(w0, strict=False)
    hidden = {n for n, p in ref.named_parameters() if p.ndim in (2, 3) and role(n, p.ndim) in MUON_ROLES}
    params = dict(ref.named_parameters())
    # Each expert of a stacked tensor as a matrix of its own for torch.optim.Muon (2-D only)
    experts = {n: [params[n][e].detach().clone().requires_grad_() for e in range(len(params[n]))]
               for n in hidden if params[n].ndim == 3}
    matrices = [params[n] for n in hidden if n not in experts] + [m for ms in experts.values() for m in ms]
    decay = [p for n, p in params.items() if n not in hidden and p.ndim == 2 and "tok_embeddings" not in n]
    rest = [p for n, p in params.items() if n not in hidden and not (p.ndim == 2 and "tok_embeddings" not in n)]
    adamw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    optimizers = [torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                     {"params": rest, "weight_decay": 0.0}], **adamw)]
    optimizers.append(torch.optim.Muon(matrices, lr=o.lr, weight_decay=o.weight_decay, momentum=o.muon_momentum,
                                       nesterov=True, ns_steps=5, adjust_lr_fn="match_rms_adamw") if name == "muon"
                      else torch.optim.AdamW(matrices, weight_decay=o.weight_decay, **adamw))
    ref_norms = []
    for b in batches[1:] if drop_first else batches:
        ref.zero_grad()  # (the stacked experts too, whose matrices the optimizers hold as copies)
        for opt in optimizers:
            opt.zero_grad()
        n = ws * accum  # the mean of the micro-batches' mean losses, as the engine averages them
        (sum(ref(b[r * 2:(r + 1) * 2, :-1], labels=b[r * 2:(r + 1) * 2, 1:]) for r in range(n)) / n).backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
        ref_norms.append(norm.item())
        if clip:  # the gradients, before any optimizer (torch's and Moonshot's order)
            torch.nn.utils.clip_grads_with_norm_(ref.parameters(), clip, norm)
        for n, ms in experts.items():
            for e, m in enumerate(ms):
                m.grad = params[n].grad[e].clone()
        for opt in optimizers:
            opt.step()
        with torch.no_grad():
            for n, ms in experts.items():
                for e, m in enumerate(ms):
                    params[n][e].copy_(m)
    out = {}
    for n, p in ref.named_parameters():
        want, got = p.detach() - w0[n], w1[n] - w0[n]
        out[n] = {"rel_err": ((got - want).norm() / want.norm()).item()}
        if n in hidden:  # the last step's update itself (decay taken out): singular values (each expert's)
            s = torch.linalg.svdvals((w1[n] - before[n] * (1 - o.lr * o.weight_decay)) / -o.lr)
            out[n]["sv_ratio"] = (s.max(dim=-1).values / s.min(dim=-1).values).max().item()
    out["norms"] = {"engine": norms, "reference": ref_norms}
    engine.destroy()
    return out


for i, scenario in enumerate(json.loads(sys.argv[1])):
    out = run(**scenario)
    if env.rank == 0:
        print(f"RESULT {i} " + json.dumps(out), flush=True)
"""


def _scenario(stage: int, name: str = "muon", steps: int = 2, clip: float = 0.0, drop_first: bool = False,
              precision: str = "fp32", accum: int = 1, seq: int = 128, moe: bool = False) -> dict:
    return dict(stage=stage, name=name, steps=steps, clip=clip, drop_first=drop_first, precision=precision,
                accum=accum, seq=seq, moe=moe)


def _launch(nproc: int, scenarios: list[dict], spread: Path | None = None) -> list[dict]:
    """SCRIPT's scenarios, one after the other, in one process per rank (nproc ranks): their results;
    then SPREAD's run, its files in `spread`, if given."""
    script = f"from pathlib import Path\nREPO = Path({str(REPO)!r})\n" + SCRIPT + (SPREAD if spread else "")
    if nproc == 1:
        env = train_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
                         "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
        cmd = [sys.executable, "-c", script]
    else:
        env = train_env()
        path = REPO / ".pytest_muon_step.py"  # torchrun runs a file
        path.write_text(script)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), str(path)]
    try:
        proc = subprocess.run(cmd + [json.dumps(scenarios)] + ([str(spread)] if spread else []), cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300 * len(scenarios))
    finally:
        if nproc > 1:
            path.unlink(missing_ok=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == len(scenarios), proc.stdout[-2000:] + proc.stderr[-4000:]
    return [json.loads(line.split(" ", 2)[2]) for line in lines]


# The engine-step tests' scenarios (ranks, scenario), built as each test asks for its own.
STEPS_CASES = [(0, 1, 0.0, 1), (3, 1, 0.0, 1), (3, 2, 0.0, 1), (3, 2, 0.3, 1), (3, 2, 0.3, 2), (1, 2, 0.3, 1),
               (2, 2, 0.3, 2)]
DROPPED_CASES = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16")]
ACTIVE_STAGES = [3, 0]


def _steps_case(stage, nproc, clip, accum):
    return nproc, _scenario(stage, clip=clip, accum=accum)


def _dropped_case(stage, precision):
    bf16 = precision == "bf16"
    return (2 if bf16 else 1), _scenario(stage, drop_first=True, precision=precision, clip=0.3 if bf16 else 0.0)


def _active_case(stage):
    return 2, _scenario(stage, steps=1, precision="bf16", seq=1024)


BAND_CASE = (1, _scenario(0, "adamw", steps=1))
MOE_CASES = [(0, 1), (3, 2), (2, 2)]  # (stage, ranks)


def _moe_case(stage, nproc):
    return nproc, _scenario(stage, clip=0.3 if stage else 0.0, moe=True)


SPREAD_CASE = (2, None)  # SPREAD's run: its files' folder
CASES = ([_steps_case(*c) for c in STEPS_CASES] + [_dropped_case(*c) for c in DROPPED_CASES]
         + [_active_case(s) for s in ACTIVE_STAGES] + [BAND_CASE] + [_moe_case(*c) for c in MOE_CASES])


@pytest.fixture(scope="module")
def engine_step(tmp_path_factory):
    """case -> its result. Every scenario of one world size runs in one launch (each builds its own
    engine, as its own process would: nothing carries from one to the next but the process group),
    SPREAD's run last in the 2-rank one, at the first test that asks for one of them: two launches
    for the module instead of sixteen."""
    done: dict = {}
    spread = tmp_path_factory.mktemp("spread")

    def get(case):
        nproc, scenario = case
        mine = [s for n, s in CASES if n == nproc]
        if nproc not in done:
            try:
                done[nproc] = _launch(nproc, mine, spread if nproc == 2 else None)
            except AssertionError as e:  # (every test of that world fails with it, none launches again)
                done[nproc] = e
        if isinstance(done[nproc], AssertionError):
            raise done[nproc]
        return spread if scenario is None else dict(done[nproc][mine.index(scenario)])

    return get


# The FFN matrices and wk, wv have full-rank gradients at this size; wq and wo do not at the first
# steps (wo's input, the heads' outputs, has rank ~ n_kv_heads x head_dim = 32 of 64 under GQA
# with near-uniform attention), and Newton-Schulz leaves a null direction null, so they are not
# used for the band.
FULL_RANK = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "attention.wk", "attention.wv")


@pytest.mark.slow
@pytest.mark.parametrize("stage,nproc,clip,accum", STEPS_CASES)
def test_muon_steps_as_torch_muon_does(engine_step, stage, nproc, clip, accum):
    """Two steps (so the momentum counts) from the same weights. Measured: Muon's matrices within
    1.3e-3 relative (Frobenius) of torch.optim.Muon with adjust_lr_fn=match_rms_adamw, the AdamW
    part within 4e-5 (1 rank and 2 ranks alike). The fp32 iterations agree to ~2e-6 on one matrix;
    the second step starts from weights and momenta that already differ by that, and wq's and wk's
    ill-conditioned gradients
    (singular values spanning 100x) magnify it in the Newton-Schulz polynomial, so 5e-3. A wrong
    rate rule (e.g. DeepSpeed's own sqrt(max(1, fan_out/fan_in)) alone: x0.6) or an AdamW
    step instead (#8438) is off by O(1).

    With clipping below the gradient norm (0.3 against 0.54-0.80) the gradients are clipped before
    Muon, as clip_grad_norm_ then torch.optim.Muon: measured within 2.3e-3, and the engine reports
    the gradient norm (DeepSpeed alone reports the Muon updates' norm, ~31 here, and divides every
    Muon step by it: parallelize.muon_at_zero3, and muon_at_zero12 at ZeRO-1/2, where DeepSpeed
    orthogonalises while it cuts the gradient partitions). With 2 micro-batches per step Muon runs
    once per step on their mean (DeepSpeed #8443): measured within 2.4e-3."""
    got = engine_step(_steps_case(stage, nproc, clip, accum))
    norms = got.pop("norms")
    if stage:
        assert norms["engine"] == pytest.approx(norms["reference"], rel=1e-4)
    for name, r in got.items():
        muon = "sv_ratio" in r
        assert r["rel_err"] < (5e-3 if muon else 1e-4), (name, r)
        if muon and any(k in name for k in FULL_RANK):
            # Orthogonalised: singular values within a narrow band (Newton-Schulz with these
            # coefficients maps them into a band, not to 1: measured max/min 1.65-1.76 at either
            # step, 1 or 2 ranks; AdamW's update: 4.4-5.1, see below).
            assert r["sv_ratio"] < 3.0, (name, r)


@pytest.mark.slow
@pytest.mark.parametrize("stage,nproc", MOE_CASES)
def test_muon_steps_each_expert_as_torch_muon_steps_a_matrix(engine_step, stage, nproc):
    """A Mixture-of-Experts (2 experts per block, both for every token) at ZeRO-0, ZeRO-3 and ZeRO-2
    (clipped at 0.3 there): each expert of a stacked (E, out, in) tensor is stepped as
    torch.optim.Muon steps that expert's matrix alone (within the dense matrices' 5e-3; the AdamW
    part 1e-4), and each expert's last update has the narrow singular-value band of an
    orthogonalised matrix. Before, Muon with experts was refused; left to AdamW the experts' error
    is O(1)."""
    got = engine_step(_moe_case(stage, nproc))
    norms = got.pop("norms")
    if stage:
        assert norms["engine"] == pytest.approx(norms["reference"], rel=1e-4)
    experts = [name for name in got if ".experts.w" in name]
    assert len(experts) == 3 * 2  # (w1, w2, w3 of 2 blocks)
    for name, r in got.items():
        assert r["rel_err"] < (5e-3 if "sv_ratio" in r else 1e-4), (name, r)
    for name in experts:
        assert got[name]["sv_ratio"] < 3.0, (name, got[name])


# test_muon_step_spreads_newton_schulz_and_sends_its_share's run: the 2-rank launch of SCRIPT runs it
# after its scenarios (its counters then wrap only this engine's steps), writing to sys.argv[2].
SPREAD = r"""
import deepspeed.comm as dcomm
from deepspeed.runtime.zero.muon import original_muon
from pretrain.config import zero_sizes
from pretrain.estimate.muon import muon_step
from pretrain.optim.muon import matrix_flops

cfg = load_config(str(REPO / "configs" / "tiny.yaml"), [
    "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=256",
    "model.max_seq_len=32", "data.seq_len=32", "train.micro_batch_size=2", "train.precision=fp32",
    "distributed.zero_stage=3", "distributed.param_persistence_threshold=0", "optimizer.name=muon",
    f"train.global_batch_size={2 * env.world_size}"])
ds = deepspeed_config(cfg, env.world_size, "fp32")
engine = build_engine(build_model(cfg.model, cfg, ds, seed=0), cfg, ds, env.device)
shapes, sent, gathers = [], [0], [0]
update, a2a, gather = original_muon.muon_update, distributed.all_to_all, dcomm.all_gather


def counted_update(grad, *args, **kwargs):
    shapes.append(list(grad.shape))
    return update(grad, *args, **kwargs)


def counted_a2a(output, tensor, output_split_sizes, input_split_sizes, group=None):
    me = dcomm.get_rank(group)  # what this rank sends to the others
    sent[0] += (sum(input_split_sizes) - input_split_sizes[me]) * tensor.element_size()
    return a2a(output, tensor, output_split_sizes, input_split_sizes, group=group)


def counted_gather(*args, **kwargs):  # DeepSpeed's own Muon step all-gathers; ours should not run it
    gathers[0] += 1
    return gather(*args, **kwargs)


original_muon.muon_update, distributed.all_to_all, dcomm.all_gather = counted_update, counted_a2a, counted_gather
tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(env.rank))
for _ in range(2):
    engine.backward(engine(tokens[:, :-1], labels=tokens[:, 1:]))
    engine.step()
with open(f"{sys.argv[2]}/rank{env.rank}.json", "w") as f:
    json.dump({"rank": env.rank, "shapes": shapes, "sent": sent[0] / 2, "gathers": gathers[0],
                              "flops": sum(matrix_flops(s) for s in shapes) / 2,
                              "estimate": muon_step(cfg.model, 3, env.world_size, zero_sizes(cfg)["reduce_bucket_size"], 4)}, f)
"""


@pytest.mark.slow
def test_muon_step_spreads_newton_schulz_and_sends_its_share(engine_step):
    """Our ZeRO-3 Muon step (pretrain/optim/muon.py) on 2 ranks, two steps: every Muon matrix is
    orthogonalised once per step, by one rank; the ranks' Newton-Schulz FLOPs differ by less than one
    matrix's (DeepSpeed's round robin per bucket gave rank 0 24 of 28 matrices on the estimate's
    model); each rank sends by all-to-all exactly what pretrain estimate's muon_step says for the
    busiest rank (2 c per partition slice: the gradient and momentum slices of the matrices it does
    not own, n - 1 slices of the update and momentum back per matrix it owns), about 4 M c (n-1)/n^2;
    and DeepSpeed's own step (its all-gathers) does not run."""
    out = engine_step(SPREAD_CASE)
    runs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    from pretrain.optim.muon import matrix_flops

    est = runs[0]["estimate"]
    n_matrices = 7 * 2
    assert sum(len(r["shapes"]) for r in runs) == 2 * n_matrices  # each matrix once per step, on one rank
    assert sum(r["flops"] for r in runs) == est["flops_total"]
    largest = max(matrix_flops(s) for r in runs for s in r["shapes"])
    assert abs(runs[0]["flops"] - runs[1]["flops"]) <= largest
    assert max(r["flops"] for r in runs) == est["flops"]
    assert max(r["sent"] for r in runs) == est["comm"]
    M, c, n = est["params"], 4, 2
    for r in runs:
        assert r["gathers"] == 0
        assert r["sent"] == pytest.approx(4 * M * c * (n - 1) / n**2, rel=0.15)


@pytest.mark.slow
@pytest.mark.parametrize("stage", ACTIVE_STAGES)
def test_muon_is_active_on_the_users_path(engine_step, stage):
    """bf16, ZeRO-3 under zero.Init (and ZeRO-0, which runs bf16 as ZeRO-1), activation
    checkpointing, 2 ranks, 1024-token sequences: the #8438 failure (every weight on AdamW) fails
    the band. Against the fp32 reference the step differs by bf16's rounding of the gradients and
    of the weights the update is read from."""
    got = engine_step(_active_case(stage))
    got.pop("norms")
    for name, r in got.items():
        assert r["rel_err"] < 0.2, (name, r)
        if any(k in name for k in FULL_RANK):
            assert r["rel_err"] < 0.05 and r["sv_ratio"] < 3.0, (name, r)


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", DROPPED_CASES)
def test_a_dropped_update_leaves_the_momentum(engine_step, stage, precision):
    """The trainer drops an update (non-finite loss, spike) by not running the inner optimizer's
    step. DeepSpeed folds the gradient into Muon's momentum before it: at ZeRO-3
    (stage3.py:2885; parallelize.muon_at_zero3 puts the momentum back), at ZeRO-1/2 (it commits the
    staged momentum before the inner step; muon_at_zero12 commits it in the inner step) and in its
    bf16 optimizer (bf16 at stage 0/1: muon_at_bf16 orthogonalises in the inner step). So a dropped
    step then a step equals one step from the same weights (without the fix the momentum holds 5%
    of the dropped gradient, about a third of the next Nesterov blend: O(1) off). In bf16 (2 ranks,
    the gradients clipped at 0.3, which DeepSpeed's bf16 optimizer does before Newton-Schulz), within
    bf16's rounding of the fp32 reference, and the reported norm is the gradient's."""
    bf16 = precision == "bf16"
    got = engine_step(_dropped_case(stage, precision))
    norms = got.pop("norms")
    if bf16:
        assert norms["engine"][1:] == pytest.approx(norms["reference"], rel=0.05)
    for name, r in got.items():
        if not bf16:
            assert r["rel_err"] < (5e-3 if "sv_ratio" in r else 1e-4), (name, r)
        elif any(k in name for k in FULL_RANK):
            assert r["rel_err"] < 0.05, (name, r)


@pytest.mark.slow
def test_the_band_tells_adamw_from_muon(engine_step):
    """The negative control of the check above: with optimizer.name=adamw (the same step as every
    weight falling back to AdamW, the #8438 failure) the hidden matrices' updates are far from
    orthogonal, and the AdamW path is torch's AdamW exactly as before."""
    got = engine_step(BAND_CASE)
    got.pop("norms")
    for name, r in got.items():
        assert r["rel_err"] < 1e-6, (name, r)
        if "sv_ratio" in r and any(k in name for k in FULL_RANK):
            assert r["sv_ratio"] > 4.0, (name, r)


def test_muon_groups_by_role():
    """Every 2-D hidden matrix to Muon (wq wk wv wo w1 w2 w3), embedding, head and norms to AdamW,
    whatever the names DeepSpeed would guess (its rule keeps `lm_head` out by name; ours is `output`)."""
    from pretrain.config import load_config
    from pretrain.model.model import Transformer
    from pretrain.optim.optimizer import muon_param_groups

    cfg = load_config(str(REPO / "configs" / "tiny.yaml"), ["optimizer.name=muon", "model.vocab_size=256"])
    model = Transformer(cfg.model)
    groups = muon_param_groups(model, cfg.optimizer)
    names = {p: n for n, p in model.named_parameters()}
    for g in groups:
        for p in g["params"]:
            n = names[p]
            hidden = p.ndim == 2 and any(k in n for k in ("wq", "wk", "wv", "wo", "w1", "w2", "w3"))
            assert g["use_muon"] is hidden is p.use_muon, n
            if hidden:  # decays by lr x weight_decay per step, steps by lr x 0.2 sqrt(fan_in)
                assert g["lr_scale"] == pytest.approx(0.2 * math.sqrt(p.shape[1]))
                assert g["lr_scale"] * g["weight_decay"] == pytest.approx(cfg.optimizer.weight_decay)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


@pytest.mark.parametrize("shape", [(64, 64), (32, 64), (176, 64), (64, 176)])
def test_rate_rule_matches_torch_match_rms_adamw(shape):
    """DeepSpeed scales the orthogonalised update by sqrt(max(1, fan_out/fan_in)); with our group
    rate the product is torch.optim.Muon's match_rms_adamw rate, 0.2 sqrt(max(fan_out, fan_in))."""
    from torch.optim._muon import _adjust_lr

    from pretrain.optim.optimizer import muon_lr_scale

    ds = math.sqrt(max(1, shape[0] / shape[1]))
    assert muon_lr_scale(shape) * ds == pytest.approx(_adjust_lr(1.0, "match_rms_adamw", torch.Size(shape)))


@pytest.mark.parametrize("parametrization", ["mup", "completep"])
def test_muon_rates_under_mup_follow_the_spectral_condition(parametrization):
    """Under mup/completep each Muon step (group rate x DeepSpeed's sqrt(max(1, fan_out/fan_in)))
    is the base model's match_adamw step times sqrt(aspect / base aspect): constant across width
    and depth where the aspect is (wq wk wv wo), following it where `multiple_of` rounding moves it
    (w1 w3 tall, w2 wide: SwiGLU 1408 / dim 512 against 192 / 64). At the base width the groups are
    sp's, and lr x weight_decay is AdamW's everywhere. (The coordinate check is in test_mup.py.)"""
    from pretrain.config import load_config
    from pretrain.model.model import Transformer
    from pretrain.optim.optimizer import muon_param_groups

    def steps(*over):
        cfg = load_config(str(REPO / "configs" / "tiny.yaml"), ["optimizer.name=muon", "model.vocab_size=256", *over])
        model = Transformer(cfg.model)
        out = {}
        for g in muon_param_groups(model, cfg.optimizer):
            for p in g["params"]:
                if g["use_muon"]:
                    assert g["lr_scale"] * g["weight_decay"] == pytest.approx(cfg.optimizer.weight_decay)
                    n = next(n for n, q in model.named_parameters() if q is p).split(".", 2)[-1]
                    fo, fi = p.shape
                    out[n] = (g["lr_scale"], g["lr_scale"] * math.sqrt(max(1, fo / fi)), fo / fi)
        return out

    muP = [f"model.parametrization={parametrization}", "model.mup_base_dim=64", "model.mup_base_head_dim=32",
           "model.mup_base_layers=2"]
    small = ["model.dim=64", "model.n_heads=2", "model.n_kv_heads=1", "model.n_layers=2"]
    base, sp = steps(*muP, *small), steps(*small)
    assert base == sp  # the base model is sp's, rates included
    assert base["feed_forward.w2.weight"][0] == pytest.approx(0.2 * math.sqrt(192))
    wide = steps(*muP, "model.dim=512", "model.n_heads=16", "model.n_kv_heads=8", "model.n_layers=8")
    assert wide.keys() == base.keys()
    for n, (rate, step, aspect) in wide.items():
        assert step / math.sqrt(aspect) == pytest.approx(base[n][1] / math.sqrt(base[n][2])), n
    assert wide["attention.wq.weight"][0] == wide["attention.wk.weight"][0] == base["attention.wq.weight"][0] == 1.6
    assert wide["feed_forward.w2.weight"][0] == pytest.approx(0.2 * math.sqrt(192 * 8 / (1408 / 192)))  # x sqrt(m/r)
    assert wide["feed_forward.w1.weight"][0] == 1.6  # its aspect moves by r/m in DeepSpeed's factor


@pytest.mark.parametrize("override,message", [
    ("optimizer.name=lion", "optimizer.name='lion' is not one of adamw, muon"),
    ("optimizer.muon_nesterov=false", "DeepSpeed's Muon runs Nesterov momentum"),
    ("optimizer.muon_ns_steps=6", "DeepSpeed's Muon runs Nesterov momentum"),
    ("optimizer.muon_momentum=1.0", "optimizer.muon_momentum=1.0 must be in [0, 1)"),
    ("distributed.offload_optimizer=true", "DeepSpeed's offload path clips the Muon update instead of the gradient"),
])
def test_muon_config_is_checked(override, message):
    from pretrain.config import load_config
    from pretrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        load_config(str(REPO / "configs" / "tiny.yaml"), ["optimizer.name=muon", override], world_size=1)


@pytest.mark.slow
def test_muon_checkpoints_resume_bitwise_and_refuse_what_they_cannot(tmp_path):
    """2-rank ZeRO-3 Muon run, checkpoint at step 4: resumed at 2 ranks it repeats steps 5-8
    bitwise (the momentum buffers are in DeepSpeed's optimizer shards); at 1 rank it repeats them
    within 1e-6, 1e-5 where DeepSpeed's Newton-Schulz runs in fp16 (its own universal conversion: DeepSpeed's fails on Muon's state, KeyError
    'exp_avg'); with optimizer.name=adamw it is refused (a resume keeps the optimizer). Fine-tuning from it with
    AdamW starts a fresh optimizer; asking to load its optimizer state then is refused. (The two
    refusals run on 1 rank: the check reads meta.json before any shard, at any world size, and a
    1-rank run expected to fail is forked, not started fresh under torchrun.)"""
    import shutil

    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype
    from helpers import losses, run_train

    base = ["data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8", "logging.log_every=1",
            "logging.wandb=disabled", "schedule.warmup_steps=2", "distributed.zero_stage=3", "train.max_steps=8",
            "train.eval_every=0", "optimizer.name=muon"]
    straight = tmp_path / "straight"
    run_train(base + ["checkpoint.every=4", f"train.run_dir={straight}"], nproc=2)
    step4 = straight / "checkpoints" / "step_00000004"
    # Fine-tuning may switch the optimizer (fresh state); taking the optimizer's state along may not.
    tuned = run_train(base + ["optimizer.name=adamw", f"checkpoint.init_from={step4}", "train.max_steps=2",
                              f"train.run_dir={tmp_path / 'tuned'}"], nproc=2)
    assert json.loads((tmp_path / "tuned" / "checkpoints" / "step_00000002" / "meta.json").read_text())[
        "optimizer"] == "adamw", tuned.stdout[-2000:]
    carried = run_train(base + ["optimizer.name=adamw", f"checkpoint.init_from={step4}", "checkpoint.init_load_optimizer=true",
                                f"train.run_dir={tmp_path / 'carried'}"], nproc=1, check=False)
    assert carried.returncode != 0 and "was trained with optimizer.name=muon" in carried.stdout + carried.stderr
    want = losses(straight)
    for name, nproc, extra in [("again", 2, []), ("one", 1, []), ("adamw", 1, ["optimizer.name=adamw"])]:
        shutil.copytree(straight / "checkpoints" / "step_00000004", tmp_path / name / "checkpoints" / "step_00000004")
        proc = run_train(base + extra + ["checkpoint.resume=auto", f"train.run_dir={tmp_path / name}"], nproc=nproc,
                         check=name != "adamw")
        if name == "again":
            got = losses(tmp_path / name)
            assert sorted(got) == [5, 6, 7, 8] and all(got[s] == want[s] for s in got)
        elif name == "one":  # through pretrain/checkpoint/reshard.py's conversion, the momentum included
            # (Newton-Schulz in fp16, where DeepSpeed runs it so on this CPU: measured within 2.1e-6)
            rel = 1e-6 if ns_compute_dtype("gram") == torch.float32 else 1e-5
            got = losses(tmp_path / name)
            assert sorted(got) == [5, 6, 7, 8] and all(got[s] == pytest.approx(want[s], rel=rel) for s in got), (
                got, {s: want[s] for s in got})
        else:
            assert proc.returncode != 0
            assert "was trained with optimizer.name=muon, this run has optimizer.name=adamw" in proc.stdout + proc.stderr


# The user's path (tests/test_user_path.py's): 2 ranks, bf16, ZeRO-3, activation checkpointing, 1024 tokens.
USER_PATH = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=1024",
             "data.seq_len=1024", "train.micro_batch_size=1", "train.global_batch_size=4",
             "train.activation_checkpointing=1", "distributed.param_persistence_threshold=0", "logging.log_every=1",
             "logging.wandb=disabled", "train.eval_every=0", "train.eval_batches=1", "data.num_streams=2",
             "train.precision=bf16", "distributed.zero_stage=3", "optimizer.name=muon", "train.max_steps=14",
             "checkpoint.every=3", "checkpoint.keep_last=10", "schedule.warmup_steps=2"]
# WSD-S (a decay branch ending at step 8, started from step 6's state) and the spike guard:
# injected spikes (loss and gradients x1000) at 10, 11, 12 are dropped, then roll the run back to
# step 9 with 2 batches skipped (spike_sigma=50: only the injected spikes count).
FEATURES = ["train.compile=true", "schedule.kind=wsd", "schedule.decay_points=[8]", "schedule.decay_fraction=0.25",
            "train.on_nonfinite=skip", "resilience.spike_sigma=50", "resilience.spike_warmup=3",
            "resilience.spike_window=6", "resilience.rollback_after=3", "resilience.rollback_window=5",
            "resilience.rollback_skip_batches=2"]
SPIKES = {"PRETRAIN_FAULT": "spike@step=10;spike@step=11;spike@step=12"}


@pytest.mark.slow
def test_muon_trains_on_the_users_path_with_compile_wsd_s_and_a_rollback(tmp_path):
    """`pretrain train` with Muon on the user's path, compiled, with a WSD-S branch, dropped spikes
    and a rollback, each step in the curve once; a resume from step 6's checkpoint (before the
    branch, the spikes and the rollback) repeats every later loss bitwise: the momentum buffers, the
    branch and the rollback come back alike."""
    import shutil

    from helpers import losses, read_metrics, run_train

    straight = tmp_path / "straight"
    proc = run_train(USER_PATH + FEATURES + [f"train.run_dir={straight}"], nproc=2, env=SPIKES)
    out = proc.stdout
    assert "train.compile: the first step (compiling)" in out
    assert "decay branch to step 8: train loss" in out
    assert "warning: 3 spikes in steps 10-12: rolling back to step_00000009 and skipping 2 batches" in out, out[-3000:]
    records = [r for r in read_metrics(straight) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, 15))
    assert all(math.isfinite(r["train/loss"]) and r["train/grad_norm"] < 100 for r in records)
    assert records[-1]["train/loss"] < records[0]["train/loss"] - 1.0
    meta = json.loads((straight / "checkpoints" / "step_00000014" / "meta.json").read_text())
    assert meta["optimizer"] == "muon" and meta["world_size"] == 2

    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step_00000006", resumed / "checkpoints" / "step_00000006")
    run_train(USER_PATH + FEATURES + ["checkpoint.resume=auto", f"train.run_dir={resumed}"], nproc=2, env=SPIKES)
    got, want = losses(resumed), losses(straight)
    assert sorted(got) == list(range(7, 15)) and all(got[s] == want[s] for s in got), (got, want)
