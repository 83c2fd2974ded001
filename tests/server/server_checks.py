"""Checks the server tests share: /metrics figures, waiting for idle, no leaked block, the
prompt the server renders for a chat."""

from __future__ import annotations

import time
from typing import Any

import httpx

from radixlang.server.metrics import parse


def metrics(client: httpx.Client) -> dict[str, float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return parse(response.text)


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> dict[str, float]:
    """/metrics once no request is running or waiting (aborts land a step later)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(client)
        idle = m["radixlang_requests_running"] == 0 and m["radixlang_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.02)


def fresh_cache(client: httpx.Client) -> None:
    """Flush the server's cache once idle: a test whose figures count cached tokens must not
    depend on what the module's earlier tests left in it (the engine is shared)."""
    wait_idle(client)
    response = client.post("/flush_cache")
    assert response.status_code == 200, response.text


def assert_no_leak(client: httpx.Client) -> None:
    """Idle, every used block is the cache's (evictable): none is held by a request."""
    m = wait_idle(client)
    assert m["radixlang_requests_running"] == 0 and m["radixlang_requests_waiting"] == 0
    assert m["radixlang_kv_blocks_held"] == 0, m
    assert m["radixlang_kv_blocks_used"] == m["radixlang_kv_blocks_evictable"]
    assert (
        m["radixlang_kv_blocks_free"] + m["radixlang_kv_blocks_used"]
        == (m["radixlang_kv_blocks_total"])
    )


def chat_prompt_ids(
    engine: Any, model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[int]:
    """The prompt the server renders for a chat of ``messages`` offered ``tools`` (chat
    completions' shapes, tool_choice "auto"): the model's chat template through the server's
    own renderer, as token ids."""
    from radixlang.server import tools as tooling
    from radixlang.server.common import TokenTexts
    from radixlang.server.openai import ChatBody, OpenAIRoutes

    routes = OpenAIRoutes(engine, model, TokenTexts(engine.tokenizer))
    body = ChatBody.model_validate({"model": model, "messages": messages, "tools": tools})
    choice = tooling.parse_tool_choice(None, tooling.parse_tools(tools))
    return routes._chat_prompt(body, choice)
