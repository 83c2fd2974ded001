"""A program paused at a tool call has its path retained by the engine (``retain_s``); its run's
end releases it (``Backend.release_program``), on the local engine and over HTTP
(``RuntimeEndpoint`` -> ``POST /release_program``), long before the retention's deadline. An
SGLang server, which has no such route, is tolerated silently; other failures cost a warning,
never the program."""

from __future__ import annotations

import logging
from typing import Annotated

import httpx
import pytest
from pydantic import Field

import radixlang as sgl
from radixlang.lang.backends.endpoint import RuntimeEndpoint
from radixlang.lang.routing import routing_scope

# Longer than any run here: a retention that ends during the test was released, not expired.
LONG_RETAIN_S = 3600.0


@pytest.fixture(autouse=True)
def long_retention(monkeypatch):
    """Tool calls retain for an hour (the engine cuts that to its retain_max_s, still far past
    the test's end)."""
    monkeypatch.setattr("radixlang.lang.interpreter.TOOL_CALL_RETAIN_S", LONG_RETAIN_S)


def retention(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["retained_keys"], stats["retained_paths"]


def probing_program(engine, seen: list[tuple[int, int]]):
    """A one-step agent whose only tool records the engine's retention while the program
    waits for it."""

    def probe(x: Annotated[int, Field(ge=0, le=99)]) -> int:
        """Look a number up.

        Args:
            x: the number
        """
        seen.append(retention(engine))
        return x

    @sgl.function
    def one_call(s):
        s += sgl.user("Look up 7.")
        s += sgl.assistant(sgl.gen("step", tools=[probe], tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=48))  # fmt: skip
        s += sgl.run_tools("step")

    return one_call


@pytest.fixture(params=["local", "http", "http-tenant"])
def backend(request, engine):
    """The local backend; an endpoint on the module's server; an endpoint with a tenant's API
    key (the server scopes the program's key by the tenant: the release must say the same)."""
    if request.param == "local":
        yield request.getfixturevalue("local")
        return
    if request.param == "http":
        endpoint = RuntimeEndpoint(request.getfixturevalue("server").url)
        yield endpoint
        endpoint.shutdown()
        return
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(engine, api_keys={"key-a": "alice"}) as srv:
        endpoint = RuntimeEndpoint(srv.url, api_key="key-a")
        yield endpoint
        endpoint.shutdown()


def test_a_paused_tool_programs_path_is_kept_and_its_runs_end_releases_it(backend, engine):
    engine.flush_cache(wait=30)  # no retention left by an earlier test
    assert retention(engine) == (0, 0)
    seen: list[tuple[int, int]] = []
    state = probing_program(engine, seen).run(backend=backend, temperature=1.0, seed=2)
    assert state.tool_results("step"), "a required tool choice calls the tool"
    keys, paths = seen[0]
    assert keys == 1 and paths >= 1, seen  # the paused program's path is kept for its return
    assert retention(engine) == (0, 0)  # the run ended: released, an hour before the deadline


def test_a_program_that_asks_for_no_retention_sends_no_release(server, recording):
    endpoint = RuntimeEndpoint(server.url, transport=recording)
    try:

        @sgl.function
        def plain(s):
            s += "Hello" + sgl.gen("a", max_tokens=2)

        plain.run(backend=endpoint, temperature=0)
    finally:
        endpoint.shutdown()
    assert ("POST", "/generate") in [(m, p) for m, p, _ in recording.requests]
    assert not [p for _, p, _ in recording.requests if p == "/release_program"]


def sglang_like(release_status: int | None, seen: list[str]) -> httpx.MockTransport:
    """A server with SGLang's /get_model_info and /generate; /release_program answers
    ``release_status`` (None: the connection fails)."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m"})
        if request.url.path == "/generate":
            return httpx.Response(200, json={"text": "x", "meta_info": {}})
        if release_status is None:
            raise httpx.ConnectError("refused", request=request)
        body = {"error": {"message": "boom", "type": "server_error"}}
        return httpx.Response(release_status, json=body if release_status >= 500 else {})

    return httpx.MockTransport(handle)


def retaining_calls(endpoint: RuntimeEndpoint, keys: list[str]) -> None:
    """One call per program key that asks to retain its path, as a gen with tools sends."""
    for key in keys:
        with routing_scope(key):
            endpoint.generate("Hi", {"max_new_tokens": 1, "retain_s": 30.0})


def test_a_server_without_the_route_is_not_asked_again_and_nothing_is_logged(caplog):
    seen: list[str] = []
    endpoint = RuntimeEndpoint("http://sglang", transport=sglang_like(404, seen))
    retaining_calls(endpoint, ["program-a", "program-b"])
    with caplog.at_level(logging.WARNING):
        endpoint.release_program("program-a")  # 404: the server lacks the route
        endpoint.release_program("program-b")
    assert seen.count("/release_program") == 1
    assert not caplog.records


@pytest.mark.parametrize("status", [500, None], ids=["refused", "unreachable"])
def test_a_failed_release_is_a_warning_never_the_programs_error(caplog, status):
    seen: list[str] = []
    endpoint = RuntimeEndpoint("http://server", transport=sglang_like(status, seen))
    retaining_calls(endpoint, ["program-a", "program-b"])
    with caplog.at_level(logging.WARNING):
        endpoint.release_program("program-a")
        endpoint.release_program("program-b")  # a failure is no reason to stop asking
        endpoint.release_program("program-b")  # released (or tried) once per program
        endpoint.release_program("never-retained")
    assert seen.count("/release_program") == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "program-a" in warnings[0] and "deadline" in warnings[0]
