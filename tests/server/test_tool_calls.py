"""OpenAI function calling on the chat route: tools shown to the model, calls constrained to
valid ones (required, a named function), ``auto`` free to answer text, OpenAI's ``tool_calls``
shape whole and streamed, tool history accepted, malformed tools refused by field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_checks import assert_no_leak

from radixlang.constrain.tool_formats import DEFAULT_FORMAT
from radixlang.server import tools as tooling

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}  # fmt: skip
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
                   "required": ["zone"]}}}  # fmt: skip
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(message, names=tuple(SCHEMAS)) -> list:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


def _streamed(oai, **kwargs) -> tuple[str, dict[int, dict], str | None]:
    """A streamed chat's content, its tool calls assembled from their deltas, and its finish."""
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for item in c.delta.tool_calls or []:
                if item.index not in calls:  # the first delta of a call: id, type, name
                    assert item.id.startswith("call_") and item.type == "function"
                    assert item.function.name
                    calls[item.index] = {"id": item.id, "name": item.function.name,
                                         "arguments": item.function.arguments or ""}  # fmt: skip
                else:
                    assert item.id is None and not item.function.name
                    calls[item.index]["arguments"] += item.function.arguments
    return content, calls, finish


def test_required_makes_one_valid_call(oai, model):
    for seed in range(2):
        out = oai.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False,
                                          max_tokens=60, seed=seed)  # fmt: skip
        (choice,) = out.choices
        assert choice.finish_reason == "tool_calls"
        assert len(_check_calls(choice.message)) == 1


@pytest.mark.compares_outputs
def test_named_function_is_the_one_called_whole_and_streamed(oai, model):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
                  tool_choice=named)  # fmt: skip
    whole = oai.chat.completions.create(**kwargs).choices[0]
    (call,) = _check_calls(whole.message, names=("get_weather",))
    assert whole.finish_reason == "tool_calls"
    content, calls, finish = _streamed(oai, **kwargs)
    assert content == "" and finish == "tool_calls"
    (streamed,) = calls.values()
    assert streamed["name"] == "get_weather"
    assert streamed["arguments"] == call.function.arguments  # greedy: the same call


@pytest.mark.compares_outputs
def test_parallel_calls_are_each_valid(oai, model):
    # This seed and temperature make the random model write three calls in one block.
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=120, seed=0, temperature=1.5)  # fmt: skip
    whole = oai.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert len(_check_calls(whole.message)) >= 2
    assert len({c.id for c in whole.message.tool_calls}) == len(whole.message.tool_calls)
    content, calls, finish = _streamed(oai, **kwargs)  # seeded: the same calls again
    assert content == "" and finish == whole.finish_reason
    made = whole.message.tool_calls
    assert [c["name"] for c in calls.values()] == [c.function.name for c in made]
    assert [c["arguments"] for c in calls.values()] == [c.function.arguments for c in made]


def test_auto_answers_text_or_a_valid_call(oai, model):
    for seed in range(2):
        out = oai.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS,
                                          max_tokens=12, seed=seed)  # fmt: skip
        (choice,) = out.choices
        if choice.message.tool_calls:
            _check_calls(choice.message)
        else:  # the random model writes text: nothing forced a call
            assert choice.message.content and choice.finish_reason in ("stop", "length")
            assert not choice.message.content.startswith(DEFAULT_FORMAT.trigger)


def test_auto_grammar_makes_a_started_call_valid(engine):
    """Once an ``auto`` output has the call marker, the rest must be a valid call (the random
    model never writes the marker itself: this walks the grammar with random allowed tokens)."""
    import random

    from radixlang.constrain import compile_grammar

    choice = tooling.parse_tool_choice("auto", tooling.parse_tools(TOOLS))
    grammar = compile_grammar("grammar", tooling.call_grammar(choice, parallel=True),
                              engine.tokenizer, engine.runner.vocab_size,
                              engine.eos_token_ids)  # fmt: skip
    rng = random.Random(0)
    for _ in range(3):
        constraint = grammar.new_constraint()
        tokens = list(engine.tokenizer.encode(DEFAULT_FORMAT.trigger))
        for token in tokens:
            constraint.advance(token)
        while not constraint.is_finished() and len(tokens) < 300:
            allowed = constraint.allowed_mask().nonzero().flatten().tolist()
            if constraint.may_end():
                break
            token = rng.choice([t for t in allowed if t not in engine.eos_token_ids])
            constraint.advance(token)
            tokens.append(token)
        text = engine.tokenizer.decode(tokens)
        calls, closed = DEFAULT_FORMAT.scan(text)
        assert closed and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # A reply that does not start with the marker is free text; one that does is a call.
    text_start = grammar.new_constraint()
    for token in engine.tokenizer.encode("Hello <tool_call> is just text"):
        text_start.advance(token)
    assert text_start.may_end()


