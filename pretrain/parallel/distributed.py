"""Process-group set-up from the launcher's environment, and the one owner of collectives.

torchrun, accelerate launch, the deepspeed launcher and srun all set RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT; a bare `srun` sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, which we translate.

Every collective of ours goes through this module (tests/test_imports.py fails on a
`torch.distributed` collective called anywhere else), because NCCL takes device tensors only: host
values (flags, counts, sums, objects, signals, barriers) go over a gloo group, device tensors over
the default group. On CPU both are gloo, so a host tensor sent over the default group would pass
every CPU test and crash on the first multi-GPU run; `all_reduce` refuses one on any machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain.errors import collective


@dataclass
class Dist:
    """This process's place in the run. The parallel layout: world = data-parallel x model-parallel,
    the model-parallel ranks being either a sequence-parallel group (`sp`, distributed.
    sequence_parallel: each rank holds T/sp tokens of the group's sequences) or a tensor-parallel
    group (`tp`, distributed.tensor_parallel: each rank holds 1/tp of every block's matrices), of
    consecutive ranks (one node's GPUs, where their all-to-alls and all-reduces are cheapest). The
    ranks of a group read the same sequences: data (the loader, batch sizes, the data position) is
    per data-parallel rank. ZeRO shards over every rank under sequence parallelism and over the
    data-parallel ranks of each tensor-parallel slice under tensor parallelism. Expert parallelism
    (`ep`) is orthogonal to the data: each group of ep consecutive ranks shares out a Mixture-of-
    Experts' experts, every rank routing its own tokens to them; ZeRO-3 partitions an expert's
    weights over the ranks that hold it (its expert-data-parallel group, every ep-th rank)."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    sp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism (distributed.expert_parallel): groups of ep consecutive ranks share out the experts
    local_size: int = 1  # ranks on this node (node_size(): as the launcher says)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def group_size(self) -> int:
        """The consecutive ranks that read the same sequences."""
        return self.sp * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the groups that read different sequences."""
        return self.world_size // self.group_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.group_size

    @property
    def sp_rank(self) -> int:
        """This rank's slice of its group's sequences: tokens [sp_rank * T/sp, (sp_rank + 1) * T/sp)."""
        return self.rank % self.sp


def _env_from_slurm() -> None:
    """Fill the torchrun variables from SLURM_* when srun launched us directly (one task per GPU)."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or int(os.environ.get("SLURM_NTASKS", 1)) < 2:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    # Tasks on this node (hpZ's node size, pretrain/parallel/traffic.py's nodes): SLURM_TASKS_PER_NODE reads "8(x32)" or "8,4" (the first node first).
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get("SLURM_TASKS_PER_NODE", "").split("(")[0].split(",")[0]
    if per_node.isdigit():
        os.environ.setdefault("LOCAL_WORLD_SIZE", per_node)
    if "MASTER_ADDR" not in os.environ:
        import subprocess

        nodes = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()
        os.environ["MASTER_ADDR"] = nodes[0]
    # The same rule as slurm/env.sh: two jobs sharing a node never share a rendezvous port (each
    # job owns a block of 16: its first start's and its restarts').
    os.environ.setdefault("MASTER_PORT", str(15000 + int(os.environ.get("SLURM_JOB_ID", 0)) % (15000 // 16) * 16))


# Ranks per node, by launcher: torchrun and accelerate (and a bare srun, translated above) set
# LOCAL_WORLD_SIZE, the deepspeed launcher (and its MPI runners) LOCAL_SIZE, Open MPI's mpirun
# OMPI_COMM_WORLD_LOCAL_SIZE. The first one set wins.
NODE_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def node_size(environ=None) -> int | None:
    """The ranks on this node as the launcher set them (NODE_SIZE_VARS), None if it said nothing.
    Nodes hold consecutive ranks (every launcher numbers them so)."""
    environ = os.environ if environ is None else environ
    for var in NODE_SIZE_VARS:
        value = environ.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def _device_index(local_rank: int, visible: int) -> int:
    """This rank's GPU among the visible ones. A launcher that gives each process all of a node's GPUs
    (torchrun, srun --gpus-per-node) numbers them by LOCAL_RANK; `srun --gpus-per-task=1` shows each
    task one GPU, index 0, while LOCAL_RANK (SLURM_LOCALID) still counts 0..n-1."""
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    from pretrain.errors import ConfigError

    raise ConfigError(f"LOCAL_RANK={local_rank} but this process sees {visible} GPUs "
                      f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give each "
                      "process all of the node's GPUs or exactly one")


def init(backend: str = "auto", timeout_s: float = 1800.0) -> Dist:
    """Join (or, alone, create) the process group with `backend` (distributed.backend: auto = nccl
    on CUDA, gloo on CPU) and pick this rank's device. A collective of any group that waits
    `timeout_s` for a peer fails (distributed.timeout_s)."""
    if backend == "nccl" and not torch.cuda.is_available():
        from pretrain.errors import ConfigError

        raise ConfigError("distributed.backend=nccl needs CUDA GPUs and this machine has none: use auto or gloo")
    _env_from_slurm()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", _device_index(local_rank, torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        keep_freed_memory()
        # DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce at init (a minute or
        # more on a small machine) that only inference uses; marking it incompatible skips the build.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    own_compile_cache(local_rank)
    if "RANK" not in os.environ:  # a plain `python -m pretrain train`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
    import deepspeed

    if device.type == "cpu":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)
    global _CPU_GROUP, _CHECKPOINT_GROUP
    global _DEVICE_TYPE, _TIMEOUT
    _DEVICE_TYPE, _TIMEOUT = device.type, timeout
    if dist.get_world_size() > 1:
        # Host-to-host agreement (stop signals) without touching a GPU: a gloo group beside nccl.
        _CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        # The background checkpoint thread's own group: never interleaved with training collectives.
        _CHECKPOINT_GROUP = dist.new_group(backend="gloo", timeout=timeout)
    local_size = node_size() or dist.get_world_size()
    if device.type == "cpu":
        # DeepSpeed's CPU accelerator counts its devices by running `numactl --hardware` in a new
        # process unless LOCAL_SIZE says how many there are, and ZeRO-3 asks at every gradient
        # reduce-scatter (~10 ms each, most of a tiny model's step): told here, as a GPU node's count.
        os.environ.setdefault("LOCAL_SIZE", str(local_size))
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, local_size=local_size)


_CPU_GROUP = _CHECKPOINT_GROUP = None
_DEVICE_TYPE = "cpu"  # the device type of the default group's tensors
_TIMEOUT = None
_SEQUENCE_GROUP = _DATA_GROUP = _TENSOR_GROUP = None
_EXPERT_GROUP = _EXPERT_DATA_GROUP = None


def init_layout(env: Dist, sequence_parallel: int, tensor_parallel: int, hpz: bool = False,
                expert_parallel: int = 1) -> Dist:
    """The parallel layout (config checks that it divides the world; at most one of the two is > 1):
    `env` with its sequence- or tensor-parallel size, and the groups of `size` consecutive ranks.
    With `hpz` (ZeRO++'s secondary weight partition within each node: DeepSpeed builds its groups of
    env.local_size consecutive ranks from the config, pretrain/parallel/parallelize.py) the world must span
    several nodes of equal size.

    Sequence-parallel groups are ours, on the default backend (NCCL on GPUs: the all-to-all moves
    device tensors); ZeRO and DeepSpeed see every rank as a data-parallel one (pretrain/parallel/parallelize.py).
    Tensor-parallel groups are DeepSpeed's (its AutoTP and ZeRO read them from deepspeed.utils.groups):
    a (data-parallel, tensor-parallel) mesh whose tensor-parallel ranks are consecutive, made here so
    that the layout has one owner and ZeRO-3's zero.Init, before the engine, shards over the
    data-parallel ranks; checked against the data's layout (Dist.dp_rank).

    Expert-parallel groups (`expert_parallel` > 1) are DeepSpeed's too (ZeRO-3 reads a parameter's
    partition group, and the group it sums an expert's gradient norm over, from deepspeed.utils.groups
    by the parameter's group name, expert_group_name()): ep consecutive ranks share out the experts,
    and each expert is partitioned over the ranks that hold it, every ep-th one."""
    global _SEQUENCE_GROUP, _DATA_GROUP, _TENSOR_GROUP
    if expert_parallel > 1:
        env = _init_experts(env, expert_parallel)
    if hpz and (env.local_size >= env.world_size or env.world_size % env.local_size):
        from pretrain.errors import ConfigError

        raise ConfigError(f"distributed.hpz=true keeps ZeRO-3's gathers inside each node, but this run's "
                          f"{env.world_size} ranks are on {'one node' if env.local_size >= env.world_size else 'nodes of unequal size'} "
                          f"({env.local_size} on this one): set distributed.hpz=false")
    if tensor_parallel > 1:
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=tensor_parallel)
        tp_ranks = dist.get_process_group_ranks(groups.get_tensor_model_parallel_group())
        first = env.rank - env.rank % tensor_parallel
        if tp_ranks != list(range(first, first + tensor_parallel)):
            raise RuntimeError(f"DeepSpeed's tensor-parallel group of rank {env.rank} is {tp_ranks}, not the "
                               f"consecutive ranks the data layout assumes")
        _DATA_GROUP = groups.get_data_parallel_group()
        _TENSOR_GROUP = groups.get_tensor_model_parallel_group()
        return dataclasses.replace(env, tp=tensor_parallel)
    size = sequence_parallel
    if size <= 1 or _SEQUENCE_GROUP is not None:
        return dataclasses.replace(env, sp=max(size, 1))
    for first in range(0, env.world_size, size):  # every rank creates every group, in the same order
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks, timeout=_TIMEOUT)
        if env.rank in ranks:
            _SEQUENCE_GROUP = group
    return dataclasses.replace(env, sp=size)


def expert_group_name(size: int) -> str:
    """DeepSpeed's name of the expert-parallel groups of `size` ranks (deepspeed.utils.groups)."""
    return f"ep_size_{size}"


def _init_experts(env: Dist, size: int) -> Dist:
    global _EXPERT_GROUP, _EXPERT_DATA_GROUP
    from deepspeed.utils import groups

    name = expert_group_name(size)
    if name not in groups._EXPERT_PARALLEL_GROUP:
        groups._create_expert_and_data_parallel(size, mp_size=1, pp_size=1)
    _EXPERT_GROUP, _EXPERT_DATA_GROUP = groups._get_expert_parallel_group(name), groups._get_expert_data_parallel_group(name)
    first = env.rank - env.rank % size
    ranks = dist.get_process_group_ranks(_EXPERT_GROUP)
    if ranks != list(range(first, first + size)) or dist.get_process_group_ranks(_EXPERT_DATA_GROUP) != list(
            range(env.rank % size, env.world_size, size)):
        raise RuntimeError(f"DeepSpeed's expert-parallel group of rank {env.rank} is {ranks}, not the consecutive "
                           "ranks this layout assumes")
    return dataclasses.replace(env, ep=size)


def expert_group():
    """This rank's expert-parallel group (the ranks its tokens travel among; None without)."""
    return _EXPERT_GROUP


def expert_data_group():
    """The ranks that hold this rank's experts, over which ZeRO-3 partitions them (None without)."""
    return _EXPERT_DATA_GROUP


def data_parallel_group():
    """The ranks ZeRO shards over and averages gradients across: DeepSpeed's data-parallel group
    under tensor parallelism, else None (the world)."""
    return _DATA_GROUP


def tensor_group():
    """This rank's tensor-parallel group (DeepSpeed's; None without tensor parallelism)."""
    return _TENSOR_GROUP


def sequence_group():
    """This rank's sequence-parallel group (None without sequence parallelism)."""
    return _SEQUENCE_GROUP


def cpu_group():
    """A process group for CPU tensors: a gloo group when the default one is nccl, else the default."""
    return _CPU_GROUP


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Sum (or max) a tensor on this rank's device over all ranks (or those of `group`, a group of
    the default backend), in place (NCCL on GPUs): for values that are already on the device
    (losses, eval sums, norms), read later."""
    if tensor.device.type != _DEVICE_TYPE:
        raise RuntimeError(f"distributed.all_reduce takes {_DEVICE_TYPE} tensors, got one on {tensor.device}: "
                           "send host values with host_sum/agree_max")
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Rank `src`'s (its rank within `group`, a group of the default backend) values into `tensor`,
    a tensor on this rank's device, in place; called by the members of `group` only."""
    if tensor.device.type != _DEVICE_TYPE:
        raise RuntimeError(f"distributed.broadcast takes {_DEVICE_TYPE} tensors, got one on {tensor.device}: "
                           "send host values with broadcast_host")
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    return tensor


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group=None) -> torch.Tensor:
    """Exchange rows (dim 0) over the ranks of `group` (a group of the default backend): `input_splits[r]`
    rows of `input` go to rank r, `output_splits[r]` rows from rank r fill `output`; tensors on this
    rank's device (at one rank a copy)."""
    if input.device.type != _DEVICE_TYPE or output.device.type != _DEVICE_TYPE:
        raise RuntimeError(f"distributed.all_to_all takes {_DEVICE_TYPE} tensors, got {input.device} and {output.device}")
    dist.all_to_all_single(output, input, output_splits, input_splits, group=group)
    return output


