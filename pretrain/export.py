"""Export a checkpoint to Hugging Face Llama format, and load checkpoints or exports for inference.

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

from pretrain.checkpoint import consolidated_state_dict, open_checkpoint
from pretrain.config import config_from_dict
from pretrain.errors import CheckpointError
from pretrain.model.hf import from_hf_config, from_hf_state_dict, to_hf_config, to_hf_state_dict
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


def export(checkpoint: str, out_dir: str) -> Path:
    """Write a Hugging Face Llama model + tokenizer for `checkpoint` (a step folder or a run's
    checkpoints folder) into out_dir."""
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast

    ckpt, _ = open_checkpoint(checkpoint)  # verified against its manifest before anything is read
    args, tokenizer, eot = _checkpoint_parts(ckpt)
    state = to_hf_state_dict(consolidated_state_dict(ckpt), args)
    if args.tie_embeddings:  # safetensors stores a tensor once; HF re-ties lm_head on load
        state.pop("lm_head.weight")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    hf_config = to_hf_config(args)
    hf_config.eos_token_id = hf_config.bos_token_id = eot
    hf_config.torch_dtype = "float32"
    hf_config.save_pretrained(out)
    eot_token = tokenizer.id_to_token(eot)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eot_token, bos_token=eot_token,
                            unk_token=eot_token).save_pretrained(out)
    print(f"exported {ckpt} -> {out}", flush=True)
    return out


def load_for_inference(path: str, device: str = "cpu"):
    """(model, tokenizer, eot id) from an export directory or a checkpoint."""
    import data_pipeline as dp

    p = Path(path)
    if (p / "config.json").is_file() and (p / "model.safetensors").is_file():
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        hf_config = LlamaConfig.from_pretrained(p)
        args = from_hf_config(hf_config)
        state = from_hf_state_dict(load_file(p / "model.safetensors"), args)
        tokenizer = dp.load_tokenizer(str(p / "tokenizer.json"))
        eot = hf_config.eos_token_id
    else:
        ckpt, _ = open_checkpoint(path)
        args, tokenizer, eot = _checkpoint_parts(ckpt)
        state = consolidated_state_dict(ckpt)
    model = Transformer(args)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval(), tokenizer, eot
