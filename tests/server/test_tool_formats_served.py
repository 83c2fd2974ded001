"""A model whose template writes Hermes/Qwen calls (its tokenizer holding <tool_call> as a token
of its own, as Qwen's does), served: chat completions answer in its format, whole and streamed
alike, with text before a call in ``auto``; the calls written back as history render as the
template writes them; the Responses API reads the same calls."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from server_checks import assert_no_leak, chat_prompt_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "constrain"))
from tool_templates import HERMES

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}}  # fmt: skip
SCHEMA = WEATHER["function"]["parameters"]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from radixlang.runtime.engine import Engine
    from radixlang.server.app import serve_in_thread
    from radixlang.testing import write_tiny_chat_model

    folder = write_tiny_chat_model(tmp_path_factory.mktemp("hermes-model"), extra_tokens=8)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = HERMES
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(HERMES)
    engine = Engine(str(folder), kv_memory="32MiB", deterministic=True)
    try:
        with serve_in_thread(engine) as server:
            yield engine, server
    finally:
        engine.shutdown(free_cache=True)


def _oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _bias(engine) -> dict[str, float]:
    """Biases that make the random model write text, then a newline and the marker."""
    marker = engine.tokenizer.convert_tokens_to_ids("<tool_call>")
    newline = engine.tokenizer.encode("\n", add_special_tokens=False)[0]
    return {str(marker): 15.0, str(newline): 15.0}


def _streamed(oai, **kwargs):
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for item in c.delta.tool_calls or []:
                if item.index not in calls:
                    calls[item.index] = [item.function.name, item.function.arguments or ""]
                else:
                    calls[item.index][1] += item.function.arguments or ""
    return content, [tuple(v) for _, v in sorted(calls.items())], finish


def test_the_format_is_read_off_the_template_with_its_marker_token(served):
    engine, _ = served
    fmt = engine.tool_format
    assert fmt.name == "template" and fmt.head.startswith("<tool_call>\n{")
    assert [marker for marker, _ in fmt.special] == ["</tool_call>", "<tool_call>"]


def test_auto_writes_text_then_calls_whole_and_streamed_alike(served):
    engine, server = served
    oai = _oai(server)
    seen_text_first = 0
    for seed in range(12):
        kwargs = dict(model=engine.files.name, messages=MESSAGES, tools=[WEATHER],
                      temperature=1.0, seed=seed, max_tokens=120, parallel_tool_calls=False,
                      logit_bias=_bias(engine))  # fmt: skip
        whole = oai.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = _streamed(oai, **kwargs)
        assert finish == whole.finish_reason
        assert content == (whole.message.content or "")
        got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        assert calls == got
        if got:
            assert whole.finish_reason == "tool_calls"
            jsonschema.validate(json.loads(got[0][1]), SCHEMA)
            seen_text_first += bool(content)
            assert "<tool_call>" not in content
    assert seen_text_first >= 2


def test_calls_in_the_history_render_as_the_template_writes_them(served):
    engine, server = served
    oai = _oai(server)
    first = oai.chat.completions.create(model=engine.files.name, messages=MESSAGES,
                                        tools=[WEATHER], tool_choice="required",
                                        max_tokens=80)  # fmt: skip
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = [*MESSAGES, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "21 C"}]  # fmt: skip
    second = oai.chat.completions.create(model=engine.files.name, messages=history,
                                         tools=[WEATHER], max_tokens=8)  # fmt: skip
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The server's prompt for that history holds the call as the template writes it: the
    # model's own format, arguments as an object.
    prompt = engine.tokenizer.decode(chat_prompt_ids(engine, engine.files.name, history, [WEATHER]))
    name, arguments = call.function.name, call.function.arguments
    assert f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>' in prompt
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert_no_leak(client)


def test_the_responses_api_reads_the_same_calls(served):
    engine, server = served
    oai = _oai(server)
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}  # fmt: skip
    out = oai.responses.create(model=engine.files.name, input="Weather in Paris?", tools=[tool],
                               tool_choice="required", max_output_tokens=80)  # fmt: skip
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)


@pytest.mark.parametrize("where", ["local", "endpoint"])
def test_a_program_calls_tools_in_the_models_format(served, where):
    """gen(tools=...) on the local engine and through RuntimeEndpoint (which reads the format,
    marker tokens and all, from the server's /get_model_info): the program's text holds the
    call as the model writes it, run_tools reads it, the result goes back as a tool turn."""
    import radixlang as rl
    from radixlang.lang.backends.endpoint import RuntimeEndpoint
    from radixlang.lang.backends.local import LocalBackend

    engine, server = served
    backend = LocalBackend(engine) if where == "local" else RuntimeEndpoint(server.url)
    assert backend.get_chat_template().tool_format == engine.tool_format

    def get_weather(city: Literal["Paris", "Oslo"], unit: Literal["c", "f"]) -> str:
        """The weather in a city."""
        return f"RESULT-31 in {city} ({unit})"

    @rl.function
    def agent(s):
        s += rl.user("Weather in Paris?")
        s += rl.assistant(rl.gen("step", tools=[get_weather], tool_choice="required",
                                 max_tokens=80))  # fmt: skip
        s += rl.run_tools("step")

    state = agent.run(backend=backend)
    (call,) = state.tool_calls("step")
    assert call.name == "get_weather"
    assert state["step"].startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    assert f"RESULT-31 in {call.arguments['city']}" in state.text()
    assistant = next(m for m in state.messages() if m["role"] == "assistant")
    assert assistant["content"] == "" and assistant["tool_calls"]


def test_the_messages_api_answers_tool_use_in_the_models_format(served):
    """Anthropic's Messages API on the same model: the call a tool_use block, whole and
    streamed alike."""
    import anthropic

    engine, server = served
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "description": "The weather in a city.",
            "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip
    kwargs = dict(model=engine.files.name, max_tokens=120, messages=MESSAGES, tools=[tool],
                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                  extra_body={"temperature": 0})  # fmt: skip
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    (use,) = whole.content
    assert use.type == "tool_use" and whole.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMA)
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        (use.type, use.name, use.input)
    ]


def test_answer_parts_read_text_then_calls_in_the_format(served):
    """The parts the Responses and Messages APIs answer in: the text before the calls, then
    each call, fed whole or a few characters at a time."""
    from radixlang.server import tools as tooling
    from radixlang.server.answer_parts import AnswerParts, whole_answer

    engine, _ = served
    choice = tooling.parse_tool_choice("auto", tooling.parse_tools([WEATHER]), engine.tool_format)
    arguments = {"city": "Paris", "unit": "c"}
    output = "Let me check.\n" + engine.tool_format.render([("get_weather", arguments)] * 2)
    whole = whole_answer(output, choice, ("msg", "fc"))
    assert [(p.kind, p.text, p.name) for p in whole.parts] == [
        ("text", "Let me check.", ""),
        ("call", json.dumps(arguments), "get_weather"),
        ("call", json.dumps(arguments), "get_weather"),
    ]
    streamed = AnswerParts(choice, ("msg", "fc"))
    for i in range(0, len(output), 3):
        streamed.feed(output[i : i + 3])
    streamed.finish()
    assert [(p.kind, p.text) for p in streamed.parts] == [(p.kind, p.text) for p in whole.parts]
    assert streamed.called
