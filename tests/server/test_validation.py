"""Malformed requests: each gets the right 4xx with a JSON error naming the field, and the
server then still answers correctly with no KV block leaked."""

from __future__ import annotations

import pytest
from server_checks import assert_no_leak

OK_CHAT = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
LONG = "word " * 1200  # past the tiny model's 1024-token context window

# (route, body or raw bytes, content type, status, the field the error must name or None)
CASES = [
    # /generate (SGLang)
    ("/generate", {"sampling_params": {"max_new_tokens": 4}}, None, 400, "text"),
    ("/generate", {"text": "a", "input_ids": [1]}, None, 400, "text"),
    ("/generate", {"text": 5}, None, 400, "text"),
    ("/generate", {"text": ["a", 3]}, None, 400, "text.1"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, None, 400,
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": -0.1}}, None, 400,
     "sampling_params.temperature"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": "hot"}}, None, 400,
     "sampling_params.temperature"),
    ("/generate", {"text": "a", "sampling_params": {"top_p": 0}}, None, 400,
     "sampling_params.top_p"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 2.5}}, None, 400,
     "sampling_params.max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "(unclosed"}}, None, 400,
     "sampling_params.regex"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": '{"type": "nope"}'}}, None,
     400, "sampling_params.json_schema"),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": "root ::= ("}}, None, 400,
     "sampling_params.ebnf"),
    ("/generate", {"text": "a", "sampling_params": {"structural_tag": "{}"}}, None, 400,
     "sampling_params.structural_tag"),
    ("/generate", {"text": "a", "sampling_params": {"nucleus": 0.9}}, None, 400, None),
    ("/generate", {"text": "a", "sampling_params": {"n": 2, "seed": [1]}}, None, 400,
     "sampling_params.seed"),
    ("/generate", {"text": "a", "sampling_params": {"n": 2, "sampling_seed": True}}, None, 400,
     "sampling_params.seed"),
    ("/generate", {"text": "a", "sampling_params": {"stop": [""]}}, None, 400,
     "sampling_params.stop"),
    ("/generate", {"text": LONG}, None, 400, "text"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 5000}}, None, 400,
     "sampling_params.max_new_tokens"),
    ("/generate", {"input_ids": [1, 10**9]}, None, 400, "input_ids"),
    ("/generate", {"input_ids": []}, None, 400, "input_ids"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, None, 400, "sampling_params"),
    ("/generate", {"text": "a", "stream": "yes"}, None, 400, "stream"),
    ("/generate", {"text": "a", "image_data": "x.png"}, None, 400, "image_data"),
    ("/generate", {"text": "a", "lora_path": "adapter"}, None, 400, "lora_path"),
    ("/generate", {"text": "a", "return_routed_experts": True}, None, 400,
     "return_routed_experts"),
    ("/generate", b"{not json", "application/json", 400, None),
    ("/generate", b"[1, 2]", "application/json", 400, None),
    ("/generate", b'{"text": "a"}', "text/plain", 415, None),
    ("/generate", b'{"text": "a"}', None, 415, None),
    # OpenAI
    ("/v1/completions", {"prompt": "x"}, None, 400, "model"),
    ("/v1/completions", {"model": "default"}, None, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, None, 404, "model"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": -5}, None, 400,
     "max_tokens"),
    ("/v1/completions", {"model": "default", "prompt": "x", "n": 0}, None, 400, "n"),
    ("/v1/completions", {"model": "default", "prompt": "x", "logprobs": 50}, None, 400,
     "logprobs"),
    ("/v1/completions", {"model": "default", "prompt": "x", "suffix": "y"}, None, 400, "suffix"),
    ("/v1/completions", {"model": "default", "prompt": LONG}, None, 400, "prompt"),
    ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 5000}, None, 400,
     "max_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": "hi"}, None, 400, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]},
     None, 400, "messages.0.role"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": [
        {"type": "text"}]}]}, None, 400, "messages[0].content[0].text"),
    ("/v1/chat/completions", {**OK_CHAT, "temperature": -1}, None, 400, "temperature"),
    ("/v1/chat/completions", {**OK_CHAT, "top_p": 1.5}, None, 400, "top_p"),
    ("/v1/chat/completions", {**OK_CHAT, "max_tokens": "ten"}, None, 400, "max_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "max_tokens": 5000}, None, 400, "max_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "max_completion_tokens": 5000}, None, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {**OK_CHAT, "response_format": {"type": "xml"}}, None, 400,
     "response_format.type"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function"}]}, None, 400,
     "tools[0].function"),
    ("/v1/chat/completions", {**OK_CHAT, "logit_bias": {"five": 10}}, None, 400, "logit_bias"),
    ("/v1/completions", {"model": "default", "prompt": "x", "logit_bias": {"5": 500}}, None, 400,
     "logit_bias"),
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"99999999": 1}}}, None, 400,
     "sampling_params.logit_bias"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": LONG}]},
     None, 400, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "regex": "[a-"}, None, 400, "regex"),
    ("/v1/chat/completions", b'{"model": "default", "messages": [', "application/json", 400,
     None),
    # Other routes
    ("/abort_request", {}, None, 400, "rid"),
    ("/no_such_route", {}, None, 404, None),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "ctype", "status", "param"), CASES)
def test_malformed_request_gets_a_4xx_naming_the_field(client, route, body, ctype, status, param):
    if isinstance(body, bytes):
        headers = {"content-type": ctype} if ctype else {}
        response = client.post(route, content=body, headers=headers)
    else:
        response = client.post(route, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"]
    if route.startswith("/v1/"):  # OpenAI's code: a string or null
        assert error["code"] is None or isinstance(error["code"], str), error
    else:
        assert error["code"] == status, error
    if param is not None:
        assert error["param"] == param, error
        assert param.split(".")[-1] in error["message"] or param in ("text", "input_ids", "prompt",
                                                                    "messages")  # fmt: skip


def test_the_server_still_serves_and_leaks_nothing(client, engine):
    for route, body, ctype, _, _ in CASES:  # all of them again, back to back
        if isinstance(body, bytes):
            client.post(route, content=body, headers={"content-type": ctype} if ctype else {})
        else:
            client.post(route, json=body)
    greedy = {"max_new_tokens": 6, "temperature": 0}
    out = client.post("/generate", json={"text": "Still here?", "sampling_params": greedy})
    assert out.status_code == 200
    assert out.json()["text"] == engine.generate("Still here?", greedy).text
    assert_no_leak(client)
    engine.check_integrity()


def test_max_new_tokens_past_the_context_is_a_400_with_the_numbers(client, engine):
    """As SGLang and OpenAI answer it: the prompt's tokens, the tokens asked for, the window.
    Left unset, max_new_tokens (/generate's default, the chat's "what is left") is cut to fit."""
    window = engine.max_context  # 1024 on the tiny model
    ids = [10] * (window - 4)
    greedy = {"temperature": 0, "ignore_eos": True}
    r = client.post(
        "/generate", json={"input_ids": ids, "sampling_params": {**greedy, "max_new_tokens": 5}}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "sampling_params.max_new_tokens"
    message = error["message"]
    for number in ("is 5", f"{window - 4} tokens", "at most 4", f"window of {window}"):
        assert number in message, message
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": greedy})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4  # the default 128, cut to fit
    body = {"model": "default", "prompt": ids, "max_tokens": 5}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "is 5" in r.json()["error"]["message"]
    assert client.post("/v1/completions", json={**body, "max_tokens": 4}).status_code == 200
    assert_no_leak(client)
