"""Hugging Face model directories as a starting point: the shape from `config.json`, the weights read
one tensor at a time from `model.safetensors` or sharded `model-0000x-of-0000y.safetensors` (with
`model.safetensors.index.json`), from a local directory or `hub:NAME` (downloaded once into the
huggingface_hub cache).

The families of pretrain/hf/mapping.py load (`model_type` llama, mistral without a sliding window,
mixtral, qwen2, qwen3, qwen3_moe, olmo2, olmo3, gemma3_text, gpt_oss, smollm3); what a family's config asks
for that the model lacks is refused by name. The config is read as JSON (through a transformers class
only for a window family's default `layer_types`), so a directory written by transformers 4.x
(`rope_theta`, `rope_scaling`) and one written by 5.x (`rope_parameters`) read the same.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from pretrain.errors import CheckpointError
from pretrain.hf.mapping import Part, from_hf_dict, from_hf_state_dict
from pretrain.model.args import ModelArgs

INDEX = "model.safetensors.index.json"


@functools.cache
def resolve(spec: str) -> Path:
    """The local directory of a model: as given, or downloaded from the hub (config, safetensors,
    tokenizer files only)."""
    if spec.startswith("hub:"):
        from huggingface_hub import snapshot_download

        name = spec.removeprefix("hub:")
        try:
            path = Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))
        except Exception as e:  # noqa: BLE001 - network, auth, unknown repo
            lines = str(e).strip().splitlines()
            raise CheckpointError(f"could not download the model {name!r} from the Hugging Face hub "
                                  f"({type(e).__name__}: {lines[0] if lines else ''}): check the name, the "
                                  "network and HF_TOKEN for gated models, or give a local directory") from None
    else:
        path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{spec} is not a Hugging Face model directory: it has no config.json")
    if not (path / "model.safetensors").is_file() and not (path / INDEX).is_file():
        raise CheckpointError(f"{path} has no model.safetensors or {INDEX}: only safetensors weights are "
                              "read (convert .bin files with transformers' save_pretrained)")
    return path


def model_args(path: Path) -> ModelArgs:
    """ModelArgs from the directory's config.json; CheckpointError naming what is not supported."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'} does not parse: {e}") from None
    try:
        return from_hf_dict(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


class LazyWeights:
    """Our parameter names -> tensors read on demand from the directory's safetensors files, so
    that no process holds more than one tensor of the model at a time."""

    def __init__(self, path: Path, args: ModelArgs):
        if (path / INDEX).is_file():
            where = json.loads((path / INDEX).read_text())["weight_map"]  # HF name -> file
        else:
            where = dict.fromkeys(self._keys(path / "model.safetensors"), "model.safetensors")
        missing = [f for f in set(where.values()) if not (path / f).is_file()]
        if missing:
            raise CheckpointError(f"{path} lacks the weight files {sorted(missing)[:3]} named in {INDEX}")
        for file in set(where.values()):  # a truncated or damaged file: named now, not at its first tensor
            self._keys(path / file)
        try:
            self.names = from_hf_state_dict({k: k for k in where}, args)  # ours -> HF name
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        self.path, self.where, self._open = path, where, {}

    @staticmethod
    def _keys(file: Path) -> list[str]:
        """The tensor names of a safetensors file, whose header and size are checked on opening."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(file, "pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file} is not a readable safetensors file ({e}): download it again") from None

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> torch.Tensor:
        hf = self.names[name]
        if isinstance(hf, list):  # a Mixtral's experts, one tensor each: our stacked tensor
            return torch.stack([self._file(self.where[h]).get_tensor(h) for h in hf])
        if isinstance(hf, Part):  # a view of one tensor (GPT-OSS's experts: gate and up interleaved)
            return hf.take(self._file(self.where[hf.source]).get_tensor(hf.source)).contiguous()
        return self._file(self.where[hf]).get_tensor(hf)

    def _file(self, file: str):
        from safetensors import safe_open

        if file not in self._open:
            self._open[file] = safe_open(self.path / file, "pt")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape, from the file's header (nothing read)."""
        hf = self.names[name]
        if isinstance(hf, list):
            return (len(hf), *self._file(self.where[hf[0]]).get_slice(hf[0]).get_shape())
        if isinstance(hf, Part):
            shape = self._file(self.where[hf.source]).get_slice(hf.source).get_shape()
            return tuple(hf.take(torch.empty(shape, device="meta")).shape)
        return tuple(self._file(self.where[hf]).get_slice(hf).get_shape())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: self[name] for name in self.names}
