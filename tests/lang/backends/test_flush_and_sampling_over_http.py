"""Over HTTP, on the tiny chat model's server (conftest.py): ``/flush_cache`` keeps SGLang's
contract (200 once flushed; 400 while requests are in flight after ``?timeout=`` seconds), and
``gen``'s ``repetition_penalty`` and ``skip_special_tokens`` go through ``RuntimeEndpoint`` as
SGLang's sampling parameters, which the server honours."""

from __future__ import annotations

import httpx
import pytest
from engine_gate import hold_steps  # tests/, on the path through tests/conftest.py

import radixlang as sgl
from radixlang.lang.backends.endpoint import RuntimeEndpoint

IM_END = 2  # <|im_end|>, a special token of the tiny chat model's (the default) tokenizer
LONG = {"max_new_tokens": 100, "ignore_eos": True, "temperature": 0}


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_flush_cache_answers_200_when_idle_by_post_or_get(client, engine):
    engine.generate([5, 6, 7, 8], {"max_new_tokens": 1})
    for method in ("POST", "GET"):
        response = client.request(method, "/flush_cache")
        assert response.status_code == 200
        assert response.json() == {"success": True, "message": "Cache flushed."}
        assert engine.stats()["cached_tokens"] == 0


def test_flush_cache_answers_400_while_requests_run(client, engine, server):
    endpoint = RuntimeEndpoint(server.url)
    # Held after its first token: the request is in flight for as long as the test asks.
    with hold_steps(engine, after_tokens=1) as gate:
        handle = engine.submit([5, 6, 7], LONG)
        try:
            gate.wait_holding()
            response = client.post("/flush_cache")
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["type"] == "cache_busy" and "requests are in flight" in error["message"]
            assert client.post("/flush_cache", params={"timeout": 0.1}).status_code == 400
            assert endpoint.flush_cache() is False  # SGLang's client reads the status
            assert not handle.done
        finally:
            handle.abort()
            endpoint.shutdown()
    handle.result(timeout=60, raise_on_error=False)


def test_flush_cache_with_a_timeout_waits_for_the_requests(client, engine):
    handle = engine.submit([5, 6, 7], LONG | {"max_new_tokens": 30})
    response = client.post("/flush_cache", params={"timeout": 60})  # as SGLang's bench sends it
    assert response.status_code == 200
    assert handle.done and len(handle.result().output_ids) == 30
    assert engine.stats()["cached_tokens"] == 0


@pytest.mark.parametrize("timeout", ["-1", "soon", "nan", "inf"])
def test_a_bad_flush_timeout_is_a_400_naming_it(client, timeout):
    response = client.post("/flush_cache", params={"timeout": timeout})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "timeout"


def test_endpoint_sends_penalty_and_special_tokens_as_sglangs_sampling_params(server, recording):
    endpoint = RuntimeEndpoint(server.url, transport=recording)
    try:

        @sgl.function
        def prog(s):
            s += "Hi" + sgl.gen(
                "a", max_tokens=2, repetition_penalty=1.2, skip_special_tokens=False
            )

        prog.run(backend=endpoint)
        (body,) = [b for _, path, b in recording.requests if path == "/generate"]
        params = body["sampling_params"]
        assert (params["repetition_penalty"], params["skip_special_tokens"]) == (1.2, False)

        # The server keeps special tokens in the text only when asked.
        forced = {"max_new_tokens": 2, "logit_bias": {str(IM_END): 100.0}, "ignore_eos": True}
        kept, meta = endpoint.generate("Hi", forced | {"skip_special_tokens": False})
        dropped, _ = endpoint.generate("Hi", forced)
        assert meta["output_ids"] == [IM_END, IM_END]
        assert (kept, dropped) == ("<|im_end|><|im_end|>", "")
    finally:
        endpoint.shutdown()
