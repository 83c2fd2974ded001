"""Without a GPU, the Triton kernels run on CPU tensors through Triton's interpreter.

``TRITON_INTERPRET`` must be set before a Triton kernel is defined, i.e. before the first
import of a ``radixlang.kernels`` Triton module. pytest imports this file before any test
module, so it holds even when another test module imports triton first. With
a GPU it is left unset, so the GPU tests run the compiled kernels.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Before ray is imported anywhere: keep every Ray socket on loopback, send no usage stats.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


# A tiny random-weight llama that speaks the default model's tokenizer and chat template, so
# frontend and server tests exercise real tokenization and the engine in milliseconds per call.
@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    from radixlang.testing import write_tiny_chat_model

    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-model"))


# One Ray cluster for the session's scale-out tests (tests/cluster/, and `serve --ray-address`):
# two nodes of one CPU each on loopback, made with ray.cluster_utils.Cluster (about 10 s).
# Tests that use it are marked `ray` and skip where Ray is not installed.
@pytest.fixture(scope="session")
def ray_cluster():
    import logging

    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'radixlang[ray]')")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (``-n 2 --dist loadgroup``, the test command): a test file stays on
    one worker (its module fixtures, a server or a loaded model, are made once), and every
    Ray test shares one worker (one Ray cluster, not one per worker)."""
    for item in items:
        group = "ray" if item.get_closest_marker("ray") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
