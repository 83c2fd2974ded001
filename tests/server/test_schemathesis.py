"""Property-based API testing with schemathesis against the server's own OpenAPI schema
(``/openapi.json``): every operation, with bodies that fit the schema (positive) and bodies
that do not (negative), streamed and not. No answer is a 5xx, every status code is documented,
every answer has a documented content type and fits its schema (a stream's every event too,
against the media type's ``itemSchema``); afterwards the engine is intact and no
request holds a KV block.

CI runs a bounded number of examples per operation and mode. The longer local run:

    RADIXLANG_SCHEMATHESIS_EXAMPLES=300 .venv/bin/pytest tests/server/test_schemathesis.py -s

(``-s`` prints the operations tested and the examples tried.)
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_checks import assert_no_leak

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.transport import response_content_type  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = int(os.environ.get("RADIXLANG_SCHEMATHESIS_EXAMPLES", "30"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
# Token counts the test keeps small (every generated token costs time, not coverage): a larger
# or missing count becomes SMALL; a smaller, negative or ill-typed one is sent as generated.
SMALL = 4
_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_GENERATING = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses",
               "/v1/messages")  # fmt: skip
# Streams of typed events (``event:`` and ``data:`` lines, no ``[DONE]``).
_TYPED_STREAMS = ("/v1/responses", "/v1/messages")
# Streams with no end, one event per interval (a whole fuzz run would be hours of waiting):
# tests/server/test_dashboard.py reads them and checks each event against the same schema.
ENDLESS = ("/dashboard/api/events",)
_COUNTS = ("max_new_tokens", "max_tokens", "max_completion_tokens", "max_output_tokens", "n",
           "beam_width", "best_of")  # fmt: skip


def _keep_small(body: Any, path: str) -> None:
    """Cap the token counts (and sample and beam counts) of a generated body, in place."""
    if not isinstance(body, dict):
        return
    for key in _COUNTS:
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > SMALL:
            body[key] = SMALL
    if path == "/generate":
        params = body.get("sampling_params")
        if params is None:
            body["sampling_params"] = {"max_new_tokens": SMALL}
        for p in params if isinstance(params, list) else [params]:
            if isinstance(p, dict):
                _keep_small(p, "")
                p.setdefault("max_new_tokens", SMALL)
    elif path == "/v1/chat/completions" and body.get("max_completion_tokens") is None:
        body.setdefault("max_tokens", SMALL)  # else: the rest of the context window
        if body["max_tokens"] is None:
            body["max_tokens"] = SMALL
    elif path == "/v1/responses" and body.get("max_output_tokens") is None:
        body["max_output_tokens"] = SMALL


def _nudge(body: Any, path: str, data: st.DataObject) -> None:
    """Now and then, a body made likelier to be served (the model this server serves, a text
    prompt, and at times nothing else but a stream flag), so that answers and streams are
    checked, not only refusals."""
    if not isinstance(body, dict) or path not in _GENERATING:
        return
    how = data.draw(st.sampled_from(["as generated", "served", "plain", "plain"]), label="nudge")
    if how == "as generated":
        return
    if how == "plain":
        keep = {"model", "prompt", "text", "input_ids"}
        for key in [k for k in body if k not in keep]:
            del body[key]
        if path in ("/v1/chat/completions", "/v1/messages"):
            body["messages"] = [{"role": "user", "content": "Hi"}]
        if path == "/v1/messages":
            body["max_tokens"] = SMALL
        if path == "/v1/responses":
            body["input"] = "Hi"
            body.pop("text", None)
    if path.startswith("/v1/"):
        body["model"] = "default"
    elif path == "/generate":
        body["sampling_params"] = {"max_new_tokens": SMALL}
        body.pop("rid", None)
        if not (isinstance(body.get("text"), str) and body["text"]):
            body.pop("input_ids", None)
            body["text"] = data.draw(st.text(min_size=1, max_size=12), label="text")
    body["stream"] = data.draw(st.booleans(), label="stream")


def _stream_is_framed(response: Any, path: str) -> None:
    """A stream is ``data:`` events (schemathesis checks each against the media type's
    ``itemSchema``), the last ``[DONE]``, unless schemathesis stopped reading (it reads at
    most 20 events, then hangs up: the server must then abort the requests and free their
    blocks, which the last test checks). The Responses and Messages APIs' streams are typed
    events instead (``event:`` then ``data:``), their last one's type ending them."""
    events = [e for e in response.text.split("\n\n") if e]
    if path in _TYPED_STREAMS:
        assert all(e.startswith("event: ") and "\ndata: " in e for e in events), response.text[:300]
        last = ("event: response.completed", "event: response.incomplete", "event: message_stop",
                "event: error")  # fmt: skip
        if not response.stream_cut_short:
            assert events and events[-1].startswith(last), response.text[-300:]
        return
    assert all(e.startswith("data: ") for e in events), response.text[:300]
    if not response.stream_cut_short:
        assert events and events[-1] == "data: [DONE]", response.text[-300:]


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def api_routes(routes: list) -> Iterator:
    """Every API route, those of included routers too (FastAPI keeps an included router whole,
    as one entry of ``app.routes``, its routes under ``original_router``)."""
    from fastapi.routing import APIRoute

    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from api_routes(inner.routes)
        elif isinstance(route, APIRoute):
            yield route


