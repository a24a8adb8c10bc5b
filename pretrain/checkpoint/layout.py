"""What a checkpoint is on disk, and reading it: its folders, meta.json, the verification of its files.

Layout of run_dir/checkpoints/:
    step_00000200/           one complete checkpoint (the name is only ever given to a complete one)
        mp_rank_00_model_states.pt, zero_pp_rank_R_mp_rank_T_optim_states.pt   DeepSpeed's shards
                             (R: data-parallel rank, T: tensor-parallel rank)
        meta.json            format, step, run id, world size, data-, tensor- and sequence-parallel
                             sizes, model shape, ZeRO stage, optimizer, tokenizer fingerprint,
                             package version and git commit
        trainer_state.json   data_state.json   rng_state.json    one file per tracked state
        config.yaml          the resolved run config
        tokenizer.json       the tokenizer, so a checkpoint exports and samples on its own
        manifest.json        size and sha256 of every file above, written last
    latest                   name of the newest complete checkpoint (DeepSpeed's tools read it)
    set_aside/               checkpoints a resume did not use: corrupt ones, and ones newer than an
                             explicitly resumed older checkpoint (moved here, never deleted)
    .universal/step_.../     DeepSpeed universal checkpoint, made when the world size changed
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import yaml

from pretrain.checkpoint.rundir import sha256
from pretrain.errors import CheckpointError
from pretrain.model.args import RECIPE_FIELDS, ModelArgs


FORMAT = 2  # meta.json "format"; bump when the layout changes, and say what reads older ones


STEP_DIR = re.compile(r"^step_(\d{8})$")


# What each field of ModelArgs (pretrain/model/args.py) is to a checkpoint:
# - its shape (SHAPE_FIELDS, every load, resume or fine-tuning: the weights would not fit): dim, n_layers,
#   n_heads, n_kv_heads, vocab_size (and vocab_multiple_of, which only derives it), the SwiGLU width
#   (ffn_hidden_dim, multiple_of, ffn_dim_multiplier: as hidden_dim), tie_embeddings; an MoE's
#   moe_experts, moe_hidden_dim (as moe_expert_hidden_dim), moe_shared_experts and moe_dense_layers;
#   the blocks' weights: head_size (as head_dim), norm_placement, qk_norm, the biases and sinks;
# - its function (FUNCTION_FIELDS, a resume only; fine-tuning may change them): norm_eps, the RoPE
#   settings, document masking, and which experts a token reaches with what weights: moe_top_k,
#   moe_router, moe_norm_topk; the layers' kinds and RoPE (layer_pattern, sliding_window,
#   rope_local_theta, nope_period, rope_fraction), ffn_activation and embed_scale;
# - its multipliers (parametrization, mup_base_dim, mup_base_layers, mup_base_head_dim): meta.json's
#   model_parametrization, checked on every load (ModelArgs.parametrization_spec);
# - free on a resume: preset (a name; its values are the fields), max_seq_len (the RoPE table's length:
#   continue at a longer context), init_std (the init, which a resume does not run), mup_base_hidden_dim
#   (w2's init and learning-rate multiplier: a training setting, as optimizer.lr is), and an MoE's
#   balancing coefficients moe_aux_loss, moe_z_loss and moe_bias_rate, and the output z_loss: loss weights and a bias step
#   size, no weight and no forward (the bias itself is in the checkpoint), which torchtitan
#   (load_balance_coeff) and OLMo-core (lb_loss_weight, z_loss_weight) users tune between restarts.
# An MoE's own fields are recorded for MoE models only (model_shape); moe_experts, 0 = dense, always.
MOE_SHAPE_FIELDS = ("moe_experts", "moe_expert_hidden_dim", "moe_shared_experts", "moe_dense_layers")
MOE_FUNCTION_FIELDS = ("moe_top_k", "moe_router", "moe_norm_topk")

# The per-layer description's fields (docs/model.md): the weights it adds or removes are shape, the rest
# function. Checkpoints written before it existed are Llama blocks: read_meta fills these fields in
# with their defaults. z_loss, a loss weight, is free.
RECIPE_SHAPE_FIELDS = ("head_dim", "norm_placement", "qk_norm", "qkv_bias", "attn_out_bias", "attn_sinks",
                       "moe_router_bias", "moe_expert_bias")
RECIPE_FUNCTION_FIELDS = tuple(f for f in RECIPE_FIELDS if f != "head_size" and f not in RECIPE_SHAPE_FIELDS)

# Fields of the model shape that must match to load weights (init scale and presets may differ).
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "hidden_dim", "tie_embeddings") \
    + MOE_SHAPE_FIELDS + RECIPE_SHAPE_FIELDS


# Fields that change what the model computes, not its shapes: a resume must keep them (it continues
# one run); fine-tuning may change them (a larger rope_theta to extend the context, say).
FUNCTION_FIELDS = ("norm_eps", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                   "rope_original_max_seq_len", "rope_scaling_type", "rope_yarn_beta_fast", "rope_yarn_beta_slow",
                   "rope_yarn_truncate", "rope_yarn_attention_factor", "rope_local_scaling", "document_mask",
                   "document_positions", "eot_id") \
    + MOE_FUNCTION_FIELDS + RECIPE_FUNCTION_FIELDS


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_folders(root: Path) -> list[Path]:
    """Every `step_XXXXXXXX` folder under `root`, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_DIR.match(p.name) and p.is_dir()), key=lambda p: p.name)


