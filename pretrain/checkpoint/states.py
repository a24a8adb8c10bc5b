"""The stateful pieces of a run that are not objects of their own: the data position of all ranks
and the RNG states. Like the Trainer, each has `state_dict()` (called on every rank; it may gather
across ranks and returns what rank 0 saves, JSON-able) and `load_state_dict()`."""

from __future__ import annotations

import base64

import torch

from pretrain.parallel import distributed


class DataPosition:
    """The data loaders of all ranks as one world-size-independent position (data_pipeline's merged
    state): saved at N ranks, it loads at any M dividing the consumed count."""

    def __init__(self, loader):
        self.loader = loader

    def state_dict(self) -> dict:
        from data_pipeline import merge_states

        return merge_states(distributed.all_gather_objects(self.loader.state_dict()))

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _decode(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


class RNGState:
    """torch's CPU (and current CUDA device's) RNG state of every rank. Restored only at the same
    world size: at another one there is no rank-to-rank correspondence, and the model has no
    dropout, so nothing depends on it beyond exact replay."""

    def __init__(self, env: distributed.Dist):
        self.env = env

    def _mine(self) -> dict:
        mine = {"cpu": _encode(torch.get_rng_state())}
        if self.env.device.type == "cuda":
            mine["cuda"] = _encode(torch.cuda.get_rng_state(self.env.device))
        return mine

    def state_dict(self) -> dict:
        return {"world_size": self.env.world_size, "ranks": distributed.all_gather_objects(self._mine())}

    def load_state_dict(self, state: dict) -> None:
        if state["world_size"] != self.env.world_size:
            return
        mine = state["ranks"][self.env.rank]
        torch.set_rng_state(_decode(mine["cpu"]))
        if "cuda" in mine and self.env.device.type == "cuda":
            torch.cuda.set_rng_state(_decode(mine["cuda"]), self.env.device)
