"""A real server on a free loopback port over the tiny chat model (float32, so greedy outputs
do not depend on the batch), shared by the server tests of a module."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    from radixlang.runtime.engine import Engine

    eng = Engine(str(chat_model_dir), kv_memory="64MiB", dtype="float32")
    yield eng
    eng.shutdown(free_cache=True)  # raises if any block is still held


@pytest.fixture(scope="module")
def server(engine):
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(engine) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
