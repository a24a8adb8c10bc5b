import pytest

pytestmark = pytest.mark.slow


def test_cluster_has_two_idle_nodes(slurm_cluster):
    assert slurm_cluster.node_states() == {"node1": "idle", "node2": "idle"}
