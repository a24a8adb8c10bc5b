"""The per-layer description (pretrain/model/args.py) on every axis of the user's path, in real
`pretrain train` processes: a recipe with most options on at once (Gemma 3's sandwich norms and
per-head q/k norms, GPT-OSS's biases and sinks, local and global layers, a NoPE layer, GeGLU, an
embedding scale, the output z-loss) and document masking, and an OLMo-2-like one (post-norms, q/k
norms over the projection, z-loss), at 2 ranks against 1 and under Ulysses (fp32 within 1e-5),
compiled against eager (bf16, ZeRO-3, activation checkpointing, 1,024 tokens), in FP8, resumed
bitwise and at another world size, refused when a resume changes the recipe, and under muP's
coordinate check. Each option against a dense reference on one process: tests/model/test_recipes.py."""

from __future__ import annotations

import math
import re
import shutil

import pytest
import torch

from helpers import (TINY, USER_PATH, losses, losses_and_norms, read_metrics, run_dir_files, run_train,
                     tokens_drawn_are_tokens_seen)

# Most options at once. Block 0 is local (a 256-token window, RoPE of base 1,000), block 1 global
# without RoPE (nope_period 2); heads 32 wide (head_size: q is 128 wide on a 64-wide model).
GEMMA_GPTOSS = ["model.norm_placement=sandwich", "model.qk_norm=head", "model.qkv_bias=true",
                "model.attn_out_bias=true", "model.attn_sinks=true", "model.layer_pattern=[local,global]",
                "model.sliding_window=256", "model.rope_local_theta=1000", "model.nope_period=2",
                "model.ffn_activation=gelu_tanh", "model.head_size=32", "model.embed_scale=8", "model.z_loss=1e-4",
                "model.document_mask=true"]
OLMO2 = ["model.norm_placement=post", "model.qk_norm=projection", "model.z_loss=1e-4"]
RECIPES = {"gemma-gptoss": GEMMA_GPTOSS, "olmo2": OLMO2}

# The user's path (tests/helpers.py: the tiny shape at 1,024 tokens, activation checkpointing, the
# 512-token vocabulary), ZeRO-3, one sequence per rank and step, 4 steps, saved at 2 and 4, evaluated
# in the loop at 2 and 4.
PATH = [*USER_PATH, "distributed.zero_stage=3", "train.global_batch_size=2", "train.max_steps=4", "checkpoint.every=2",
        "train.eval_every=2", "schedule.warmup_steps=1"]
FP32 = ["train.precision=fp32"]
# bf16 for the compile comparison: 3 steps, no eval (each eval shape compiles graphs of its own)
BF16 = ["train.precision=bf16", "train.max_steps=3", "checkpoint.every=0", "train.eval_every=0", "data.validation=[]"]

# name -> (overrides, ranks): trained on first use, once per module
RUNS = {
    "one": ([*PATH, *GEMMA_GPTOSS, *FP32], 1),
    "two": ([*PATH, *GEMMA_GPTOSS, *FP32], 2),
    "sp": ([*PATH, *GEMMA_GPTOSS, *FP32, "distributed.sequence_parallel=2"], 2),
    # the same weights and batch as `one`'s first step, without the z-loss
    "no_z": ([*PATH, *GEMMA_GPTOSS, *FP32, "model.z_loss=0", "train.max_steps=1", "train.eval_every=0",
              "data.validation=[]"], 1),
    **{f"{name}-eager": ([*PATH, *recipe, *BF16], 2) for name, recipe in RECIPES.items()},
    **{f"{name}-compiled": ([*PATH, *recipe, *BF16, "train.compile=true"], 2) for name, recipe in RECIPES.items()},
    "fp8": ([*PATH, *GEMMA_GPTOSS, *BF16, "train.precision=fp8", "train.fp8_emulate=true"], 2),
}