def test_the_schema_has_every_route(server, api):
    routes = {(method, route.path) for route in api_routes(server.app.routes)
              for method in route.methods}  # fmt: skip
    assert len(routes) > 20  # the included routers' routes are found
    operations = {(op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()}
    assert operations == routes
    doc = api.raw_schema
    for path, methods in doc["paths"].items():
        for operation in methods.values():
            assert "200" in operation["responses"], path
            assert "500" in operation["responses"], path
            if operation.get("requestBody"):
                assert {"400", "413", "415"} <= set(operation["responses"]), path


def test_with_api_keys_the_schema_says_so(engine):
    from radixlang.server.app import create_app

    doc = create_app(engine, api_key="secret").openapi()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    generate = doc["paths"]["/generate"]["post"]
    assert generate["security"] == [{"bearer": []}] and "401" in generate["responses"]
    for open_path in ("/health", "/metrics"):  # no key needed
        assert "security" not in doc["paths"][open_path]["get"]
        assert "401" not in doc["paths"][open_path]["get"]["responses"]
    assert "401" not in create_app(engine).openapi()["paths"]["/generate"]["post"]["responses"]


def _fuzz(operation: Any, mode: GenerationMode, session: requests.Session, seen: Counter) -> None:
    """``EXAMPLES`` cases of ``operation`` in ``mode``, each sent and checked; ``seen`` counts
    them by operation, their statuses ("status 200", ...) and the streams."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def run(case: Any, data: st.DataObject) -> None:
        if mode is GenerationMode.POSITIVE:
            _nudge(case.body, operation.path, data)
        _keep_small(case.body, operation.path)
        seen[operation.label] += 1
        response = case.call(session=session, timeout=120)
        seen[f"status {response.status_code}"] += 1
        case.validate_response(response, checks=CHECKS)
        ctype = response_content_type(response) or ""
        if response.status_code == 200 and ctype.startswith("text/event-stream"):
            seen["streams"] += 1
            seen["streams cut short"] += response.stream_cut_short
            _stream_is_framed(response, operation.path)

    run()


def test_every_operation_conforms(server, api, engine):
    doc = api.raw_schema
    seen: Counter[str] = Counter()
    start = time.monotonic()
    with requests.Session() as session:
        for result in api.get_all_operations():
            operation = result.ok()
            if operation.path in ENDLESS:
                continue
            spec = doc["paths"][operation.path][operation.method.lower()]
            _fuzz(operation, GenerationMode.POSITIVE, session, seen)
            if spec.get("requestBody") or spec.get("parameters"):  # something to get wrong
                _fuzz(operation, GenerationMode.NEGATIVE, session, seen)
    operations = [key for key in seen if key.split(" ")[0] in _METHODS]
    statuses = {key: n for key, n in sorted(seen.items()) if key.startswith("status ")}
    print(
        f"\nschemathesis: {len(operations)} operations, {sum(seen[o] for o in operations)} "
        f"examples ({seen['streams']} streamed, {seen['streams cut short']} of them cut short by "
        f"schemathesis), {statuses}, "
        f"{time.monotonic() - start:.0f} s, 0 failures"
    )
    assert len(operations) == len(list(api.get_all_operations())) - len(ENDLESS)
    assert seen["status 200"] > 0 and seen["streams"] > 0  # real answers, streams among them


def test_afterwards_the_engine_is_intact(server, engine):
    greedy = {"max_new_tokens": 5, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        out = client.post("/generate", json={"text": "After the storm", "sampling_params": greedy})
        assert out.json()["text"] == engine.generate("After the storm", greedy).text
        assert_no_leak(client)
    engine.check_integrity()
