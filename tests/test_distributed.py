"""The layout and its collectives (pretrain/parallel/distributed.py): host values over the gloo group, device
tensors over the default one. (That no other module calls a collective: tests/test_imports.py.)"""

from pathlib import Path

import pytest
import torch

from pretrain.parallel import distributed

REPO = Path(__file__).resolve().parents[1]
def test_device_all_reduce_refuses_host_tensors_on_gpu_runs(monkeypatch):
    """On NCCL a host tensor crashes ("No backend type associated with device type cpu"): the
    device all-reduce refuses one wherever the default group's tensors live elsewhere."""
    monkeypatch.setattr(distributed, "_DEVICE_TYPE", "cuda")
    with pytest.raises(RuntimeError, match="takes cuda tensors"):
        distributed.all_reduce(torch.zeros(2))
    monkeypatch.setattr(distributed, "_DEVICE_TYPE", "cpu")
    assert torch.equal(distributed.all_reduce(torch.ones(2)), torch.ones(2))  # alone: unchanged
    assert distributed.host_sum([1.5, 2.0]) == [1.5, 2.0]


def test_local_rank_maps_onto_the_visible_gpus():
    assert [distributed._device_index(r, 8) for r in (0, 3, 7)] == [0, 3, 7]  # torchrun: all GPUs each
    assert distributed._device_index(3, 1) == 0  # srun --gpus-per-task=1: one GPU, index 0
    from pretrain.errors import ConfigError

    with pytest.raises(ConfigError, match="LOCAL_RANK=5 but this process sees 4 GPUs"):
        distributed._device_index(5, 4)


@pytest.mark.parametrize("launcher, environ, size", [
    ("torchrun, accelerate launch", {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}, 4),
    ("deepspeed launcher", {"LOCAL_SIZE": "4", "WORLD_SIZE": "8", "CROSS_SIZE": "2"}, 4),
    ("mpirun (Open MPI)", {"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "8"}, 4),
    ("none (a plain python)", {}, None),
])
def test_each_launchers_node_size(launcher, environ, size):
    """The ranks per node, read from the variable each launcher sets (a bare srun's are translated to
    LOCAL_WORLD_SIZE: tests/test_traffic.py). The deepspeed launcher sets LOCAL_SIZE only: read as
    "one node", hpZ was refused and every collective counted as in-node under it."""
    assert distributed.node_size(environ) == size


_NODE_SIZE = """
from pretrain.parallel import distributed
env = distributed.init("gloo")
print(f"NODE rank={env.rank} world={env.world_size} local_size={env.local_size}", flush=True)
distributed.shutdown()
"""


@pytest.mark.slow
def test_the_deepspeed_launcher_on_two_nodes(tmp_path):
    """DeepSpeed's per-node launcher (what `deepspeed --hostfile` starts on each node) run twice on
    this machine as two nodes of one rank each: every rank's Dist knows its node holds one rank."""
    import base64
    import json
    import subprocess
    import sys

    from helpers import free_port, train_env

    script = tmp_path / "node_size.py"
    script.write_text(_NODE_SIZE)
    info = base64.urlsafe_b64encode(json.dumps({"node0": [0], "node1": [0]}).encode()).decode()
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={info}",
                               f"--node_rank={n}", "--master_addr=127.0.0.1", f"--master_port={port}", str(script)],
                              cwd=REPO, env=train_env({"PYTHONPATH": str(REPO)}), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    lines = sorted(line for out, _ in outs for line in out.splitlines() if line.startswith("NODE "))
    assert lines == ["NODE rank=0 world=2 local_size=1", "NODE rank=1 world=2 local_size=1"]


def test_each_rank_compiles_into_its_own_cache(monkeypatch):
    """Each rank compiles into `rank<local rank>` under the cache directory: torch's default (which
    torch writes into the environment on first use, so a process that imported it passes it on to
    the ranks it starts), or one the user named (two runs' ranks sharing one crashed in CI). A
    process that already has its rank's directory (set by a parent that ran this) keeps one level."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    distributed.own_compile_cache(1)
    assert distributed.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(Path(default_cache_dir()) / "rank1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/mine")
    distributed.own_compile_cache(1)
    assert distributed.os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/mine/rank1"
    distributed.own_compile_cache(0)
    assert distributed.os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/mine/rank0"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    distributed.own_compile_cache(0)
    assert distributed.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(Path(default_cache_dir()) / "rank0")
