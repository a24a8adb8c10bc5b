"""Continued pretraining from the open families (pretrain/hf/mapping.py) on the user's path: a tiny
random Qwen3-MoE, OLMo 3, Gemma 3, SmolLM3 and GPT-OSS built from transformers' config classes and
saved to a folder (never downloaded) -> `pretrain train` with checkpoint.init_from in bf16, ZeRO-3,
activation checkpointing, 2 ranks and 1,024 tokens (the MoEs with expert parallelism 2): the run's first eval is
transformers' loss on the same windows, and its checkpoint exports to the same tensors (rounded to
bf16), bit for bit.
And Qwen3-MoE trained with expert parallelism 2 on 2 ranks as on 1 rank, in fp32."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import REPO, hf_weights, losses_and_norms, pretrain, read_metrics, run_train

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

CONTINUE = REPO / "configs" / "continue_smollm2.yaml"  # init_from and tokenizer overridden to local dirs
TOKENIZER = REPO / "data_pipeline" / "assets" / "python-docs-bpe.json"
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.05, pad_token_id=None)
# model_type -> (config class, its fields): each family's distinctive pieces at 1,024 tokens (windows of
# 128, NoPE blocks, (1 + w) norms, a dense first block and renormalised top-2 of 4 experts)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, head_dim=32, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])),
    "olmo3": ("Olmo3Config", dict(num_hidden_layers=4, sliding_window=128, rope_theta=500000.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24,
                                             sliding_window=128, sliding_window_pattern=3, rope_theta=1e6,
                                             rope_local_base_freq=10000.0)),
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=2)),
    "gpt_oss": ("GptOssConfig", dict(num_hidden_layers=2, head_dim=16, sliding_window=128, num_local_experts=4,
                                     num_experts_per_tok=2, intermediate_size=32, swiglu_limit=0.4,
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 256})),
}
USER_PATH = ["data.seq_len=1024", "train.micro_batch_size=1", "train.global_batch_size=2", "train.precision=bf16",
             "distributed.zero_stage=3", "train.activation_checkpointing=1", "distributed.param_persistence_threshold=0",
             "logging.wandb=disabled", "logging.log_every=1", "data.num_streams=2"]


def hf_dir(path: Path, model_type: str) -> Path:
    """A random model of the family saved by transformers, with our builtin tokenizer; its norms and
    biases drawn away from their init (Gemma's stored w around 0: gains around 1)."""
    from tokenizers import Tokenizer

    config_class, fields = FAMILIES[model_type]
    vocab = Tokenizer.from_file(str(TOKENIZER)).get_vocab_size()
    cfg = getattr(transformers, config_class)(vocab_size=vocab, **{**COMMON, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or name.endswith("_bias"):  # (GPT-OSS's expert biases: (E, ...))
                centre = 1.0 if "norm" in name and model_type != "gemma3_text" else 0.0
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + centre)
    model.save_pretrained(path)
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path


def transformers_loss(src: Path, run: Path) -> float:
    """transformers' own model of `src`, fp32: the mean next-token loss over the windows the run's
    first eval scored (data_pipeline.evaluation_windows of its config, 1 global batch)."""
    import data_pipeline as dp
    from pretrain.config import load_config

    cfg = load_config(run / "config.yaml", saved=True)
    tokenizer = dp.load_tokenizer(str(cfg.data.tokenizer))
    windows = dp.evaluation_windows(cfg.data, tokenizer, 0, 1, cfg.global_batch(2) * cfg.train.eval_batches)
    batch = torch.stack([torch.from_numpy(w.astype("int64")) for w in windows])
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_family_continues_on_the_users_path_from_transformers_loss(model_type, tmp_path):
    """One step at lr 0 in bf16, ZeRO-3, activation checkpointing, 2 ranks, 1,024 tokens (Qwen3-MoE
    and GPT-OSS with expert_parallel=2): the eval at step 1 is transformers' fp32 loss on the same windows within
    bf16's rounding, and the export is the source in bf16 (the precision the run trains from), every
    tensor bit for bit."""
    src = hf_dir(tmp_path / "hf", model_type)
    run, out = tmp_path / "run", tmp_path / "out"
    ep = ["distributed.expert_parallel=2"] if model_type in ("qwen3_moe", "gpt_oss") else []
    proc = run_train(USER_PATH + ep + [f"checkpoint.init_from={src}", f"data.tokenizer={src}", "optimizer.lr=0",
                                       "schedule.min_lr=0", "train.max_steps=1", "train.eval_every=1",
                                       "train.eval_batches=1", f"train.run_dir={run}"], nproc=2, config=CONTINUE,
                     timeout=600)
    assert "from the Hugging Face model" in proc.stdout
    [record] = [r for r in read_metrics(run) if "eval/loss" in r]
    want = transformers_loss(src, run)
    assert record["eval/loss"] == pytest.approx(want, rel=5e-3), (record["eval/loss"], want)
    pretrain(["export", str(run / "checkpoints"), str(out)])
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    start, exported = hf_weights(src), hf_weights(out)
    assert sorted(exported) == sorted(start)
    for name in start:  # (a bf16 run's fp32 master weights start from the bf16 model: the source's bf16 values)
        assert torch.equal(exported[name], start[name].bfloat16().float()), name


def _ep2_as_one_rank(src: Path, tmp_path: Path, zero_stage: int) -> tuple[list[str], dict]:
    """From the HF folder `src`, fp32, 3 steps: 1 rank holding every expert (run `one`) and 2 ranks
    with expert_parallel=2 (run `ep2`), losses and gradient norms within 1e-6. Returns the runs'
    common overrides and `one`'s losses and norms."""
    common = [f"checkpoint.init_from={src}", f"data.tokenizer={src}", "data.seq_len=64", "train.global_batch_size=4",
              "train.max_steps=3", "train.precision=fp32", f"distributed.zero_stage={zero_stage}",
              "logging.wandb=disabled", "logging.log_every=1", "train.eval_every=0", "data.num_streams=2",
              "optimizer.lr=1e-3", "schedule.warmup_steps=1", "checkpoint.every=2"]
    run_train(common + ["train.micro_batch_size=4", f"train.run_dir={tmp_path / 'one'}"], config=CONTINUE)
    run_train(common + ["train.micro_batch_size=2", "distributed.expert_parallel=2", f"train.run_dir={tmp_path / 'ep2'}"],
              nproc=2, config=CONTINUE)
    want, got = losses_and_norms(tmp_path / "one"), losses_and_norms(tmp_path / "ep2")
    assert sorted(want) == [1, 2, 3] and want[3] != want[1]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, want, got)
    return common, want


def test_qwen3_moe_with_expert_parallelism_trains_as_one_rank(tmp_path):
    """From a Qwen3-MoE folder, fp32, ZeRO-3: 2 ranks with expert_parallel=2 (2 of the 4 experts each)
    repeat 1 rank holding every expert, losses and gradient norms within 1e-6 for 3 steps."""
    _ep2_as_one_rank(hf_dir(tmp_path / "hf", "qwen3_moe"), tmp_path, zero_stage=3)


@pytest.mark.parametrize("model_type,change,named", [
    ("gemma3_text", "model.query_scale_dim=32", "model.query_scale_dim=32 (config.json: 24)"),
    ("gemma3_text", "model.sliding_window=64", "model.sliding_window=64 (config.json: 128)"),
    ("gpt_oss", "model.swiglu_limit=5.0", "model.swiglu_limit=5.0 (config.json: 0.4)"),
    ("smollm3", "model.nope_period=4", "model.nope_period=4 (config.json: 2)"),
])
def test_a_run_config_that_disagrees_with_a_familys_config_json_is_one_line(model_type, change, named, tmp_path):
    """`pretrain train` from a family's folder with a model section that differs from its config.json
    in a field of the family: one line naming it, exit 2, no run dir."""
    src = hf_dir(tmp_path / "hf", model_type)
    proc = run_train([f"checkpoint.init_from={src}", f"data.tokenizer={src}", change, "train.max_steps=1",
                      f"train.run_dir={tmp_path / 'run'}"], config=CONTINUE, check=False, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("pretrain: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert named in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def test_gpt_oss_expert_biases_under_expert_parallelism_at_zero_2(tmp_path):
    """GPT-OSS's expert biases are expert parameters: at ZeRO-2 (experts in optimizer groups of their
    own, partitioned over the ranks that hold them) 2 ranks with expert_parallel=2 train as 1 rank
    holding every expert, within 1e-6 in fp32; their checkpoint exports to the same tensors and
    resumes on 1 rank, and 1 rank's resumes at expert_parallel=2 (the biases split with their experts)."""
    common, want = _ep2_as_one_rank(hf_dir(tmp_path / "hf", "gpt_oss"), tmp_path, zero_stage=2)
    step2 = "checkpoints/step_00000002"
    shutil.copytree(tmp_path / "ep2" / step2, tmp_path / "to_one" / step2)
    run_train(common + ["train.micro_batch_size=4", "checkpoint.resume=auto", f"train.run_dir={tmp_path / 'to_one'}"],
              config=CONTINUE)
    shutil.copytree(tmp_path / "one" / step2, tmp_path / "to_ep2" / step2)
    run_train(common + ["train.micro_batch_size=2", "distributed.expert_parallel=2", "checkpoint.resume=auto",
                        f"train.run_dir={tmp_path / 'to_ep2'}"], nproc=2, config=CONTINUE)
    for name in ("to_one", "to_ep2"):
        resumed = losses_and_norms(tmp_path / name)
        assert sorted(resumed) == [3] and resumed[3] == pytest.approx(want[3], rel=1e-6), (name, resumed, want)
    for name in ("one", "ep2"):
        pretrain(["export", str(tmp_path / name / "checkpoints"), str(tmp_path / f"{name}.hf")])
    one, ep2 = hf_weights(tmp_path / "one.hf"), hf_weights(tmp_path / "ep2.hf")
    assert one.keys() == ep2.keys() and "model.layers.0.mlp.experts.gate_up_proj_bias" in one
    for name in one:
        torch.testing.assert_close(ep2[name], one[name], rtol=1e-5, atol=1e-5, msg=name)