def host_sum(values: list[float]) -> list[float]:
    """Element-wise float64 sum over all ranks, host to host (the CPU group)."""
    sums = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums, group=cpu_group())
    return sums.tolist()


def broadcast_host(tensor: torch.Tensor, src: int = 0) -> None:
    """Rank `src`'s values into `tensor` (a host tensor) on every rank, over the CPU group."""
    if tensor.device.type != "cpu":
        raise RuntimeError(f"distributed.broadcast_host takes host tensors, got one on {tensor.device}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(tensor, src=src, group=cpu_group())


def agree_max(values: list[int]) -> list[int]:
    """Element-wise maximum of small integers over all ranks, host to host (the CPU group): it never
    waits for a GPU, so the trainer can ask after every step."""
    return _host_all_reduce(values, dist.ReduceOp.MAX)


def sum_over_ranks(values: list[int]) -> list[int]:
    """Element-wise sum of integers over all ranks, host to host (the CPU group)."""
    return _host_all_reduce(values, dist.ReduceOp.SUM)


def _host_all_reduce(values: list[int], op) -> list[int]:
    flags = torch.tensor(values, dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=op, group=cpu_group())
    return flags.tolist()


def checkpoint_group():
    """The group of the background checkpoint writers (gloo; None alone)."""
    return _CHECKPOINT_GROUP


def keep_freed_memory() -> None:
    """CPU training allocates and frees the same large tensors every step. glibc serves large
    allocations with mmap and returns freed memory to the OS, so every step pays page faults again;
    keeping freed memory in the process (no mmap, no trim) made forward+backward of the tiny model
    1.4x faster on 2 cores (docs/performance.md). The process keeps its peak memory instead. glibc
    only; a no-op elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 2**31 - 1)  # a logits tensor is over glibc's 32 MiB dynamic cap
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


def own_compile_cache(local_rank: int) -> None:
    """Give each rank of a node its own inductor cache directory: `rank<local_rank>` under the one the
    user named in TORCHINDUCTOR_CACHE_DIR, else under torch's default /tmp/torchinductor_<user>.
    The ranks of a run compile the same graphs at the same moment, and a rank that loads a compiled
    kernel another rank is still writing can crash (CI: a SIGSEGV in one of two ranks during the
    first compiled backward; pytorch#92664, #153791 report such races), and a directory the user
    names is no safer than the default. Per rank, later runs still reuse the cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # (torch writes its default there on first use, and a launcher that imported it passes that on;
    # a process this ran in already, or a parent that did, passes its rank's directory on)
    base = os.path.normpath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())
    if re.fullmatch(r"rank\d+", os.path.basename(base)):
        base = os.path.dirname(base)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"rank{local_rank}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_gather_objects(obj, group=None) -> list:
    """Every rank's `obj`, in rank order (a list of one outside a process group); over `group`, by
    default the CPU group."""
    group = group or cpu_group()
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0, group=None):
    """Rank `src`'s `obj` (`src` is the rank within `group`, by default the CPU group)."""
    group = group or cpu_group()
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, src) if group else src, group=group)
    return box[0]


