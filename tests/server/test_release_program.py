"""``POST /release_program``: a program ended, so the paths its calls asked the engine to retain
(``retain_s``) can go. It releases by the routing key the calls carried (the body's
``routing_key`` or the ``X-Routing-Key`` header), scoped by the tenant as the calls' keys are:
with an API-keys file one tenant cannot release another's program, even under the same key."""

from __future__ import annotations

import httpx
import pytest
from server_checks import assert_no_leak, fresh_cache

# Far past the test's end (the engine cuts it to its retain_max_s, still far past): a retention
# that ends here was released.
RETAIN_S = 3600
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"]}}}]  # fmt: skip


def retained(engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["retained_keys"], stats["retained_paths"]


def generate(client: httpx.Client, key: str, text: str, **headers: str) -> None:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}, "retain_s": RETAIN_S,
            "routing_key": key}  # fmt: skip
    out = client.post("/generate", json=body, headers=headers)
    assert out.status_code == 200, out.text


def release(client: httpx.Client, key: str | None, **headers: str) -> int:
    body = {} if key is None else {"routing_key": key}
    out = client.post("/release_program", json=body, headers=headers)
    assert out.status_code == 200, out.text
    assert out.json()["success"] is True
    return out.json()["released"]


def test_release_ends_the_programs_retentions_and_only_its_own(client, engine):
    fresh_cache(client)
    generate(client, "agent-1", "The first agent's task")
    generate(client, "agent-1", "The first agent's other branch")
    generate(client, "agent-2", "The second agent's task")
    assert retained(engine) == (2, 3)
    assert release(client, "agent-1") == 2
    assert retained(engine) == (1, 1)  # agent-2's path is still kept for it
    assert release(client, "agent-1") == 0  # released already: not an error
    assert release(client, None, **{"X-Routing-Key": "agent-2"}) == 1  # the header names it too
    assert retained(engine) == (0, 0)
    assert_no_leak(client)


@pytest.mark.parametrize(
    ("body", "headers", "why"),
    [
        ({}, {}, "routing_key is required"),
        ({"routing_key": None}, {}, "routing_key is required"),
        ({"routing_key": ""}, {}, "routing_key: String should have at least 1 character"),
        ({"routing_key": "k" * 257}, {}, "routing_key: String should have at most 256"),
        ({"routing_key": 7}, {}, "routing_key: Input should be a valid string"),
        ({"routing_key": ["k"]}, {}, "routing_key: Input should be a valid string"),
        ({"routing_key": "k", "ttl": 1}, {}, "unknown field ttl"),
        ({}, {"X-Routing-Key": "k" * 257}, "header is longer than 256 characters"),
    ],
)
def test_a_malformed_release_is_a_400_naming_routing_key(client, body, headers, why):
    out = client.post("/release_program", json=body, headers=headers)
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert why in error["message"], error
    assert error["code"] == 400 and error["param"] in ("routing_key", "ttl")


def test_a_release_body_that_is_not_a_json_object_is_refused(client):
    assert client.post("/release_program", json=["k"]).status_code == 400
    assert client.post("/release_program", content=b"k").status_code == 415


def test_a_tenant_cannot_release_another_tenants_program_under_the_same_key(engine, client):
    from radixlang.server.app import serve_in_thread

    fresh_cache(client)
    alice, bob = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
    with (
        serve_in_thread(engine, api_keys={"key-a": "alice", "key-b": "bob"}) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
    ):
        generate(c, "shared", "Alice's agent is waiting for a tool", **alice)
        assert retained(engine) == (1, 1)
        assert release(c, "shared", **bob) == 0  # bob's "shared" is not alice's
        assert retained(engine) == (1, 1)
        generate(c, "shared", "Bob's agent is waiting too", **bob)
        assert retained(engine) == (2, 2)  # two programs, though spelt alike
        assert release(c, "shared", **bob) == 1  # his own only
        assert retained(engine) == (1, 1)
        assert release(c, "shared", **alice) == 1
        assert retained(engine) == (0, 0)
        # A chat with tools retains by default, under the same scoped key (openai.py).
        chat = {"model": engine.files.name, "messages": [{"role": "user", "content": "Hi"}],
                "tools": TOOLS, "tool_choice": "required", "max_tokens": 24}  # fmt: skip
        out = c.post("/v1/chat/completions", json=chat,
                     headers={**alice, "X-Routing-Key": "shared"})  # fmt: skip
        assert out.status_code == 200, out.text
        assert retained(engine) == (1, 1)
        assert release(c, "shared", **bob) == 0
        assert release(c, "shared", **alice) == 1
        assert retained(engine) == (0, 0)
        no_key = c.post("/release_program", json={"routing_key": "shared"})
        assert no_key.status_code == 401
    assert_no_leak(client)


def test_the_route_is_in_the_openapi_schema(engine):
    from radixlang.server.app import create_app

    doc = create_app(engine).openapi()
    post = doc["paths"]["/release_program"]["post"]
    body = post["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ReleaseProgramBody"}
    assert {"200", "400", "413", "415", "500"} <= set(post["responses"])
    schemas = doc["components"]["schemas"]
    assert schemas["ReleaseProgramBody"]["properties"]["routing_key"]["anyOf"][0] == {
        "type": "string", "minLength": 1, "maxLength": 256
    }  # fmt: skip
    assert set(schemas["ReleaseResult"]["required"]) == {"success", "released"}
