"""Random request bodies, well-formed or not: the server never answers 5xx, every refusal is a
JSON error naming what is wrong, and afterwards the engine is intact and holds no block."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_checks import assert_no_leak

# Values of every JSON type, some of them plausible for a field and most not.
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 40),
    st.floats(-3, 3),
    st.text(max_size=6),
    st.lists(st.integers(-2, 60000), max_size=4),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-200, 200), max_size=2),
)
# Plausible values per field; each field a body sets takes one of these or, a third of the
# time, anything at all.
VALID = {
    "max_new_tokens": st.integers(0, 6),
    "min_new_tokens": st.integers(0, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 40),
    "min_p": st.floats(0, 1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 100), max_size=3),
    "ignore_eos": st.booleans(),
    "seed": st.integers(0, 2**32),
    "regex": st.sampled_from(["[0-9]+", "(yes|no)", "[a-z]{1,4}", "(", "a{2,1}"]),
    "n": st.integers(1, 3),
    "logit_bias": st.dictionaries(st.integers(0, 100).map(str), st.floats(-100, 100), max_size=2),
    "no_stop_trim": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
NATIVE_VALID = {
    "return_logprob": st.booleans(),
    "logprob_start_len": st.integers(-1, 6),
    "top_logprobs_num": st.integers(0, 3),
    "return_text_in_logprobs": st.booleans(),
    "stream": st.booleans(),
    "input_ids": st.lists(st.integers(0, 49151), min_size=1, max_size=6),
}
OPENAI_VALID = {
    "max_tokens": st.integers(0, 6),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "logprobs": st.integers(0, 3),
    "echo": st.booleans(),
    "min_tokens": st.integers(0, 2),
    **{k: VALID[k] for k in ("temperature", "top_p", "top_k", "stop", "seed", "presence_penalty",
                             "frequency_penalty", "logit_bias", "regex")},
}  # fmt: skip


def _fields(draw, valid: dict) -> dict:
    keys = draw(st.lists(st.sampled_from(sorted(valid)), max_size=4, unique=True))
    return {k: draw(st.one_of(valid[k], valid[k], ANY)) for k in keys}


@st.composite
def native_bodies(draw):
    body = {"text": draw(st.text(min_size=1, max_size=20)), **_fields(draw, NATIVE_VALID)}
    if "input_ids" in body:
        del body["text"]
    body["sampling_params"] = {"max_new_tokens": 4, **_fields(draw, VALID)}
    if draw(st.integers(0, 9)) == 0:  # now and then a batch
        body = {**body, "text": [body.get("text", "x"), "y"]}
        body.pop("input_ids", None)
    return body


@st.composite
def openai_bodies(draw):
    body = {"model": draw(st.sampled_from(["default"] * 5 + ["nope"])),
            "prompt": draw(st.text(min_size=1, max_size=20)), "max_tokens": 4,
            **_fields(draw, OPENAI_VALID)}  # fmt: skip
    return body


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"]
        if response.request.url.path.startswith("/v1/"):  # OpenAI's code: a string or null
            assert error["code"] is None or isinstance(error["code"], str)
        else:
            assert error["code"] == response.status_code


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.one_of(native_bodies(), openai_bodies()))
def test_random_bodies_never_break_the_server(client, body):
    route = "/v1/completions" if "model" in body else "/generate"
    if body.get("stream") is True:
        with client.stream("POST", route, json=body) as response:
            response.read()
        _check(response)
    else:
        _check(client.post(route, json=body))


def test_afterwards_the_engine_is_intact(client, engine):
    greedy = {"max_new_tokens": 5, "temperature": 0}
    out = client.post("/generate", json={"text": "After the storm", "sampling_params": greedy})
    assert out.json()["text"] == engine.generate("After the storm", greedy).text
    assert_no_leak(client)
    engine.check_integrity()
