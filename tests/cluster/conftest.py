"""One Ray cluster for the session's cluster tests: two nodes (one CPU each) on loopback, made
with ``ray.cluster_utils.Cluster`` (about 10 s). Tests that use it are marked ``ray`` and skip
where Ray is not installed."""

from __future__ import annotations

import logging
import os

import pytest

# Before ray is imported anywhere: keep every Ray socket on loopback, send no usage stats.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@pytest.fixture(scope="session")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'radixlang[ray]')")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
