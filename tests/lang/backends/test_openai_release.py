"""The OpenAI backend ends a program's retentions too: a chat call that offers tools makes a
radixlang server retain its path under the program's routing key (the ``X-Routing-Key`` the call
carries), and the run's end posts ``/release_program`` at the server's root (not under ``/v1``),
with the API key. A service without the route (vLLM, SGLang) is asked once; OpenAI's own
service never; other failures cost a warning, never the program."""

from __future__ import annotations

import json
import logging
from typing import Annotated

import httpx
import pytest
from pydantic import Field

import radixlang as sgl
from radixlang.lang.backends.openai import OpenAI
from radixlang.lang.routing import routing_scope

# Longer than any run here: a retention that ends during the test was released, not expired.
LONG_RETAIN_S = 3600.0


@pytest.fixture(autouse=True)
def long_retention(monkeypatch):
    """A call with tools retains for an hour on the server (the engine cuts that to its
    retain_max_s, still far past the test's end)."""
    monkeypatch.setattr("radixlang.server.openai.TOOL_CALL_RETAIN_S", LONG_RETAIN_S)


def retention(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["retained_keys"], stats["retained_paths"]


class Recording(httpx.HTTPTransport):
    """A real transport that records (method, path, X-Routing-Key, Authorization, JSON body)."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str, str, str | None, str | None, object]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.requests.append((request.method, request.url.path,
                              request.headers.get("x-routing-key"),
                              request.headers.get("authorization"), body))  # fmt: skip
        return super().handle_request(request)

    def paths(self) -> list[str]:
        return [path for _, path, _, _, _ in self.requests]


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


@pytest.fixture(params=["plain", "tenant"])
def served(request, engine):
    """(base URL, API key): the module's server; one with a tenant's API key (the server scopes
    the program's key by the tenant: the release must carry the same key to name it)."""
    if request.param == "plain":
        yield request.getfixturevalue("server").url, "none"
        return
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(engine, api_keys={"key-a": "alice"}) as srv:
        yield srv.url, "key-a"


def test_a_paused_tool_program_on_the_openai_backend_is_released_when_its_run_ends(served, engine):
    url, api_key = served
    engine.flush_cache(wait=30)  # no retention left by an earlier test
    assert retention(engine) == (0, 0)
    recording = Recording()
    backend = OpenAI(engine.files.name, base_url=url + "/v1", api_key=api_key,
                     transport=recording)  # fmt: skip
    seen: list[tuple[int, int]] = []
    try:
        state = probing_program(engine, seen).run(backend=backend, temperature=1.0, seed=2)
    finally:
        backend.shutdown()
    assert state.tool_results("step"), "a required tool choice calls the tool"
    keys, paths = seen[0]
    assert keys == 1 and paths >= 1, seen  # the paused program's path is kept for its return
    assert retention(engine) == (0, 0)  # the run ended: released, an hour before the deadline
    calls = [r for r in recording.requests if r[1] == "/v1/chat/completions"]
    releases = [r for r in recording.requests if r[1] == "/release_program"]
    program = calls[0][2]
    assert program is not None and program.startswith("program-")  # the program's own key
    assert len(releases) == 1
    _, _, _, auth, body = releases[0]
    assert body == {"routing_key": program} and auth == f"Bearer {api_key}"


def test_a_program_whose_calls_retain_nothing_sends_no_release(server, engine):
    recording = Recording()
    backend = OpenAI(engine.files.name, base_url=server.url + "/v1", api_key="none",
                     transport=recording)  # fmt: skip

    @sgl.function
    def plain(s):
        s += sgl.user("Hello")
        s += sgl.assistant(sgl.gen("a", max_tokens=2))

    try:
        plain.run(backend=backend, temperature=0)
    finally:
        backend.shutdown()
    assert "/v1/chat/completions" in recording.paths()
    assert "/release_program" not in recording.paths()


def service(release_status: int | None, seen: list[httpx.Request]) -> httpx.MockTransport:
    """An OpenAI-compatible service whose chat completions answer "x"; ``/release_program``
    answers ``release_status`` (None: the connection fails)."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/chat/completions"):
            message = {"role": "assistant", "content": "x"}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return httpx.Response(200, json={"id": "c", "choices": [choice], "usage": {}})
        if release_status is None:
            raise httpx.ConnectError("refused", request=request)
        body = {"error": {"message": "boom", "type": "server_error"}}
        return httpx.Response(release_status, json=body if release_status >= 500 else {})

    return httpx.MockTransport(handle)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def tool_calls(backend: OpenAI, keys: list[str]) -> None:
    """One chat call that offers tools per program key, as a gen with tools sends."""
    for key in keys:
        with routing_scope(key):
            backend.generate_chat([{"role": "user", "content": "Hi"}],
                                  {"max_new_tokens": 1, "tools": [TOOL]})  # fmt: skip


def releases(seen: list[httpx.Request]) -> list[httpx.Request]:
    return [r for r in seen if r.url.path.endswith("/release_program")]


def test_the_release_goes_to_the_servers_root_with_the_key():
    seen: list[httpx.Request] = []
    backend = OpenAI("m", base_url="http://server/v1", api_key="sk-1",
                     transport=service(200, seen))  # fmt: skip
    tool_calls(backend, ["program-a"])
    backend.release_program("program-a")
    backend.release_program("program-a")  # released once per program
    (release,) = releases(seen)
    assert str(release.url) == "http://server/release_program"  # not under /v1
    assert release.headers["authorization"] == "Bearer sk-1"
    assert json.loads(release.content) == {"routing_key": "program-a"}


def test_a_service_without_the_route_is_not_asked_again_and_nothing_is_logged(caplog):
    seen: list[httpx.Request] = []
    backend = OpenAI("m", base_url="http://vllm/v1", api_key="k", transport=service(404, seen))
    tool_calls(backend, ["program-a", "program-b"])
    with caplog.at_level(logging.WARNING):
        backend.release_program("program-a")  # 404: the service lacks the route
        backend.release_program("program-b")
        tool_calls(backend, ["program-c"])
        backend.release_program("program-c")
    assert len(releases(seen)) == 1
    assert not caplog.records


@pytest.mark.parametrize("status", [500, None], ids=["refused", "unreachable"])
def test_a_failed_release_is_a_warning_never_the_programs_error(caplog, status):
    seen: list[httpx.Request] = []
    backend = OpenAI("m", base_url="http://server/v1", api_key="k",
                     transport=service(status, seen))  # fmt: skip
    tool_calls(backend, ["program-a", "program-b"])
    with caplog.at_level(logging.WARNING):
        backend.release_program("program-a")
        backend.release_program("program-b")  # a failure is no reason to stop asking
        backend.release_program("program-b")  # released (or tried) once per program
        backend.release_program("never-retained")
    assert len(releases(seen)) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "program-a" in warnings[0] and "deadline" in warnings[0]


def test_openais_own_service_is_never_asked(caplog):
    seen: list[httpx.Request] = []
    backend = OpenAI("gpt", api_key="sk", transport=service(200, seen))
    assert backend.official
    tool_calls(backend, ["program-a"])
    with caplog.at_level(logging.WARNING):
        backend.release_program("program-a")
    assert [r.url.path for r in seen] == ["/v1/chat/completions"]
    assert not caplog.records
