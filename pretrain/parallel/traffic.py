"""Bytes through this rank of every collective it takes part in, by kind and by whether the
collective's group spans more than one node: what `comm/*` metrics report for a logged step, and what
bench/bench_comm.py holds against `pretrain estimate`.

The count is a TorchDispatchMode over torch's c10d ops (torch.ops.c10d.*, as torch's own CommDebugMode
counts them): every torch.distributed collective, whoever calls it (DeepSpeed's ZeRO gathers and
reduce-scatters in its module hooks, our own in pretrain/parallel/distributed.py and pretrain/optim/muon.py), reaches
the dispatcher as one of these ops, so nothing is missed and nothing wrapped. DeepSpeed's comms logger
would see only the collectives that go through deepspeed.comm (not ours), and times each by
synchronizing the device. A dispatch mode is thread-local: it counts the thread that runs the step,
not the background checkpoint writer's collectives. Off, it costs nothing; on, a Python call per op of
the step (any op, not only collectives): a ZeRO-3 step of the tiny model on 2 CPU ranks took 1.3-1.5x
as long, hence logging.comm_bytes, off by default, and only the logged steps.

Convention, the same as pretrain/estimate/comm.py's: for a group of n
ranks, all-gather, reduce-scatter and all-to-all move (n-1)/n of the whole (gathered, unreduced,
exchanged) data through each rank, an all-reduce twice that; a broadcast, reduce, gather or scatter
the whole of its data; point-to-point the tensor. Groups of one rank move nothing.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.parallel.distributed import node_size

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def _size(tensors) -> int:
    """Bytes of a tensor or of a (nested) list of them."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_size(t) for t in tensors)


def _alltoall_sent(args, n: int, rank: int) -> float:
    """What an all_to_all_single sends to the other ranks (input less the slice it keeps)."""
    output, inp, group, out_splits, in_splits = args[:5]
    if not in_splits:
        return (n - 1) / n * _size(inp)
    per_row = math.prod(inp.shape[1:]) * inp.element_size()  # (a rank may send no rows: an empty input)
    return (sum(in_splits) - in_splits[rank]) * per_row


# c10d op -> (kind, bytes through each rank given (args, n, rank)). The ring factor is applied here.
_OPS = {
    "_allgather_base_": ("all_gather", lambda a, n, r: (n - 1) / n * _size(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a, n, r: (n - 1) / n * _size(a[0])),
    "allgather_": ("all_gather", lambda a, n, r: (n - 1) / n * _size(a[0])),
    "allgather_coalesced_": ("all_gather", lambda a, n, r: (n - 1) / n * _size(a[0])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a, n, r: (n - 1) / n * _size(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a, n, r: (n - 1) / n * _size(a[1])),
    "reduce_scatter_": ("reduce_scatter", lambda a, n, r: (n - 1) / n * _size(a[1])),
    "allreduce_": ("all_reduce", lambda a, n, r: 2 * (n - 1) / n * _size(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a, n, r: 2 * (n - 1) / n * _size(a[0])),
    "alltoall_base_": ("all_to_all", _alltoall_sent),
    "alltoall_": ("all_to_all", lambda a, n, r: (n - 1) / n * _size(a[1])),
    "broadcast_": ("broadcast", lambda a, n, r: _size(a[0])),
    "reduce_": ("reduce", lambda a, n, r: _size(a[0])),
    "gather_": ("gather", lambda a, n, r: _size(a[1])),
    "scatter_": ("scatter", lambda a, n, r: _size(a[0])),
    "send": ("send_recv", lambda a, n, r: _size(a[0])),
    "recv_": ("send_recv", lambda a, n, r: _size(a[0])),
}
_OPS = {getattr(torch.ops.c10d, name): spec for name, spec in _OPS.items()}


def local_world_size() -> int:
    """Ranks per node as the launcher says (pretrain.parallel.distributed.node_size: torchrun's
    LOCAL_WORLD_SIZE, the deepspeed launcher's LOCAL_SIZE, ...). Ranks r and s share a node when
    r // it == s // it, the launchers' consecutive numbering. Without it, one node. A test fakes two
    nodes by starting the ranks with LOCAL_WORLD_SIZE=1, as two launchers of one rank each would."""
    return node_size() or int(os.environ.get("WORLD_SIZE") or 1)


class Traffic(TorchDispatchMode):
    """Count the collectives of the code run under `with Traffic() as t:` (this thread only);
    `t.bytes` maps (kind, "intra" | "inter") to bytes through this rank, `t.metrics()` gives the
    logged form."""

    def __init__(self, per_node: int | None = None):
        """`per_node`: ranks per node (the trainer passes its Dist.local_size; else the launcher's)."""
        super().__init__()
        self.bytes: dict[tuple[str, str], float] = {}
        self._spans: dict[str, tuple[int, int, str]] = {}  # group name -> (size, this rank in it, where)
        self._per_node = per_node or local_world_size()

    def _group(self, boxed) -> tuple[int, int, str]:
        group = dist.ProcessGroup.unbox(boxed)
        if group.group_name not in self._spans:
            ranks = dist.get_process_group_ranks(group)
            where = "inter" if len({r // self._per_node for r in ranks}) > 1 else "intra"
            self._spans[group.group_name] = (len(ranks), group.rank(), where)
        return self._spans[group.group_name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        spec = _OPS.get(func._overloadpacket)
        if spec is not None:
            boxed = next(a for a in args if isinstance(a, torch.ScriptObject))
            n, rank, where = self._group(boxed)
            if n > 1:
                kind, through = spec
                self.bytes[kind, where] = self.bytes.get((kind, where), 0.0) + through(args, n, rank)
        return func(*args, **(kwargs or {}))

    def total(self) -> float:
        return sum(self.bytes.values())

    def metrics(self) -> dict:
        """{"comm/bytes_per_step": all, "comm/<kind>_<intra|inter>_bytes": ...}: the five main kinds
        always (0 where none ran), other kinds where they ran."""
        out = {"comm/bytes_per_step": self.total()}
        kinds = list(KINDS) + sorted({k for k, _ in self.bytes} - set(KINDS))
        for kind in kinds:
            for where in ("intra", "inter"):
                out[f"comm/{kind}_{where}_bytes"] = self.bytes.get((kind, where), 0.0)
        return out
