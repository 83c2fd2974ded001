"""Anthropic's Messages API with the official ``anthropic`` client: plain, streamed
(``messages.stream`` and its event sequence), a tool round trip, stop sequences, usage with
cache reads, ``x-api-key``, and Anthropic's error shape naming what is wrong."""

from __future__ import annotations

import itertools
import json

import httpx
import jsonschema
import pytest
from server_checks import assert_no_leak, chat_prompt_ids

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
               "required": ["city", "unit"]}}  # fmt: skip
TIME = {"name": "get_time", "description": "The time in a zone.",
        "input_schema": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                         "required": ["zone"]}}  # fmt: skip
HELLO = [{"role": "user", "content": "Say hello."}]
# The 2.x client sends no sampling fields of its own (newer models take none); the server still
# takes temperature, top_p and top_k, as Anthropic's API does for the models that have them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture()
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def test_a_plain_message_is_one_text_block_with_usage(claude, model, engine):
    m = claude.messages.create(model=model, max_tokens=8, messages=HELLO, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    [block] = m.content
    assert block.type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens <= 8
    text = engine.tokenizer.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt)
    again = claude.messages.create(model=model, max_tokens=8, messages=HELLO, **GREEDY)
    assert again.content[0].text == block.text  # greedy
    assert again.usage.cache_read_input_tokens >= len(prompt) - 1  # the prompt is cached now


def test_system_and_blocks_render_as_the_chat_route_renders_them(claude, oai, model):
    m = claude.messages.create(
        model=model, max_tokens=6, **GREEDY, system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
    )  # fmt: skip
    chat = oai.chat.completions.create(
        model=model, temperature=0, max_tokens=6,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    )  # fmt: skip
    assert m.content[0].text == chat.choices[0].message.content


def test_a_stream_is_anthropics_event_sequence_and_adds_up(claude, model):
    with claude.messages.stream(model=model, max_tokens=10, messages=HELLO, **GREEDY) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    plain = claude.messages.create(model=model, max_tokens=10, messages=HELLO, **GREEDY)
    assert final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    raw = [k for k in kinds if k not in ("text",)]  # the SDK adds its own "text" events
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    blocks = [k for k in raw if k.startswith("content_block")]
    assert blocks[0] == "content_block_start" and blocks[-1] == "content_block_stop"


def test_a_tool_round_trip(claude, model):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = claude.messages.create(model=model, max_tokens=64, messages=ask, tools=[WEATHER, TIME],
                               tool_choice={"type": "any"}, **GREEDY)  # fmt: skip
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use"
    for use in uses:
        assert use.id.startswith("toolu_") and use.name in ("get_weather", "get_time")
        schema = WEATHER if use.name == "get_weather" else TIME
        jsonschema.validate(use.input, schema["input_schema"])
    follow = claude.messages.create(
        model=model, max_tokens=8, tools=[WEATHER, TIME],
        messages=[*ask, {"role": "assistant", "content": m.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": u.id, "content": "21 C"}
                      for u in uses]}],
    )  # fmt: skip
    assert follow.content and follow.usage.cache_read_input_tokens > 0


def test_a_tool_result_is_in_the_prompt_the_next_turn_counts(claude, model, engine):
    """The result sent back reaches the prompt: ``usage.input_tokens`` (each request under a
    cache salt of its own, so nothing of it is read from the cache) is the length of the prompt
    the server renders for the chat with the result in its tool message, and grows by the
    result's own tokens."""
    arguments = {"city": "Paris", "unit": "c"}
    short = "RESULT-7f3a"
    long = "RESULT-7f3a: 21 degrees, clear sky over the river, wind from the west at 9 km/h"
    salts = (f"tool-result-{i}" for i in itertools.count())

    def input_tokens(result: str) -> int:
        m = claude.messages.create(
            model=model, max_tokens=1, tools=[WEATHER],
            extra_body={"temperature": 0, "cache_salt": next(salts)},
            messages=[{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": [
                          {"type": "tool_use", "id": "toolu_7f3a", "name": "get_weather",
                           "input": arguments}]},
                      {"role": "user", "content": [
                          {"type": "tool_result", "tool_use_id": "toolu_7f3a",
                           "content": result}]}],
        )  # fmt: skip
        assert m.usage.cache_read_input_tokens == 0
        return m.usage.input_tokens

    def rendered(result: str) -> list[int]:
        tool = {"type": "function", "function": {
            "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}  # fmt: skip
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "toolu_7f3a", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
            {"role": "tool", "tool_call_id": "toolu_7f3a", "content": result},
        ]  # fmt: skip
        return chat_prompt_ids(engine, model, messages, [tool])

    assert f"<|im_start|>tool\n{short}<|im_end|>" in engine.tokenizer.decode(rendered(short))
    for result in (short, long):
        assert input_tokens(result) == len(rendered(result)), result

    def n_tokens(text: str) -> int:
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    grown = n_tokens(long) - n_tokens(short)
    assert grown > 0 and input_tokens(long) - input_tokens(short) == grown
    assert input_tokens("") < input_tokens(short)


def test_a_named_tool_streams_its_input_as_json_deltas(claude, model):
    with claude.messages.stream(model=model, max_tokens=64, messages=HELLO, tools=[WEATHER, TIME],
                                tool_choice={"type": "tool", "name": "get_time",
                                             "disable_parallel_tool_use": True}) as s:  # fmt: skip
        partial = "".join(e.partial_json for e in s if e.type == "input_json")
        final = s.get_final_message()
    [use] = final.content
    assert use.type == "tool_use" and use.name == "get_time"
    assert json.loads(partial) == use.input
    jsonschema.validate(use.input, TIME["input_schema"])


def test_output_config_format_holds_the_answer_to_a_json_schema(claude, model):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
              "required": ["answer"]}  # fmt: skip
    for seed in range(3):
        m = claude.messages.create(
            model=model, max_tokens=64, messages=HELLO, extra_body={"seed": seed},
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )  # fmt: skip
        jsonschema.validate(json.loads(m.content[0].text), schema)


def test_a_stop_sequence_is_named(claude, model):
    first = claude.messages.create(model=model, max_tokens=12, messages=HELLO, **GREEDY)
    text = first.content[0].text
    if len(text) < 3:
        pytest.skip("the tiny model's greedy answer is too short to cut")
    stop = text[1:3]
    m = claude.messages.create(model=model, max_tokens=12, messages=HELLO, **GREEDY,
                               stop_sequences=[stop])  # fmt: skip
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text


@pytest.mark.parametrize(
    ("extra", "param_in_message"),
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"temperature": 1.5}, "temperature"),
    ],
)  # fmt: skip
def test_refusals_take_anthropics_error_shape(client, model, extra, param_in_message):
    body = {"model": model, "max_tokens": 2, "messages": HELLO} | extra
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param_in_message in error["error"]["message"]


def test_the_client_raises_its_own_errors(claude, model):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=2, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=model, max_tokens=2, messages=[])


def test_x_api_key_is_accepted_where_keys_are_required(engine):
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(engine, api_key="secret") as srv:
        ok = anthropic.Anthropic(base_url=srv.url, api_key="secret", max_retries=0)
        assert ok.messages.create(model=engine.files.name, max_tokens=2, messages=HELLO).content
        bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            bad.messages.create(model=engine.files.name, max_tokens=2, messages=HELLO)
        with httpx.Client(base_url=srv.url) as c:
            r = c.post("/v1/messages", json={"model": "x", "max_tokens": 1, "messages": HELLO})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_nothing_leaked_and_the_engine_is_intact(client, engine):
    assert_no_leak(client)
    engine.check_integrity()
