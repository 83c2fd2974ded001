"""The OpenAI API's structured output (response_format), chat logprobs' token bytes and OpenAI's
error body, driven with the official ``openai`` client on the tiny random model."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_checks import assert_no_leak

from radixlang.server.common import _BYTE_LEVEL


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=6)


SHAPE = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "code": {"type": "string", "maxLength": 4}},
    "required": ["ok", "code"],
}
MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]


def test_parse_returns_the_pydantic_model(oai, model):
    for seed in range(2):
        out = oai.chat.completions.parse(model=model, messages=MESSAGES, response_format=Pet,
                                         max_tokens=64, temperature=1.0, seed=seed)  # fmt: skip
        (choice,) = out.choices
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
        assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_response_format_stream_and_n(oai, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE, "strict": True}}
    out = oai.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt,
                                      max_tokens=40, n=2, seed=3)  # fmt: skip
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SHAPE)
    text, finish = "", None
    kwargs = dict(model=model, messages=MESSAGES, response_format=fmt, max_tokens=40)
    for chunk in oai.chat.completions.create(**kwargs, temperature=0, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    jsonschema.validate(json.loads(text), SHAPE)
    assert finish == "stop"


def test_json_object_is_a_json_object(oai, model, engine):
    # Any object may have any keys: a random model never stops writing one. Favouring '"' and
    # '}' (where the grammar allows them) closes strings and objects early; the output is
    # still only what the grammar allows.
    closers = {str(t): 100 for s in ('"', "}") for t in engine.tokenizer.encode(s)}
    out = oai.chat.completions.create(model=model, messages=MESSAGES, logit_bias=closers,
                                      response_format={"type": "json_object"},
                                      max_tokens=40, temperature=0.7, seed=1)  # fmt: skip
    (choice,) = out.choices
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_text_response_format_is_plain(oai, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=6, temperature=0)
    plain = oai.chat.completions.create(**kwargs).choices[0].message.content
    text = oai.chat.completions.create(**kwargs, response_format={"type": "text"})
    assert text.choices[0].message.content == plain


def test_completions_take_response_format(oai, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "shape", "schema": SHAPE}}
    out = oai.completions.create(model=model, prompt="JSON:", max_tokens=40, temperature=0,
                                 extra_body={"response_format": fmt})  # fmt: skip
    (choice,) = out.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.text), SHAPE)


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"minLength": -2}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "yaml"}, "response_format.type"),
    ],
)  # fmt: skip
def test_invalid_response_format_is_a_400_naming_the_field(oai, model, client, fmt, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model, messages=MESSAGES, response_format=fmt)
    assert info.value.body["param"] == param
    assert info.value.body["code"] is None or isinstance(info.value.body["code"], str)
    assert_no_leak(client)


def test_response_format_and_regex_together_are_refused(oai, model):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=model, messages=MESSAGES, extra_body={"regex": "a+"},
                                    response_format={"type": "json_object"})  # fmt: skip
    assert info.value.body["param"] == "response_format"


def _partial_utf8_token(engine) -> tuple[int, list[int]]:
    """A byte-level token that holds part of a UTF-8 character, and its bytes."""
    tokenizer = engine.tokenizer
    for token in range(256, 2000):
        piece = tokenizer.convert_ids_to_tokens(token)
        if not all(c in _BYTE_LEVEL for c in piece):
            continue
        raw = bytes(_BYTE_LEVEL[c] for c in piece)
        try:
            raw.decode()
        except UnicodeDecodeError:
            return token, list(raw)
    raise AssertionError("no partial-UTF-8 token found")


def test_chat_logprob_bytes_are_the_tokens_own(oai, model, engine):
    token, raw = _partial_utf8_token(engine)
    assert engine.tokenizer.decode([token]) == "\ufffd"  # its text alone is U+FFFD
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=1, temperature=0, logprobs=True,
                  top_logprobs=3, logit_bias={str(token): 100})  # fmt: skip
    out = oai.chat.completions.create(**kwargs)
    (entry,) = out.choices[0].logprobs.content
    assert entry.bytes == raw and entry.bytes != [239, 191, 189]
    for alt in entry.top_logprobs:  # each alternative's bytes decode to its text, when whole
        if "\ufffd" not in alt.token:
            assert bytes(alt.bytes).decode() == alt.token
    # The same in a stream.
    (chunk_entry,) = [
        e for chunk in oai.chat.completions.create(**kwargs, stream=True)
        for c in chunk.choices if c.logprobs for e in c.logprobs.content
    ]  # fmt: skip
    assert chunk_entry.bytes == raw


def test_plain_tokens_bytes_match_their_text(oai, model):
    out = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                      temperature=0, logprobs=True)  # fmt: skip
    content = out.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in content)
    assert joined.decode(errors="replace") == out.choices[0].message.content


def test_unknown_model_is_openais_404(oai, client):
    response = client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MESSAGES})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found"
    assert error["param"] == "model" and "gpt-9" in error["message"]
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="gpt-9", prompt="x")
    assert info.value.code == "model_not_found" and info.value.type == "invalid_request_error"
    # Native routes keep the status as code (radixlang's and SGLang's clients read it).
    native = client.post("/generate", json={"text": 5}).json()["error"]
    assert native["code"] == 400


def test_nothing_leaked_and_the_engine_is_intact(client, engine):
    assert_no_leak(client)
    engine.check_integrity()
