"""The HTTP backends' integration fixtures: one engine on the tiny chat model (tests/conftest.py),
served over HTTP and also wrapped in a LocalBackend, so both paths run the same weights.

The engine is deterministic: the tests compare what a program gets over HTTP with what it gets
in process, one run after the other, so the second finds its prefix cached and its requests
batched otherwise. Without the mode, in bfloat16 ("auto" on a CPU with native bfloat16) a
request's logits depend on both, and greedy tokens part."""

from __future__ import annotations

import json

import httpx
import pytest


@pytest.fixture(scope="session")
def engine(chat_model_dir):
    from radixlang.runtime.engine import Engine

    engine = Engine(str(chat_model_dir), kv_memory="64MiB", deterministic=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(engine, host="127.0.0.1", port=0) as server:
        yield server


@pytest.fixture(scope="session")
def local(engine):
    from radixlang.lang.backends.local import LocalBackend

    # Not shut down here: the engine fixture owns the engine.
    return LocalBackend(engine)


class RecordingTransport(httpx.HTTPTransport):
    """A real transport that also records (method, path, JSON body) of every request."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str, object]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path, body))
        return super().handle_request(request)


@pytest.fixture
def recording() -> RecordingTransport:
    return RecordingTransport()