def complete_checkpoints(root: Path) -> list[Path]:
    """Step folders with a manifest under `root`, oldest first (not verified)."""
    return [p for p in step_folders(root) if (p / "manifest.json").is_file()]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a user path: a step folder, or a checkpoints root / run dir (its
    newest complete checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / "manifest.json").is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    if path.name.startswith(".partial_") or STEP_DIR.match(path.name):
        raise CheckpointError(f"checkpoint {path} is incomplete (no manifest.json: the save was interrupted); "
                              f"use an earlier one")
    raise CheckpointError(f"no complete checkpoint in {path}")


def read_meta(ckpt: Path) -> dict:
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: meta.json unreadable ({e})") from None
    fmt = meta.get("format", 1)
    if not isinstance(fmt, int) or fmt > FORMAT:
        raise CheckpointError(f"checkpoint {ckpt} has format {fmt}, newer than this pretrain reads ({FORMAT}): "
                              "upgrade pretrain")
    if isinstance(meta.get("model_shape"), dict) and "moe_experts" not in meta["model_shape"]:
        _fill_moe_fields(ckpt, meta)
    if isinstance(meta.get("model_shape"), dict):  # (the fields a checkpoint predates are Llama's)
        _fill_recipe_fields(meta)
    return meta


def _fill_recipe_fields(meta: dict) -> None:
    """The per-layer fields a checkpoint's meta.json predates (all of them, or those added since): a
    Llama block's."""
    shape = meta["model_shape"]
    llama = ModelArgs(dim=shape.get("dim", 256), n_heads=shape.get("n_heads", 4))
    meta["model_shape"] = {**model_shape(llama, RECIPE_SHAPE_FIELDS), **shape}
    if isinstance(meta.get("model_function"), dict):
        meta["model_function"] = {**model_shape(llama, RECIPE_FUNCTION_FIELDS), **meta["model_function"]}


def _fill_moe_fields(ckpt: Path, meta: dict) -> None:
    """A checkpoint written before meta.json recorded an MoE's fields: they are its config.yaml's
    (the model as built, pretrain/train.py), a dense model's where that has none (written before
    MoE existed), so that it resumes as before and is checked as a new one is."""
    try:
        model = (yaml.safe_load((ckpt / "config.yaml").read_text()) or {}).get("model")
    except (OSError, yaml.YAMLError, AttributeError):
        model = None
    names = {f.name for f in dataclasses.fields(ModelArgs)}
    args = ModelArgs(**{k: v for k, v in model.items() if k in names}) if isinstance(model, dict) else ModelArgs()
    meta["model_shape"] = {**model_shape(args, MOE_SHAPE_FIELDS), **meta["model_shape"]}
    if isinstance(meta.get("model_function"), dict):
        meta["model_function"] = {**model_shape(args, MOE_FUNCTION_FIELDS), **meta["model_function"]}


def model_shape(args, fields=SHAPE_FIELDS) -> dict:
    """`fields` of ModelArgs `args`; an MoE's own (all but moe_experts) only where it is one."""
    return {f: getattr(args, f) for f in fields
            if args.moe_experts or f not in MOE_SHAPE_FIELDS + MOE_FUNCTION_FIELDS or f == "moe_experts"}


def _my_share(items: list, rank: int, world: int) -> list:
    """Spread checksumming over ranks: each takes every world-th item."""
    return items[rank::world]


def check_files(ckpt: Path, rank: int = 0, world: int = 1) -> str | None:
    """The first problem with this rank's share of the manifest's files, or None."""
    try:
        manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    except FileNotFoundError:
        return f"checkpoint {ckpt} has no manifest.json (an interrupted save, or files removed by hand)"
    except (OSError, json.JSONDecodeError, KeyError) as e:
        return f"checkpoint {ckpt}: manifest.json unreadable ({e})"
    for name in _my_share(sorted(manifest), rank, world):
        path, want = ckpt / name, manifest[name]
        if not path.is_file():
            return f"checkpoint {ckpt} is missing {name}"
        if path.stat().st_size != want["size"]:
            return f"checkpoint {ckpt}: {name} has {path.stat().st_size} bytes, expected {want['size']} (truncated?)"
        if sha256(path) != want["sha256"]:
            return f"checkpoint {ckpt}: {name} fails its checksum (corrupt)"
    return None


def open_checkpoint(path: str | Path) -> tuple[Path, dict]:
    """(checkpoint folder, meta) for a reader in one process (export, generate, eval): resolved from
    a user path and verified against its manifest first. Raises CheckpointError naming the problem."""
    ckpt = resolve_checkpoint(path)
    problem = check_files(ckpt)
    if problem:
        raise CheckpointError(problem)
    return ckpt, read_meta(ckpt)