def test_auto_with_response_format_answers_json_or_a_call(engine):
    import random

    from radixlang.constrain import compile_grammar

    reply = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
             "required": ["answer"]}  # fmt: skip
    choice = tooling.parse_tool_choice("auto", tooling.parse_tools(TOOLS))
    grammar = compile_grammar("grammar", tooling.call_grammar(choice, False, reply),
                              engine.tokenizer, engine.runner.vocab_size,
                              engine.eos_token_ids)  # fmt: skip
    rng, kinds = random.Random(1), set()
    for _ in range(8):
        constraint, tokens = grammar.new_constraint(), []
        while not constraint.is_finished() and not constraint.may_end() and len(tokens) < 200:
            allowed = constraint.allowed_mask().nonzero().flatten().tolist()
            token = rng.choice([t for t in allowed if t not in engine.eos_token_ids])
            constraint.advance(token)
            tokens.append(token)
        text = engine.tokenizer.decode(tokens)
        if text.startswith(DEFAULT_FORMAT.trigger):
            calls, closed = DEFAULT_FORMAT.scan(text)
            assert closed and len(calls) == 1, text
            kinds.add("call")
        else:
            jsonschema.validate(json.loads(text), reply)
            kinds.add("json")
    assert "json" in kinds


def test_an_auto_output_with_a_call_is_answered_as_tool_calls():
    from radixlang.runtime.request import FinishReason, GenerationResult
    from radixlang.server.openai import _chat_message

    text = '<tool_call>[{"name": "get_time", "arguments": {"zone": "utc"}}]</tool_call>'
    result = GenerationResult("r", text, [1], [1], FinishReason.STOP, None, 1, 1, 0, [], [],
                              [], [], None, 0.0)  # fmt: skip
    choice = tooling.parse_tool_choice("auto", tooling.parse_tools(TOOLS))
    message, finish = _chat_message(result, choice)
    assert finish == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "utc"}'}
    result.text = "Plain words"
    assert _chat_message(result, choice) == ({"role": "assistant", "content": "Plain words"},
                                             "stop")  # fmt: skip


def test_auto_text_streams_as_content(oai, model):
    kwargs = dict(model=model, messages=MESSAGES, tools=TOOLS, max_tokens=10, temperature=0)
    whole = oai.chat.completions.create(**kwargs).choices[0]
    assert whole.message.tool_calls is None
    content, calls, finish = _streamed(oai, **kwargs)
    assert content == whole.message.content and not calls and finish == whole.finish_reason


def test_none_is_plain_text(oai, model):
    kwargs = dict(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    plain = oai.chat.completions.create(**kwargs).choices[0]
    none = oai.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and none.message.content == plain.message.content


class Lookup(BaseModel):
    """Look a word up."""

    word: str = Field(max_length=6)
    lang: str = Field(pattern="^(en|fr)$")


def test_parse_with_a_pydantic_function_tool(oai, model):
    out = oai.chat.completions.parse(model=model, messages=MESSAGES, max_tokens=40, seed=0,
                                     tools=[openai.pydantic_function_tool(Lookup)],
                                     tool_choice="required", parallel_tool_calls=False)  # fmt: skip
    (call,) = out.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Lookup)


