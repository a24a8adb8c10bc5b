"""The test cluster itself (tests/slurm/conftest.py)."""

import pytest

pytestmark = pytest.mark.slow


def test_cluster_has_two_idle_nodes(slurm_cluster):
    assert slurm_cluster.node_states() == {"node1": "idle", "node2": "idle"}
    nodes = slurm_cluster.run("scontrol", "show", "nodes").stdout
    assert nodes.count("NodeAddr=127.0.0.1") == 2
    config = slurm_cluster.run("scontrol", "show", "config").stdout
    # The settings the other tests rely on: sbatch --wait sees failures, requeue is quick.
    assert "MULTIPLE_SLURMD         = Yes" in config
    assert "MinJobAge               = 4 sec" in config
    assert "JobRequeue              = 1" in config
