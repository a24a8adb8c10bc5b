"""Sharded checkpoints that are atomic, verified, rotated, and resumable at another world size.

Layout of run_dir/checkpoints/:
    step_00000200/               one complete checkpoint (the name is only ever given to a complete one)
        mp_rank_00_model_states.pt, zero_pp_rank_R_mp_rank_00_{model,optim}_states.pt   DeepSpeed's shards
        meta.json                step, world size, trainer state, W&B run id, model shape, fingerprints
        data_state.json          the data pipeline position of every stream (world-size independent)
        rng_states.pt            torch RNG state of every rank
        config.yaml              the resolved run config
        tokenizer.json           the tokenizer, so a checkpoint exports and samples on its own
        manifest.json            size and sha256 of every file above, written last
    latest                       name of the newest complete checkpoint (DeepSpeed's tools read it)
    .universal/step_.../         DeepSpeed universal checkpoint, made when the world size changed

A save writes into `.partial_step_...`, and only after every rank has written and the manifest is
complete is it renamed to `step_...`: a process killed mid-save leaves a `.partial_` folder that
resume ignores and the next save removes. A good checkpoint is never overwritten in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from pretrain import distributed
from pretrain.errors import CheckpointError

STEP_DIR = re.compile(r"^step_(\d{8})$")
# Fields of the model shape that must match to load weights (init scale and presets may differ).
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "hidden_dim", "tie_embeddings")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if STEP_DIR.match(p.name) and (p / "manifest.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a user path: a step folder, or a checkpoints root / run dir (its latest)."""
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
        return json.loads((ckpt / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: meta.json unreadable ({e})") from None


def model_shape(args) -> dict:
    return {f: getattr(args, f) for f in SHAPE_FIELDS}


def check_shape(ckpt: Path, meta: dict, args) -> None:
    ours = model_shape(args)
    diff = [f"{k}: checkpoint {meta['model_shape'].get(k)} vs config {v}"
            for k, v in ours.items() if meta["model_shape"].get(k) != v]
    if diff:
        raise CheckpointError(f"checkpoint {ckpt} has another model shape ({'; '.join(diff)}): "
                              f"use the model config it was saved with")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _my_share(files: list[Path], rank: int, world: int) -> list[Path]:
    """Spread checksumming over ranks: each hashes every world-th file."""
    return files[rank::world]


class CheckpointManager:
    """Saves and restores everything a run needs, given the live objects (engine, data loader,
    trainer state); rank 0 writes the shared files, every rank writes its own shards."""

    def __init__(self, root: Path, cfg, env: distributed.Dist, run_config: dict, model_args,
                 fingerprint: dict, tokenizer_json: str):
        self.root, self.cfg, self.env = Path(root), cfg, env
        self.run_config, self.model_args, self.fingerprint = run_config, model_args, fingerprint
        self.tokenizer_json = tokenizer_json

    # ------------------------------------------------------------------ save
    def save(self, step: int, engine, loader, trainer_state: dict, wandb_id: str | None) -> Path:
        env, final = self.env, self.root / step_dir_name(step)
        partial = self.root / f".partial_{step_dir_name(step)}"
        if env.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        distributed.barrier()
        engine.save_checkpoint(str(self.root), tag=partial.name, save_latest=False)
        data_states = distributed.all_gather_objects(loader.state_dict())
        rng_states = distributed.all_gather_objects(torch.get_rng_state())
        if env.is_main:
            from data_pipeline import merge_states

            (partial / "data_state.json").write_text(json.dumps(merge_states(data_states)))
            torch.save(rng_states, partial / "rng_states.pt")
            import yaml

            (partial / "config.yaml").write_text(yaml.safe_dump(self.run_config, sort_keys=False))
            (partial / "tokenizer.json").write_text(self.tokenizer_json)
            meta = {"step": step, "world_size": env.world_size, "trainer": trainer_state,
                    "wandb_run_id": wandb_id, "model_shape": model_shape(self.model_args),
                    "fingerprint": self.fingerprint,
                    "zero_stage": self.run_config["distributed"]["zero_stage"], "format": 1}
            (partial / "meta.json").write_text(json.dumps(meta, indent=2))
        distributed.barrier()
        files = sorted(p for p in partial.rglob("*") if p.is_file())
        sums = {str(p.relative_to(partial)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                for p in _my_share(files, env.rank, env.world_size)}
        all_sums = distributed.all_gather_objects(sums)
        if env.is_main:
            manifest = {k: v for part in all_sums for k, v in part.items()}
            _write_atomic(partial / "manifest.json", json.dumps({"files": manifest}, indent=1))
            if final.exists():  # the same step saved before (e.g. after resuming from an older one)
                trash = self.root / f".trash_{final.name}"
                shutil.rmtree(trash, ignore_errors=True)
                final.rename(trash)
                partial.rename(final)
                shutil.rmtree(trash)
            else:
                partial.rename(final)
            _write_atomic(self.root / "latest", final.name)
            self._rotate()
        distributed.barrier()
        return final

    def _rotate(self) -> None:
        """Keep the newest keep_last complete checkpoints plus every keep_every-th step; remove
        leftovers of interrupted saves."""
        done = complete_checkpoints(self.root)
        keep = set(done[-self.cfg.keep_last:])
        if self.cfg.keep_every:
            keep |= {p for p in done if int(p.name[5:]) % self.cfg.keep_every == 0}
        for p in done:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.root.iterdir():
            if p.name.startswith((".partial_", ".trash_", ".universal")):
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------------ resume
    def resume_path(self) -> Path | None:
        """The checkpoint to resume from per checkpoint.resume, or None to start fresh."""
        resume = self.cfg.resume
        if resume == "none":
            return None
        if resume == "auto":
            found = complete_checkpoints(self.root)
            return found[-1] if found else None
        return resolve_checkpoint(resume)

    def verify(self, ckpt: Path) -> dict:
        """Check the manifest (presence, sizes, checksums spread over ranks) and the model shape;
        returns meta.json. Raises CheckpointError naming what is wrong, on every rank."""
        problem = None
        try:
            manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            manifest, problem = {}, f"checkpoint {ckpt}: manifest.json unreadable ({e})"
        names = sorted(manifest)
        for name in _my_share(names, self.env.rank, self.env.world_size):
            path, want = ckpt / name, manifest[name]
            if not path.is_file():
                problem = f"checkpoint {ckpt} is missing {name}"
            elif path.stat().st_size != want["size"]:
                problem = f"checkpoint {ckpt}: {name} has {path.stat().st_size} bytes, expected {want['size']} (truncated?)"
            elif _sha256(path) != want["sha256"]:
                problem = f"checkpoint {ckpt}: {name} fails its checksum (corrupt)"
            if problem:
                break
        problems = [p for p in distributed.all_gather_objects(problem) if p]
        if problems:
            raise CheckpointError(problems[0])
        meta = read_meta(ckpt)
        check_shape(ckpt, meta, self.model_args)
        return meta

    def check_resumable(self, ckpt: Path, meta: dict) -> None:
        """Loading shards and optimizer state needs the same ZeRO stage (shard layout). (Other data
        or another tokenizer is caught by the data position's own fingerprint check.)"""
        stage = self.run_config["distributed"]["zero_stage"]
        if meta.get("zero_stage", stage) != stage:
            raise CheckpointError(f"checkpoint {ckpt} was saved with ZeRO stage {meta['zero_stage']}, this run "
                                  f"uses {stage}: set distributed.zero_stage={meta['zero_stage']} to resume "
                                  f"(checkpoint.init_from loads its weights at any stage)")

    @staticmethod
    def load_data_position(ckpt: Path, loader) -> None:
        """Position the data loader; raises DataError if the data or tokenizer differ (unless forced)."""
        loader.load_state_dict(json.loads((ckpt / "data_state.json").read_text()))

    def universal_dir(self, ckpt: Path) -> Path:
        """Convert `ckpt` to DeepSpeed's universal format (rank 0; cached), for another world size."""
        out = self.root / ".universal" / ckpt.name
        if self.env.is_main and not (out / "done").is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt),
                   "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
                raise CheckpointError(f"could not convert {ckpt} for world size {self.env.world_size}: {tail}")
            (out / "done").write_text("ok")
        distributed.barrier()
        return out

    def load(self, ckpt: Path, meta: dict, engine, *, load_rng: bool = True,
             load_scheduler: bool = True) -> None:
        """Restore the engine (weights, optimizer, LR schedule) and, with load_rng, this rank's RNG.
        At another world size, through DeepSpeed's universal checkpoint (the engine must have been
        built with checkpoint.load_universal)."""
        load_dir, tag = ckpt.parent, ckpt.name
        universal = meta["world_size"] != self.env.world_size
        if universal:
            folder = self.universal_dir(ckpt)
            load_dir, tag = folder.parent, folder.name
        groups = engine.optimizer.param_groups
        hyper = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")} for g in groups]
        path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                         load_lr_scheduler_states=load_scheduler)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {ckpt}")
        if universal:
            # Two flaws of DeepSpeed's ZeRO-3 universal loader with several param groups: it copies
            # the first group's hyperparameters into every group (weight decay on norms and
            # embeddings), and it gives every group the SAME `step` tensor, which torch's AdamW then
            # increments once per group per step (wrong bias correction). Undo both.
            for group, saved in zip(groups, hyper):
                group.update(saved)
            for state in engine.optimizer.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        if not load_rng:
            return
        rng = torch.load(ckpt / "rng_states.pt", weights_only=True)
        if len(rng) == self.env.world_size:
            torch.set_rng_state(rng[self.env.rank])


def consolidated_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a sharded checkpoint saved at any world size, by DeepSpeed's own
    consolidation (the same code as its zero_to_fp32.py)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):  # it prints progress lines
        return get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)


def load_weights(model: torch.nn.Module, ckpt: Path, env: distributed.Dist, zero3: bool) -> None:
    """Copy a checkpoint's weights into a freshly built (possibly ZeRO-3 partitioned) model.
    Rank 0 consolidates and reads; the values reach the other ranks through the gather/broadcast."""
    state = consolidated_state_dict(ckpt) if env.is_main else {}
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in state] if env.is_main else []
    problem = distributed.broadcast_object(f"checkpoint {ckpt} lacks {missing[:3]}" if missing else None)
    if problem:
        raise CheckpointError(problem)
    import deepspeed
    import torch.distributed as dist

    for name, param in model.named_parameters():
        if zero3:
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if env.is_main:
                    param.data.copy_(state[name])
        else:
            if env.is_main:
                param.data.copy_(state[name])
            if env.world_size > 1:
                dist.broadcast(param.data, src=0)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
