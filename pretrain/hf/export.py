"""Export a checkpoint to Hugging Face format, as the family that holds its model (Llama, Qwen2,
Qwen3, Qwen3-MoE, OLMo 2 and 3, Gemma 3, GPT-OSS, SmolLM3 or Mixtral: pretrain/hf/mapping.py), and load
checkpoints or exports for inference.

An export holds `model.safetensors` (consolidated fp32 weights), `config.json` and the tokenizer
(`tokenizer.json` + `tokenizer_config.json`): `AutoModelForCausalLM.from_pretrained(OUT_DIR)` and
`AutoTokenizer.from_pretrained(OUT_DIR)` load it offline. Nothing here unpickles more than it must:
DeepSpeed's shards are pickles (read by DeepSpeed's consolidation, so only load checkpoints you
trust); exports are safetensors and JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from pretrain.checkpoint.layout import open_checkpoint
from pretrain.checkpoint.reshard import persistent_buffers
from pretrain.checkpoint.weights import consolidated_state_dict
from pretrain.config import config_from_dict, is_hf_model
from pretrain.errors import CheckpointError, ConfigError
from pretrain.hf.mapping import (family_of, fold_multipliers, moe_problems, rope_scaling, to_hf_config,
                                 to_hf_state_dict)
from pretrain.model.model import Transformer


def _checkpoint_parts(ckpt: Path):
    """(model args, tokenizer, eot id) of a checkpoint, from the files saved inside it."""
    import data_pipeline as dp

    cfg = config_from_dict(yaml.safe_load((ckpt / "config.yaml").read_text()))
    tok_file = ckpt / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(f"checkpoint {ckpt} has no tokenizer.json")
    tokenizer = dp.load_tokenizer(str(tok_file))
    return cfg.model, tokenizer, dp.eot_id(tokenizer, cfg.data.eot_token)


DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}


def export(checkpoint: str, out_dir: str, dtype: str = "fp32") -> Path:
    """Write a Hugging Face model + tokenizer for `checkpoint` (a step folder or a run's checkpoints
    folder) into out_dir, in fp32 or bf16, as the family that holds the model (config.json's
    model_type and architectures); transformers 4.4x and 5.x both read it. ConfigError, before
    anything is written, naming what no family holds."""
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    torch_dtype, dtype_name = DTYPES[dtype]
    ckpt, _ = open_checkpoint(checkpoint)  # verified against its manifest before anything is read
    args, tokenizer, eot = _checkpoint_parts(ckpt)
    try:  # the family that holds the model: one line naming what none holds
        family = family_of(args)
    except ValueError as e:
        raise ConfigError(f"{ckpt}: {e}; `pretrain eval` and `generate` read the checkpoint") from None
    state = consolidated_state_dict(ckpt)
    if args.moe_experts:  # an MoE family, if it holds the model: one line naming what it does not hold
        biased = [n for n, t in state.items() if n.endswith("expert_bias") and t.any()]
        problems = moe_problems(args, family) + ([f"its routers' bias (model.moe_bias_rate={args.moe_bias_rate}) "
                                                  f"selects experts, which {family.name}'s router cannot"] if biased else [])
        if problems:
            raise ConfigError(f"{ckpt}: this Mixture-of-Experts model is not a Hugging Face {family.name}: "
                              + "; ".join(problems) + "; `pretrain eval` and `generate` read the checkpoint")
    state, args = fold_multipliers(state, args)  # muP: into the weights, in fp32
    state = to_hf_state_dict({k: v.to(torch_dtype) for k, v in state.items()}, args)
    if args.tie_embeddings:  # safetensors stores a tensor once; HF re-ties lm_head on load
        state.pop("lm_head.weight")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    hf_config = to_hf_config(args)
    hf_config.eos_token_id = hf_config.bos_token_id = eot
    hf_config.save_pretrained(out)
    # transformers 5 writes the RoPE settings only inside `rope_parameters`; 4.x reads only the top-level
    # `rope_theta` and `rope_scaling` (without them it silently uses theta 10000). Write both.
    config = json.loads((out / "config.json").read_text())
    config.update(rope_theta=args.rope_theta, rope_scaling=rope_scaling(args), torch_dtype=dtype_name)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    eot_token = tokenizer.id_to_token(eot)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eot_token, bos_token=eot_token,
                            unk_token=eot_token).save_pretrained(out)
    # 5.x names its class TokenizersBackend, which 4.x does not know; both load this one.
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config.pop("backend", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    print(f"exported {ckpt} -> {out}", flush=True)
    return out


def load_for_inference(path: str, device: str = "cpu", verified: bool = False):
    """(model, tokenizer, eot id) from a Hugging Face model directory (an export, or any supported
    model: pretrain/hf/hub.py), `hub:NAME`, or a checkpoint (verified first unless `verified`)."""
    import data_pipeline as dp
    from pretrain.hf import hub

    if is_hf_model(path):
        p = hub.resolve(str(path))
        args = hub.model_args(p)
        state = hub.LazyWeights(p, args).state_dict()
        tokenizer = dp.load_tokenizer(str(p))
        eot = json.loads((p / "config.json").read_text()).get("eos_token_id")
        if isinstance(eot, list):
            eot = eot[0]
    else:
        ckpt = Path(path) if verified else open_checkpoint(path)[0]
        args, tokenizer, eot = _checkpoint_parts(ckpt)
        state = consolidated_state_dict(ckpt)
    if tokenizer.get_vocab_size() > args.vocab_size:  # its ids past the embedding would crash it (on a GPU, an assert)
        raise ConfigError(f"{path}: its tokenizer has {tokenizer.get_vocab_size()} tokens, more than the model's "
                          f"vocabulary ({args.vocab_size}): the tokenizer is not this model's")
    model = Transformer(args)
    state = {k: v.float() for k, v in state.items()}
    for name, buffer in persistent_buffers(model):  # (a Mixtral's routers have no bias: ours stays 0)
        state.setdefault(name, buffer)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval(), tokenizer, eot