class PeerFailed(Exception):
    """Raised on the ranks that did not fail when another rank did, so that no rank waits alone in
    a collective. Never printed: the failing rank prints its own error."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def agree(fn, *args, **kwargs):
    """Run `fn` on every rank; if it raised on any rank, raise on all of them. A rank's own error is
    re-raised (marked `collective` when every rank failed with the same message, so the CLI prints
    it once); the other ranks raise PeerFailed. For the steps every rank runs identically (config,
    data, checkpoint checks), where a rank that failed alone would leave the others hanging."""
    error = None
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        error = e
    described = None if error is None else (str(error), getattr(error, "exit_code", 1))
    everyone = all_gather_objects(described)
    failed = [d for d in everyone if d is not None]
    if not failed:
        return result
    if error is None:
        message, code = failed[0]
        raise PeerFailed(f"another rank failed: {message}", code)
    if len(failed) == len(everyone) and len({m for m, _ in failed}) == 1:
        raise collective(error)
    raise error


def on_main(fn, *args, **kwargs):
    """Run `fn` on rank 0 only (file-system work on a shared run dir) and return its result on every
    rank. An error raised there is raised on every rank, marked `collective` (printed once)."""
    result, error = None, None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        try:
            result, error = broadcast_object((result, error))
        except Exception:  # an exception that does not pickle: the others still must stop
            result, error = broadcast_object((result, PeerFailed(f"rank 0 failed: {error}", 1) if error else None))
    if error is not None:
        raise collective(error)
    return result


def side_store(prefix: str, timeout_s: float):
    """A connection of this process's own to the process group's rendezvous store (a TCPStore),
    under `prefix`, for a thread that must not share the main thread's connection nor wait on it
    (the watchdog's hang report): each operation fails after `timeout_s`. None without a TCP store."""
    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    while store is not None and hasattr(store, "underlying_store"):  # (torchrun nests PrefixStores)
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    client = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(prefix, client)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=cpu_group())


def shutdown() -> None:
    global _SEQUENCE_GROUP, _DATA_GROUP, _TENSOR_GROUP, _EXPERT_GROUP, _EXPERT_DATA_GROUP
    _SEQUENCE_GROUP = _DATA_GROUP = _TENSOR_GROUP = _EXPERT_GROUP = _EXPERT_DATA_GROUP = None
    import sys

    if "deepspeed.utils.groups" in sys.modules:  # (its expert groups belong to this process group)
        groups = sys.modules["deepspeed.utils.groups"]
        for table in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                      groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):
            table.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
