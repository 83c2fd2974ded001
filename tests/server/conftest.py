"""A real server on a free loopback port over the tiny chat model, shared by the server tests of
a module. Its engine is deterministic (and of the "auto" dtype: bfloat16 where the CPU computes
it natively): the tests compare the server's outputs with the engine's own and streamed with
not, so a request's tokens and logprobs must not depend on its batch or on the cache."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    from radixlang.runtime.engine import Engine

    eng = Engine(str(chat_model_dir), kv_memory="64MiB", deterministic=True)
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


@pytest.fixture()
def oai(server):
    """The official ``openai`` client, pointed at the server."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture()
def model(engine):
    """The name the server serves its model as."""
    return engine.files.name