def test_tool_history_is_accepted_and_rendered(oai, model, engine):
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]  # fmt: skip
    out = oai.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=6,
                                      temperature=0)  # fmt: skip
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # What the model saw: the tools, the earlier call in the call format, the tool's answer.
    from radixlang.server.common import TokenTexts
    from radixlang.server.openai import ChatBody, OpenAIRoutes

    routes = OpenAIRoutes(engine, model, TokenTexts(engine.tokenizer))
    body = ChatBody.model_validate({"model": model, "messages": history, "tools": TOOLS})
    choice = tooling.parse_tool_choice(None, tooling.parse_tools(TOOLS))
    prompt = engine.tokenizer.decode(routes._chat_prompt(body, choice))
    assert '"name": "get_time"' in prompt and "<tools>" in prompt  # described in a system turn
    call = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]'
    assert call in prompt
    assert "<|im_start|>tool\n21 degrees, sunny<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": 5}}]},
         "tools[1].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "nope"}}}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f",
                                                      "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "extra_body": {"regex": "a+"}}, "regex"),
        ({"messages": [{"role": "assistant", "content": None,
                        "tool_calls": [{"id": "c", "type": "function", "function": {}}]}]},
         "messages[0].tool_calls[0].function.name"),
    ],
)  # fmt: skip
def test_malformed_tools_get_a_400_naming_the_field(oai, model, client, extra, param):
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**kwargs)
    assert info.value.body["param"] == param, info.value.body
    assert_no_leak(client)


# ---- the call format, without a server -------------------------------------------------------


def test_scan_calls_reads_partial_and_whole_blocks():
    text = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "a}\\"b", "unit": "c"}}, '
            '{"name": "get_time", "arguments": {"zone": "utc"}}]</tool_call>')  # fmt: skip
    calls, closed = DEFAULT_FORMAT.scan(text)
    assert closed and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": 'a}"b', "unit": "c"}
    assert all(c.complete for c in calls)
    for cut in range(len(text)):  # every prefix: calls so far, arguments a prefix of the whole
        partial, done = DEFAULT_FORMAT.scan(text[:cut])
        assert not done and len(partial) <= 2
        for got, full in zip(partial, calls, strict=False):
            assert got.name == full.name and full.arguments.startswith(got.arguments)


def test_call_stream_deltas_add_up_and_auto_holds_back_the_marker():
    text = '<tool_call>[{"name": "get_time", "arguments": {"zone": "cet"}}]</tool_call>'
    stream = tooling.CallStream(may_call=True, must_call=False)
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i : i + 3])]
    items = [item for d in deltas for item in d["tool_calls"]]
    assert items[0]["function"]["name"] == "get_time" and items[0]["id"].startswith("call_")
    assert all(len({i["index"] for i in d["tool_calls"]}) == len(d["tool_calls"]) for d in deltas)
    assert "".join(i["function"]["arguments"] for i in items) == '{"zone": "cet"}'
    assert stream.called and stream.closed
    text_reply = tooling.CallStream(may_call=True, must_call=False)
    assert text_reply.feed("<tool") == []  # could still be the marker
    assert text_reply.feed("s are") == [{"content": "<tools are"}]
    assert text_reply.feed(" fun") == [{"content": " fun"}]
    short = tooling.CallStream(may_call=True, must_call=False)
    assert short.feed("<") == [] and short.finish() == [{"content": "<"}]


def test_nothing_leaked_and_the_engine_is_intact(client, engine):
    assert_no_leak(client)
    engine.check_integrity()


# ---- retention: a client that will be back with its tools' results ---------------------------
def _retained(engine) -> int:
    return engine.stats()["retained_total"]


def test_a_chat_with_tools_retains_its_path_and_retain_s_says_how_long(oai, model, engine):
    before = _retained(engine)
    oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                tools=TOOLS, tool_choice="required", max_tokens=40)  # fmt: skip
    assert _retained(engine) == before + 1  # tools: kept for the client's next call by default
    oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                max_tokens=4)  # fmt: skip
    assert _retained(engine) == before + 1  # no tools, no retain_s: a plain path
    oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                max_tokens=4, extra_body={"retain_s": 5})  # fmt: skip
    assert _retained(engine) == before + 2
    oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                tools=TOOLS, max_tokens=4, extra_body={"retain_s": 0})  # fmt: skip
    assert _retained(engine) == before + 2  # 0: the client says it will not be back


def test_generate_takes_retain_s_and_refuses_a_bad_one(client, engine):
    before = _retained(engine)
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}, "retain_s": 10,
            "routing_key": "agent-7"}  # fmt: skip
    assert client.post("/generate", json=body).status_code == 200
    assert _retained(engine) == before + 1
    for bad in (-1, "10", 1e9):
        response = client.post("/generate", json=body | {"retain_s": bad})
        assert response.status_code == 400, response.text
        assert "retain_s" in response.text
    engine.release_retained("agent-7")
    assert_no_leak(client)
