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
from hypothesis import settings

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test engines keep a fixed thread count: torch's count is process-wide, and a governor that
# follows the machine's load (runtime/cpu_threads.py) would change it under comparisons between
# engines. Tests of the governor turn it on themselves (adapt_threads=True). Servers that the
# tests start in subprocesses inherit this.
os.environ["RADIXLANG_ADAPT_THREADS"] = "0"

# Before ray is imported anywhere: keep every Ray socket on loopback, send no usage stats.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


# Property tests draw the same examples on every run (derandomize: seeded from each test's
# code), so that the suite says the same thing on every run; a failure they find is found on
# every run until fixed. To explore new examples: pytest --hypothesis-profile explore. No
# deadline: an example's time says how busy the machine is, not whether the code is right.
settings.register_profile("fixed", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile("fixed")


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


# The test command's xdist groups (``-n 2 --dist loadgroup``): a test file stays on one worker (its
# module fixtures, a server or a loaded model, are made once), and every Ray test shares one
# worker (one Ray cluster, not one per worker). xdist's own loadgroup reads ``xdist_group`` marks
# and appends "@group" to each node id for its scheduler, but on pytest 9.2 (structured node ids)
# that append no longer takes effect (pytest-dev/pytest-xdist#1386): every test was scheduled on
# its own, a file's tests spread over both workers, each building the module's fixtures again.
# So the scheduler below (xdist's hook) groups by node id itself. It sees node ids only, not
# marks: the Ray tests are named here, and collection checks the names against the ``ray`` mark.
RAY_TESTS = (
    "tests/cluster/test_replicas.py::",
    "tests/cluster/test_bench_scale_out.py::",
    "tests/server/test_serve_command.py::test_serve_with_two_replicas_on_a_local_ray",
    "tests/server/test_serve_command.py::test_serve_joins_a_ray_cluster",
)


def xdist_group_of(nodeid: str) -> str:
    """The worker group of a test: "ray", or its file."""
    if nodeid.rfind("@") > nodeid.rfind("]"):  # xdist's "@group" suffix, where it works
        return nodeid.rsplit("@", 1)[1]
    return "ray" if nodeid.startswith(RAY_TESTS) else nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(config, items):
    """The groups as ``xdist_group`` marks too (what loadgroup reads where it works), and a
    Ray test missing from ``RAY_TESTS`` (or a name there that is not one) is an error."""
    for item in items:
        group = xdist_group_of(item.nodeid)
        if (group == "ray") != (item.get_closest_marker("ray") is not None):
            raise pytest.UsageError(
                f"{item.nodeid}: a test marked ray must be named in RAY_TESTS (tests/conftest.py)"
                " and a test named there must be marked ray"
            )
        item.add_marker(pytest.mark.xdist_group(group))
