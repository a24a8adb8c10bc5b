"""muP / CompleteP through the real commands: the groups' rates on the user's path (bf16, ZeRO-3,
activation checkpointing, 2 ranks, 1024 tokens) and after a resume at another world size, a resume
with another parametrization refused, the export against transformers and `pretrain eval`, the
coordinate check (`pretrain mup check`) with its negative controls, with AdamW and with Muon, and
the planner's use of it (`scaling lr-sweep`, `scaling plan --parametrization`)."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO, TINY, pretrain, read_metrics, run_train, train_env

pytestmark = pytest.mark.slow

LR = 1e-3
# m = dim / mup_base_dim = 4, m_L = n_layers / mup_base_layers = 2
COMPLETEP = ["model.parametrization=completep", "model.mup_base_dim=32", "model.mup_base_layers=2",
             "model.mup_base_head_dim=32", "model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2"]
# Adam with beta1 = beta2 = 0, no decay and no clipping moves each weight by its group's rate x
# g / (|g| + eps): by the rate wherever the gradient is not tiny.
SIGN_STEPS = [f"optimizer.lr={LR}", "optimizer.beta1=0", "optimizer.beta2=0", "optimizer.weight_decay=0",
              "optimizer.eps=1e-12", "optimizer.grad_clip=0", "schedule.kind=constant", "schedule.warmup_steps=1"]
# (the 512-token tokenizer: the output head is most of a bf16 step on a CPU; every head row still moves)
USER_PATH = ["model.max_seq_len=1024", "data.seq_len=1024", "train.micro_batch_size=1", "train.global_batch_size=2",
             "train.activation_checkpointing=1", "train.precision=bf16", "distributed.zero_stage=3",
             "distributed.param_persistence_threshold=0", "data.validation=[]", "train.eval_every=0",
             "logging.wandb=disabled", "logging.log_every=1", "checkpoint.every=1", "checkpoint.keep_last=10",
             "data.tokenizer=builtin:python-bpe-512"]


def _moves(run, step):
    """role -> median |change| of its weights over optimizer step `step` (fp32 master weights)."""
    from pretrain.checkpoint.weights import consolidated_state_dict

    a, b = (consolidated_state_dict(run / "checkpoints" / f"step_{s:08d}") for s in (step - 1, step))
    out = {}
    for role, names in {"hidden": ["layers.1.attention.wq.weight", "layers.2.feed_forward.w1.weight"],
                        "ffn_out": ["layers.2.feed_forward.w2.weight"], "head": ["output.weight"],
                        "norm": ["layers.0.ffn_norm.weight", "norm.weight"],
                        "embedding": ["tok_embeddings.weight"]}.items():
        d = torch.cat([(b[n] - a[n]).abs().flatten() for n in names])
        out[role] = d[d > 0].median().item()  # (embedding rows of unseen tokens do not move)
    return out


@pytest.fixture(scope="module")
def completep_run(tmp_path_factory):
    """2 steps on 2 ranks on the user's path, then a third after a resume at 1 rank (DeepSpeed's
    universal checkpoint)."""
    run = tmp_path_factory.mktemp("mup") / "run"
    common = COMPLETEP + SIGN_STEPS + USER_PATH + [f"train.run_dir={run}"]
    run_train(common + ["train.max_steps=2"], nproc=2)
    run_train(common + ["train.max_steps=3", "checkpoint.resume=auto"], nproc=1)
    return run


def test_the_groups_rates_reach_the_optimizer_on_the_users_path_and_after_a_resume(completep_run):
    for step in (2, 3):  # 2 ranks; 1 rank after the universal resume
        moved = _moves(completep_run, step)
        assert moved["hidden"] == pytest.approx(LR / 4, rel=0.02), (step, moved)  # lr / m
        assert moved["ffn_out"] == pytest.approx(LR / 3, rel=0.02), (step, moved)  # lr / r: SwiGLU 384 / 128
        for role in ("head", "norm", "embedding"):
            assert moved[role] == pytest.approx(LR, rel=0.02), (step, role, moved)
    records = {r["step"]: r for r in read_metrics(completep_run) if "train/loss" in r}
    assert records[3]["train/lr"] == LR  # the logged rate is the base rate
    meta = json.loads((completep_run / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["model_parametrization"] == {"parametrization": "completep", "mup_base_dim": 32,
                                             "mup_base_head_dim": 32, "mup_base_layers": 2}


def test_the_groups_eps_and_decay_are_in_the_saved_optimizer_state(completep_run):
    """eps / (m m_L) for hidden matrices (w2 too) and norms, / m for the head and the embedding;
    decay x m, x r for w2 (here 0)."""
    [shard] = (completep_run / "checkpoints" / "step_00000003").glob("*optim_states.pt")  # (bf16_ at bf16)
    groups = torch.load(shard, map_location="cpu", weights_only=False)["optimizer_state_dict"][
        "optimizer_state_dict"]["param_groups"]
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.0, 0.0, 0.0]
    settings = sorted((g["lr_scale"], g["eps"]) for g in groups)
    assert settings == [(0.25, pytest.approx(1e-12 / 8)), (pytest.approx(1 / 3), pytest.approx(1e-12 / 8)),
                        (1.0, pytest.approx(1e-12 / 8)), (1.0, pytest.approx(1e-12 / 4))]


def test_a_resume_with_another_parametrization_is_refused(completep_run):
    cmd = [sys.executable, "-m", "pretrain", "train", str(TINY), "logging.progress=false",
           *COMPLETEP, *SIGN_STEPS, *USER_PATH, f"train.run_dir={completep_run}", "train.max_steps=4", "checkpoint.resume=auto",
           "model.parametrization=mup"]
    proc = pretrain(cmd[3:], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [x for x in proc.stderr.splitlines() if "error" in x]
    assert "was trained with model.parametrization=completep" in line and "this run has model.parametrization=mup" in line
    assert not (completep_run / "checkpoints" / "step_00000004").exists()
    # fine-tuning from it under sp: the same weights would be another model
    cmd = [sys.executable, "-m", "pretrain", "train", str(TINY), "logging.progress=false", *COMPLETEP[1:], *USER_PATH,
           f"train.run_dir={completep_run.parent / 'tuned'}", "train.max_steps=4",
           f"checkpoint.init_from={completep_run}"]
    proc = pretrain(cmd[3:], check=False)
    assert proc.returncode == 2 and "this run has model.parametrization=sp" in proc.stderr, proc.stderr[-2000:]


@pytest.fixture(scope="module")
def mup_checkpoint(tmp_path_factory):
    """A muP model whose head_dim grew from 8 (so every multiplier is not 1), trained 3 steps, fp32."""
    run = tmp_path_factory.mktemp("mup_export") / "run"
    run_train(["model.parametrization=completep", "model.mup_base_dim=32", "model.mup_base_head_dim=8",
               "model.mup_base_layers=1", "model.dim=64", "model.n_layers=2", "model.tie_embeddings=true",
               "data.seq_len=64", "train.micro_batch_size=4", "train.max_steps=3", "optimizer.lr=3e-2",
               "logging.wandb=disabled", "train.precision=fp32", "distributed.zero_stage=3", f"train.run_dir={run}"],
              nproc=2)
    return run


def test_the_export_folds_the_multipliers(tmp_path, mup_checkpoint, monkeypatch):
    from transformers import AutoModelForCausalLM

    from pretrain.hf.export import export, load_for_inference

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = export(str(mup_checkpoint), str(tmp_path / "hf"))
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the head carries 1/m, the embedding does not
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ours, tokenizer, _ = load_for_inference(str(mup_checkpoint))
    x = torch.tensor([tokenizer.encode("The return statement leaves the current function call.").ids])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), atol=1e-5, rtol=0)
    evals = []
    for model in (mup_checkpoint, out):
        pretrain(["eval", str(model), "data.seq_len=64", "--json", str(tmp_path / "e.json"), "--data",
                  str(REPO / "README.md"), "--batches", "2"])
        evals.append(json.loads((tmp_path / "e.json").read_text())["loss"])
    assert evals[0] == pytest.approx(evals[1], rel=1e-5)


MUP_64 = ["model.parametrization=mup", "model.mup_base_dim=64", "model.mup_base_head_dim=32"]  # tiny's head_dim


def _check(tmp_path, *args):
    out = tmp_path / "check.json"
    pretrain(["mup", "check", str(TINY), *args, "--json", str(out), "--out", str(tmp_path)], timeout=600)
    return json.loads(out.read_text())


def test_coordinate_check_across_width(tmp_path):
    """Widths 64-512: under muP every activation's log-log slope is within 0.1 of 0; under sp
    (the negative control) the logits grow faster than width^0.3, and the blocks faster still."""
    mup = _check(tmp_path, *MUP_64, "--widths", "64,128,256,512")
    assert mup["parametrization"] == "mup" and mup["widths"] == [64, 128, 256, 512]
    assert set(mup["slopes"]) == {"embedding", "logits"} | {f"{k}.{i}" for k in ("attn_logits", "block") for i in range(4)}
    assert max(abs(s) for s in mup["slopes"].values()) < 0.1, mup["slopes"]
    assert (tmp_path / "coord_check_width.png").stat().st_size > 10_000
    sp = _check(tmp_path, "--widths", "64,128,256,512")
    assert sp["parametrization"] == "sp" and sp["slopes"]["logits"] > 0.3, sp["slopes"]
    assert min(sp["slopes"][f"block.{i}"] for i in range(4)) > 1.0


def test_coordinate_check_across_depth(tmp_path):
    """Depths 2-8 at width 128: under CompleteP every slope is within 0.1 of 0; under muP, which
    does not scale the residual branches, the residual stream grows with depth."""
    cp = _check(tmp_path, "model.parametrization=completep", "model.mup_base_dim=64", "model.mup_base_head_dim=32",
                "model.mup_base_layers=2", "--widths", "", "--depths", "2,4,8")
    assert cp["depths"] == [2, 4, 8] and "slopes" not in cp
    assert set(cp["depth_slopes"]) == {"embedding", "logits", "attn_logits.first", "attn_logits.half",
                                       "block.half", "block.last"}
    assert max(abs(s) for s in cp["depth_slopes"].values()) < 0.1, cp["depth_slopes"]
    assert (tmp_path / "coord_check_depth.png").is_file()
    mup = _check(tmp_path, *MUP_64, "--widths", "", "--depths", "2,4,8")
    assert mup["depth_slopes"]["block.last"] > 0.3, mup["depth_slopes"]


def test_coordinate_check_agrees_with_microsofts(tmp_path):
    """microsoft/mup's own coordinate-check loop (`mup.coord_check._get_coord_data`) runs our model
    and our optimizer groups unchanged (no MuReadout needed): with the same seeds, batch and steps,
    its RMS of the embedding, block and logit outputs gives the same slopes across width as
    `pretrain mup check` (within 0.05; measured: equal to 6 decimals), under muP and under sp."""
    import dataclasses

    coord = pytest.importorskip("mup.coord_check")
    from pretrain import mup as check
    from pretrain.config import load_config
    from pretrain.model.model import Transformer
    from pretrain.optim.optimizer import build_optimizer, set_lr

    widths, steps, seeds = [64, 128, 256, 512], 5, 3
    for over in (MUP_64, []):
        over = [*over, "train.seed=0"]
        ours = check.check(str(TINY), over, widths, [], steps=steps, seeds=seeds)
        cfg = load_config(TINY, over)
        (inputs, labels), vocab = check._batch(cfg, 2, 16)
        base = dataclasses.replace(cfg.model, vocab_size=vocab)
        calls = {w: 0 for w in widths}

        def lazy(width):
            def build():  # seeded as our check seeds each model (microsoft seeds once per seed, all widths)
                torch.manual_seed(calls[width])
                calls[width] += 1
                model = Transformer(check.sized(base, "dim", width))
                model.init_weights()
                return model
            return build

        def optimizer(model):
            opt = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
            set_lr(opt, cfg.optimizer.lr)
            return opt

        names = {"tok_embeddings": "embedding", "output": "logits", **{f"layers.{i}": f"block.{i}" for i in range(4)}}
        # it records a step's forward before that step's update: step t + 1 sees the weights after t updates
        df = coord._get_coord_data({w: lazy(w) for w in widths}, [(inputs, labels.reshape(-1))], optimizer,
                                   nsteps=steps + 1, flatten_output=True, cuda=False, nseeds=seeds,
                                   filter_module_by_name=lambda n: n in names, show_progress=False,
                                   output_fdict={"rms": lambda x: x.float().pow(2).mean().sqrt()})
        last = df[df.t == steps + 1].groupby(["module", "width"])["rms"].mean()
        theirs = {key: check.slope(widths, [last[(module, w)] for w in widths]) for module, key in names.items()}
        print(over[:-1] or "sp", {k: (round(v, 4), round(v - ours["slopes"][k], 6)) for k, v in theirs.items()})
        for key, slope in theirs.items():
            assert slope == pytest.approx(ours["slopes"][key], abs=0.05), (over, key, slope, ours["slopes"][key])


MUON = ["optimizer.name=muon", "train.seed=0"]


def test_coordinate_check_with_muon_across_width(monkeypatch):
    """optimizer.name=muon under muP, widths 64-256 (4 seeds, in process: Newton-Schulz at width 512
    on 2 CPU cores would cost minutes): every |slope| < 0.1 with the Muon groups' rates of
    pretrain/optim/optimizer.py (the base's match_adamw rate, then spectral muP). The negative control, run
    here: sp's rate 0.2 sqrt(fan_in) under muP (growing as sqrt(m)) gives attention-logit slopes of
    about +0.25 (measured 0.22-0.27, blocks up to +0.25). Checked by hand and left out for time:
    AdamW's 1/m times sp's rate (shrinking as 1/sqrt(m), what the groups gave before the rule) gave
    block slopes down to -0.13."""
    import math

    from pretrain import mup as check
    import pretrain.optim.optimizer as optim

    widths = [64, 128, 256]
    ours = check.check(str(TINY), [*MUP_64, *MUON], widths, [], steps=10, seeds=4)["slopes"]
    assert max(abs(s) for s in ours.values()) < 0.1, ours
    monkeypatch.setattr(optim, "muon_lr_scale", lambda shape, base_shape=None: 0.2 * math.sqrt(shape[1]))
    naive = check.check(str(TINY), [*MUP_64, *MUON], widths, [], steps=10, seeds=4)["slopes"]
    assert min(naive[f"attn_logits.{i}"] for i in range(4)) > 0.15, naive


def test_coordinate_check_with_muon_across_depth():
    """optimizer.name=muon under CompleteP, depths 2-8 at width 128: every |slope| < 0.1 (Muon's
    rates take no depth factor, as AdamW's under CompleteP); under muP, which does not scale the
    residual branches, the top block grows with depth (measured +0.23). Checked by hand: Muon's
    rates x m_L under CompleteP fail too (attention logits +0.55 to +0.65, block.last +0.48)."""
    from pretrain import mup as check

    base = ["model.mup_base_dim=64", "model.mup_base_head_dim=32", "model.mup_base_layers=2", *MUON]
    cp = check.check(str(TINY), ["model.parametrization=completep", *base], [], [2, 4, 8], steps=10, seeds=4)
    assert max(abs(s) for s in cp["depth_slopes"].values()) < 0.1, cp["depth_slopes"]
    mup = check.check(str(TINY), ["model.parametrization=mup", *base], [], [2, 4, 8], steps=10, seeds=4)
    assert mup["depth_slopes"]["block.last"] > 0.15, mup["depth_slopes"]


@pytest.mark.parametrize("args,message", [
    (["--widths", "64"], "at least two sizes"),
    (["--widths", "64,100"], "not a multiple of head_dim 32"),
    (["--widths", "", "--depths", "2,3"], "give even depths"),
    (["model.parametrization=mup", "--widths", "64,128"], "needs model.mup_base_dim"),
])
def test_coordinate_check_bad_input(tmp_path, args, message):
    proc = pretrain(["mup", "check", str(TINY), *args], check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert len([x for x in proc.stderr.splitlines() if x.strip()]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU `pretrain train` runs these")
@pytest.mark.parametrize("refused", ["train.precision=fp8", "train.precision=fp16"])
def test_coordinate_check_refuses_the_precision_train_refuses_in_its_line(tmp_path, refused):
    """On a CPU `pretrain train` refuses fp8 without train.fp8_emulate (no float8 matmuls) and fp16:
    the check refuses them by the same check (parallelize.resolve_precision), in the same one line,
    exit 2 (fp8 measured an fp32 model with no float8 layer, exit 0, saying nothing)."""
    def error_lines(proc):
        return [x for x in proc.stderr.splitlines() if x.startswith("pretrain:")]

    check = pretrain(["mup", "check", str(TINY), refused, "--widths", "64,128", "--steps", "1", "--seeds", "1"],
                     check=False)
    train = run_train([refused, "logging.wandb=disabled", f"train.run_dir={tmp_path}"], check=False)
    assert check.returncode == train.returncode == 2, (check.stderr[-2000:], train.stderr[-2000:])
    assert error_lines(check) == error_lines(train) and len(error_lines(check)) == 1, (check.stderr, train.stderr)
    assert refused in error_lines(check)[0] and "Traceback" not in check.stderr + train.stderr


LR_SWEEP = ["train.max_steps=30", "data.seq_len=64", "train.micro_batch_size=8", "train.eval_every=0",
            "train.eval_batches=2", "schedule.warmup_steps=3", "logging.wandb=disabled", "logging.progress=false"]


def test_lr_sweep_then_a_mup_plan_with_its_rate(tmp_path):
    sweep = tmp_path / "lr"
    cmd = [sys.executable, "-m", "pretrain", "scaling", "lr-sweep", str(TINY), *LR_SWEEP, "--lrs", "1e-4,2e-3,3e-2",
           "--out", str(sweep)]
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((sweep / "lr_sweep.json").read_text())
    runs = {lr: [r for r in read_metrics(sweep / "runs" / f"lr{lr:.3g}") if "eval/loss" in r][-1] for lr in result["lrs"]}
    assert result["eval_loss"] == [runs[lr]["eval/loss"] for lr in result["lrs"]]  # each run's final eval
    assert all(r["step"] == 30 for r in runs.values())
    assert result["best_lr"] == min(runs, key=lambda lr: runs[lr]["eval/loss"]) == 2e-3  # 1e-4 is too slow to learn
    assert f"best lr: {result['best_lr']:g}" in proc.stdout and not result["at_edge"]
    again = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and again.stdout.count("finished, skipped") == 3  # nothing retrained

    import yaml

    plan = tmp_path / "plan"
    proc = subprocess.run([sys.executable, "-m", "pretrain", "scaling", "plan", str(TINY), "--budgets", "1e15,1e16",
                           "--out", str(plan), "--parametrization", "mup", "--lr", f"{result['best_lr']:g}"],
                          cwd=REPO, env=train_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    configs = [yaml.safe_load(p.read_text()) for p in sorted((plan / "configs").glob("*.yaml"))]
    assert len({c["model"]["dim"] for c in configs}) >= 3
    for c in configs:
        assert c["optimizer"]["lr"] == 2e-3
        assert (c["model"]["parametrization"], c["model"]["mup_base_dim"]) == ("mup", 128)  # the base config's dim
        assert c["model"]["mup_base_head_dim"] == 32 == c["model"]["dim"] // c["model"]["n_heads"]
    sp = tmp_path / "sp"
    proc = subprocess.run([sys.executable, "-m", "pretrain", "scaling", "plan", str(TINY), "--budgets", "1e15,1e16",
                           "--out", str(sp)], cwd=REPO, env=train_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for p in (sp / "configs").glob("*.yaml"):
        c = yaml.safe_load(p.read_text())
        assert c["model"]["parametrization"] == "sp"
        assert c["optimizer"]["lr"] == pytest.approx(3e-3 * (128 / c["model"]["dim"]) ** 0.5)  # the sp heuristic


def test_lr_sweep_bad_input(tmp_path):
    for args, message in ((["--lrs", "1e-3,2e-3"], "3 or more distinct positive rates"),
                          (["--lrs", "1e-3,x,3"], "--lrs '1e-3,x,3': give comma-separated numbers"),
                          (["data.validation=[]", "train.eval_every=0", "--lrs", "1e-3,2e-3,4e-3"], "has no data.validation")):
        proc = subprocess.run([sys.executable, "-m", "pretrain", "scaling", "lr-sweep", str(TINY), *args, "--out",
                               str(tmp_path / "x")], cwd=REPO, env=train_env(), capture_output=True, text=True)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "x").exists()