class Runs(dict):
    """name -> run dir of RUNS[name], trained the first time a test asks for it (its stdout beside it)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        overrides, nproc = RUNS[name]
        run = self.root / name
        proc = run_train([*overrides, f"train.run_dir={run}"], nproc=nproc, timeout=600)
        (self.root / f"{name}.stdout").write_text(proc.stdout + proc.stderr)
        self[name] = run
        return run

    def stdout(self, name) -> str:
        self[name]  # (trained if it was not)
        return (self.root / f"{name}.stdout").read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("recipes"))


def _evals(run) -> dict[int, float]:
    return {r["step"]: r["eval/loss"] for r in read_metrics(run) if "eval/loss" in r}


def _weights(run, step):
    from pretrain.checkpoint.weights import consolidated_state_dict

    return consolidated_state_dict(run / "checkpoints" / f"step_{step:08d}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["two", "sp"])
def test_two_ranks_and_ulysses_train_the_recipe_as_one_rank(runs, layout):
    """fp32, ZeRO-3: 2 data-parallel ranks, and SP=2 (each rank half of every sequence, the sinks of
    its heads), against 1 rank: the losses and the in-loop evals within 1e-5, the gradient norms
    (the first step's within 1e-5; later ones of weights Adam's eps-scale updates moved apart),
    and every weight after the last step, the sinks and the q/k norms among them, within 1e-4 of
    its tensor's norm. Windows, sinks, q/k norms and biases with packed documents masked apart.
    (Measured: 2 ranks equal 1 rank to every bit; SP within 1e-7 in the losses, 4e-5 in the weights.)"""
    one, other = losses_and_norms(runs["one"]), losses_and_norms(runs[layout])
    assert one.keys() == other.keys() == {1, 2, 3, 4}
    for step in one:
        assert other[step][0] == pytest.approx(one[step][0], rel=1e-5), (step, one, other)
        assert other[step][1] == pytest.approx(one[step][1], rel=1e-5 if step == 1 else 1e-4), (step, one, other)
    assert one[4][0] < one[1][0] - 0.1, one
    assert _evals(runs["one"]).keys() == {2, 4}
    assert _evals(runs[layout]) == pytest.approx(_evals(runs["one"]), rel=1e-5)
    tokens_drawn_are_tokens_seen(runs[layout])
    a, b = _weights(runs["one"], 4), _weights(runs[layout], 4)
    assert {"layers.0.attention.sinks", "layers.1.attention.q_norm.weight", "layers.0.attention.wq.bias",
            "layers.1.attention_out_norm.weight"} <= a.keys()
    for name in sorted(a, key=lambda n: not n.endswith("sinks")):  # (measured: 4e-5 at most under SP, sinks 2e-5)
        assert ((b[name] - a[name]).norm() / a[name].norm()).item() < 1e-4, (name, a[name], b[name])


@pytest.mark.slow
def test_train_loss_is_the_cross_entropy_and_the_z_loss_is_logged(runs):
    """With model.z_loss > 0 the loss trained on adds z_loss x mean logsumexp^2; train/loss stays
    the cross-entropy (the first step's equals the run's without the z-loss: the same weights and
    batch) and train/z_loss logs the mean logsumexp^2, at initialisation about ln(V)^2 (near-zero
    logits over V = 512 tokens)."""
    with_z, without = read_metrics(runs["one"]), read_metrics(runs["no_z"])
    first = next(r for r in with_z if "train/loss" in r and r["step"] == 1)
    [plain] = [r for r in without if "train/loss" in r]
    assert first["train/loss"] == pytest.approx(plain["train/loss"], rel=1e-6), (first, plain["train/loss"])
    assert "train/z_loss" not in plain
    assert all("train/z_loss" in r for r in with_z if "train/loss" in r)
    assert first["train/z_loss"] == pytest.approx(math.log(512) ** 2, abs=1.0), first
    for run in ("two", "sp"):  # (the mean over every rank's micro-batches, not rank 0's own)
        other = next(r for r in read_metrics(runs[run]) if "train/loss" in r and r["step"] == 1)
        assert other["train/z_loss"] == pytest.approx(first["train/z_loss"], rel=1e-5), (run, other, first)


@pytest.mark.slow
def test_the_recipe_resumes_bitwise_and_at_another_world_size(runs, tmp_path):
    """2 ranks' step-2 checkpoint, resumed in new processes: at 2 ranks, steps 3-4 and the eval at 4
    equal the run that never stopped, bit for bit; at 1 rank (DeepSpeed's universal checkpoint)
    within 1e-5."""
    straight = runs["two"]
    shutil.copytree(straight / "checkpoints" / "step_00000002", tmp_path / "step_00000002")
    want = losses_and_norms(straight)
    for nproc, name in ((2, "same"), (1, "moved")):
        run = tmp_path / name
        run_train([*RUNS["two"][0], f"train.run_dir={run}", f"checkpoint.resume={tmp_path / 'step_00000002'}"],
                  nproc=nproc)
        got = losses_and_norms(run)
        assert got.keys() == {3, 4}, (name, got)
        if nproc == 2:
            assert got == {s: want[s] for s in got}
            assert _evals(run) == {4: _evals(straight)[4]}
        else:
            for step in got:  # (measured: equal)
                assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
            assert _evals(run)[4] == pytest.approx(_evals(straight)[4], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("change, diff", [("model.qk_norm=projection", "qk_norm: checkpoint head vs config projection"),
                                          ("model.sliding_window=128", "sliding_window: checkpoint 256 vs config 128")],
                         ids=["shape", "function"])
def test_a_resume_that_changes_the_recipe_is_refused(runs, tmp_path, change, diff):
    """A shape field (the q/k norms' weights) and a function field (the window, no weight): a resume
    is refused in one line naming the field, exit 2, the checkpoint left as it was."""
    ckpt = runs["one"] / "checkpoints" / "step_00000004"
    before = run_dir_files(ckpt)
    proc = run_train([*RUNS["one"][0], change, "train.max_steps=5", f"train.run_dir={tmp_path}",
                      f"checkpoint.resume={ckpt}"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = [x for x in proc.stderr.splitlines() if x.strip()]
    assert "has another model" in line and f"({diff})" in line, line
    assert ("model shape" in line) == change.startswith("model.qk_norm"), line
    assert run_dir_files(ckpt) == before


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_compiled_recipes_train_like_eager(runs, recipe):
    """train.compile (each block and the head, ZeRO-3) on 2 ranks in bf16 with activation
    checkpointing at 1,024 tokens: eager's losses within 1e-3, graphs compiled; and eager bf16 within
    0.005 nats of fp32 (the recipe with documents: the fp32 2-rank run)."""
    eager, compiled = losses(runs[f"{recipe}-eager"]), losses(runs[f"{recipe}-compiled"])
    assert eager.keys() == compiled.keys() == {1, 2, 3}
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], abs=1e-3), (step, eager, compiled)
    assert eager[3] < eager[1], eager
    graphs = re.search(r"train.compile: the first step \(compiling\) took .* s: (\d+) graphs compiled",
                       runs.stdout(f"{recipe}-compiled"))
    assert graphs and int(graphs.group(1)) >= 1
    if recipe == "gemma-gptoss":
        fp32 = losses(runs["two"])
        assert all(abs(eager[s] - fp32[s]) < 0.005 for s in eager), (eager, fp32)
        assert eager != {s: fp32[s] for s in eager}


# -- FP8: the biased linears convert; norms, sinks and biases stay as they were


def test_fp8_converts_the_biased_linears_and_leaves_norms_and_sinks():
    """Every linear of the blocks converts, the biased wq, wk, wv, wo too (torchao's Float8Linear adds
    the bias after the float8 matmul, in the output's dtype), holding the same Parameters; the q/k
    norms and sinks are not linears and stay; the log names what stays in bf16 (the head)."""
    from pretrain.config import load_config
    from pretrain.model.float8 import convert, import_torchao, kept_in_bf16
    from pretrain.model.model import Transformer
    from pretrain.model.norm import RMSNorm

    args = load_config(TINY, ["model.dim=64", "model.n_layers=2", "model.vocab_size=256", "model.eot_id=0",
                                *GEMMA_GPTOSS]).model
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    before = {n: p for n, p in model.named_parameters()}
    assert convert(model, "tensorwise", emulate=True) == 2 * 7
    float8 = import_torchao()
    for block in model.layers:
        a = block.attention
        for lin in (a.wq, a.wk, a.wv, a.wo):
            assert isinstance(lin, float8.Float8Linear) and lin.bias is not None
        assert type(a.q_norm) is RMSNorm and type(a.k_norm) is RMSNorm and isinstance(a.sinks, torch.nn.Parameter)
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in before.items()}
    assert kept_in_bf16(model) == ["output head (1 layer)"]
    with torch.no_grad():  # the biases reach the output: moving one moves the logits
        tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
        docs = {"documents": torch.zeros_like(tokens)}
        out = model(tokens, **docs)
        model.layers[0].attention.wo.bias.add_(1.0)
        assert not torch.allclose(model(tokens, **docs), out, atol=1e-3)


@pytest.mark.slow
def test_fp8_trains_the_recipe_on_the_users_path(runs):
    """2 ranks, ZeRO-3, activation checkpointing, 1,024 tokens, emulated float8: the 14 linears of the
    blocks (8 of them biased) compute in float8, the loss is finite and falls, and starts where bf16
    starts (the same weights: float8's rounding only)."""
    out = runs.stdout("fp8")
    assert "fp8 (tensorwise, emulated): 14 linear layers compute in float8; kept in bf16: output head (1 layer)" in out
    fp8, bf16 = losses(runs["fp8"]), losses(runs["gemma-gptoss-eager"])
    assert fp8.keys() == {1, 2, 3} and all(math.isfinite(v) for v in fp8.values()) and fp8[3] < fp8[1], fp8
    assert fp8[1] == pytest.approx(bf16[1], abs=0.01) and fp8 != bf16, (fp8, bf16)


# -- muP


def test_the_recipes_vectors_take_the_norm_groups_settings():
    """Under CompleteP (m = 2, m_L = 2) the q/k norms' weights, the biases and the sinks are in the
    group of the block norms: the base rate, eps / (m m_L), no weight decay (docs/mup.md)."""
    from pretrain.config import load_config
    from pretrain.model.model import Transformer
    from pretrain.optim.optimizer import param_groups

    cfg = load_config(TINY, ["model.dim=128", "model.n_layers=4", "model.vocab_size=256", "model.eot_id=0",
                             "model.parametrization=completep", "model.mup_base_dim=64", "model.mup_base_head_dim=32",
                             "model.mup_base_layers=2", *GEMMA_GPTOSS])
    model = Transformer(cfg.model)
    names = {id(p): n for n, p in model.named_parameters()}
    [norms] = [g for g in param_groups(model, cfg.optimizer) if any(names[id(p)] == "norm.weight" for p in g["params"])]
    vectors = {n for n, p in model.named_parameters() if p.ndim == 1}
    assert {names[id(p)] for p in norms["params"]} == vectors
    assert any(n.endswith("sinks") for n in vectors) and any(n.endswith("wo.bias") for n in vectors)
    assert any(n.endswith("q_norm.weight") for n in vectors)
    assert (norms["lr_scale"], norms["eps"], norms["weight_decay"]) == (1.0, pytest.approx(cfg.optimizer.eps / 4), 0.0)


@pytest.mark.slow
def test_coordinate_check_stays_flat_with_qk_norms_and_post_norms():
    """`pretrain mup check`'s measurement (in process) under muP with OLMo 2's norms (per-head q/k
    norms, post-norms, its norm_eps 1e-6), widths 64-512: every activation's log-log slope within
    0.1 of 0, tests/test_mup.py's criterion (measured: 0.05 at most). At the default norm_eps 1e-5
    block 0 drifts (measured -0.17 to -0.21: its post-norm is still a fixed gain 1/sqrt(eps) after
    10 steps, docs/mup.md); without q/k norms the attention logits do (-0.1 to -0.3)."""
    from pretrain import mup as check

    over = ["model.parametrization=mup", "model.mup_base_dim=64", "model.mup_base_head_dim=32", "model.qk_norm=head",
            "model.norm_placement=post", "model.norm_eps=1e-6", "model.n_layers=2", "train.seed=0"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (tiny matmuls: threads only contend, 30x slower on 2 busy cores; CI's workers have 1)
    try:
        slopes = check.check(str(TINY), over, [64, 128, 256, 512], [], steps=10, seeds=4)["slopes"]
    finally:
        torch.set_num_threads(threads)
    assert set(slopes) == {"embedding", "logits", "attn_logits.0", "attn_logits.1", "block.0", "block.1"}
    assert max(abs(s) for s in slopes.values()) < 0.1, slopes
