"""Each route module of the server mounts alone on a bare FastAPI app (no create_app, no
middleware) and answers over the module's engine: the routes are importable and testable one
module at a time."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from radixlang.server import cache_routes, native, openai, status_routes, token_routes
from radixlang.server.api_schema import route_docs
from radixlang.server.common import TokenTexts
from radixlang.server.metrics import HTTPCounters

docs = route_docs  # a route's OpenAPI answers, without API keys


def alone(router) -> TestClient:
    app = FastAPI()
    app.include_router(router)
    return TestClient(app)


def test_token_routes_alone(engine):
    client = alone(token_routes.router(engine, "tiny", docs))
    ids = client.post("/tokenize", json={"text": "Hello there"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == engine.max_context
    text = client.post("/detokenize", json={"tokens": ids["tokens"]}).json()["text"]
    assert text.endswith("Hello there")
    assert client.post("/abort_request", json={"rid": "nobody"}).json() == {"success": True}


def test_status_routes_alone(engine):
    client = alone(status_routes.router(engine, "tiny", HTTPCounters(), docs))
    assert client.get("/health").json() == {"status": "ok"}
    info = client.get("/get_server_info").json()
    assert info["served_model_name"] == "tiny" and info["num_blocks"] == engine.pool.num_blocks
    assert client.get("/get_model_info").json()["vocab_size"] == engine.runner.vocab_size
    assert "radixlang_" in client.get("/metrics").text


def test_cache_routes_alone(engine):
    client = alone(cache_routes.router(engine, docs))
    assert client.post("/flush_cache").json()["success"] is True
    released = client.post("/release_program", json={"routing_key": "nobody"}).json()
    assert released == {"success": True, "released": 0}
    assert cache_routes.flush_timeout("2.5") == 2.5 and cache_routes.after_number("7") == 7


@pytest.mark.parametrize("bad", ["-1", "nan", "soon"])
def test_a_bad_flush_timeout_is_refused_by_the_module(bad):
    from radixlang.server.common import APIError

    with pytest.raises(APIError, match="timeout must be seconds"):
        cache_routes.flush_timeout(bad)


def test_generate_and_openai_routes_alone(engine):
    texts = TokenTexts(engine.tokenizer)
    client = alone(native.router(engine, texts, docs))
    body = {"text": "Once", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    out = client.post("/generate", json=body).json()
    assert out["meta_info"]["completion_tokens"] == 3
    client = alone(openai.router(engine, "tiny", texts, docs))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]


def test_the_longest_tenant_and_body_salt_fit_the_engines_limit(engine):
    from starlette.requests import Request

    from radixlang.config import MAX_TENANT_CHARS
    from radixlang.runtime.request import MAX_CACHE_SALT_CHARS
    from radixlang.server.common import MAX_BODY_CACHE_SALT_CHARS, cache_salt

    tenant, salt = "t" * MAX_TENANT_CHARS, "s" * MAX_BODY_CACHE_SALT_CHARS
    request = Request({"type": "http", "state": {"tenant": tenant}})
    joined = cache_salt(request, salt)
    assert len(joined) == MAX_TENANT_CHARS + 1 + MAX_BODY_CACHE_SALT_CHARS <= MAX_CACHE_SALT_CHARS
    result = engine.submit("Hi", {"max_new_tokens": 1}, cache_salt=joined).result(timeout=60)
    assert result.completion_tokens == 1
