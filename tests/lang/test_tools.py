"""Tools from Python functions and pydantic models, and running a model's calls: at once,
async ones awaited, and every failure (unknown tool, bad arguments, an exception, a timeout)
an error result the program goes on with; a result is a tool turn the next gen's prompt holds."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Literal

import pytest
from fake_backend import FakeBackend
from pydantic import BaseModel

import radixlang as sgl
from radixlang.lang.chat_template import TOOL_RESPONSE
from radixlang.lang.tools import Tool, ToolCall, as_tool, run_tool_calls


def convert(value: float, unit: Literal["km", "mi"] = "km", precision: int = 2) -> str:
    """Convert a distance to the other unit.

    Args:
        value: the distance, in ``unit``
        unit: the unit of ``value``; the answer is
            in the other one
        precision: digits after the point
    """
    factor = 0.621371 if unit == "km" else 1 / 0.621371
    return f"{value * factor:.{precision}f}"


class Weather(BaseModel):
    """The weather to report for a city."""

    city: str
    celsius: float


def test_a_function_becomes_a_tool_with_its_schema_and_docs():
    tool = as_tool(convert)
    assert tool.name == "convert" and tool.description == "Convert a distance to the other unit."
    props = tool.parameters["properties"]
    assert props["value"] == {"type": "number", "description": "the distance, in ``unit``"}
    assert props["unit"]["enum"] == ["km", "mi"] and props["unit"]["default"] == "km"
    assert props["unit"]["description"] == "the unit of ``value``; the answer is in the other one"
    assert tool.parameters["required"] == ["value"]
    assert tool.openai()["function"]["parameters"] is tool.parameters
    assert as_tool(tool) is tool


def test_a_pydantic_model_is_a_tool_that_returns_the_validated_model():
    tool = as_tool(Weather)
    assert tool.name == "Weather" and tool.description == "The weather to report for a city."
    assert set(tool.parameters["required"]) == {"city", "celsius"}
    [result] = run_tool_calls([ToolCall("Weather", {"city": "Oslo", "celsius": -3})], [Weather])
    assert not result.is_error and json.loads(result.content) == {"city": "Oslo", "celsius": -3.0}


@pytest.mark.parametrize(
    "fn, message",
    [
        (lambda x: x, "needs name="),
        (lambda *args: 0, "needs name="),
    ],
)
def test_tools_that_cannot_be_described_are_refused(fn, message):
    with pytest.raises(TypeError, match=message):
        as_tool(fn)


def test_var_args_and_bad_names_are_refused():
    def spread(*values: int) -> int:
        return sum(values)

    with pytest.raises(TypeError, match="cannot be given by name"):
        as_tool(spread)
    with pytest.raises(ValueError, match="tool name"):
        as_tool(convert, name="has space")
    with pytest.raises(ValueError, match="two tools are named"):
        run_tool_calls([], [convert, convert])


def test_calls_run_at_once_and_results_keep_their_order():
    both_running = threading.Barrier(2, timeout=10)  # passes only if two calls run together

    def meet(tag: str) -> str:
        both_running.wait()
        return tag

    calls = [ToolCall("meet", {"tag": "a"}, id="1"), ToolCall("meet", {"tag": "b"}, id="2")]
    results = run_tool_calls(calls, [meet], timeout=20)
    assert [(r.call_id, r.content, r.is_error) for r in results] == [
        ("1", "a", False),
        ("2", "b", False),
    ]


def test_async_tools_are_awaited_and_values_become_json():
    async def lookup(key: str) -> dict:
        await asyncio.sleep(0)
        return {"key": key, "found": True}

    [result] = run_tool_calls([ToolCall("lookup", {"key": "k"})], [lookup])
    assert json.loads(result.content) == {"key": "k", "found": True} and not result.is_error


def test_every_failure_is_an_error_result_and_the_others_still_answer():
    # The stuck tools outlast any timeout (the thread one waits for the test's end); the
    # timeout is seconds, so the quick calls answer within it even on a loaded machine.
    release = threading.Event()

    def broken(x: int) -> int:
        raise RuntimeError("disk on fire")

    def stuck() -> str:
        release.wait(60)
        return "late"

    async def stuck_async() -> str:
        await asyncio.sleep(60)  # cancelled at the timeout
        return "late"

    calls = [
        ToolCall("convert", {"value": 10}),
        ToolCall("broken", {"x": 1}),
        ToolCall("convert", {"value": "ten"}),
        ToolCall("nowhere", {}),
        ToolCall("stuck", {}),
        ToolCall("stuck_async", {}),
        ToolCall("convert", {"unit": "km"}),
    ]
    try:
        results = run_tool_calls(calls, [convert, broken, stuck, stuck_async], timeout=3)
    finally:
        release.set()
    ok, failed, bad, unknown, slow, slow_async, missing = results
    assert (ok.content, ok.is_error) == ("6.21", False)
    assert failed.is_error and "RuntimeError: disk on fire" in failed.content
    assert bad.is_error and "invalid arguments: value:" in bad.content
    assert unknown.is_error and "no tool named 'nowhere'" in unknown.content
    assert slow.is_error and "timed out after 3 s" in slow.content
    assert slow_async.is_error and "timed out after 3 s" in slow_async.content
    assert missing.is_error and "value: Field required" in missing.content


def test_a_bad_timeout_is_refused():
    with pytest.raises(ValueError, match="timeout"):
        run_tool_calls([ToolCall("convert", {"value": 1})], [convert], timeout=0)
    assert isinstance(as_tool(convert), Tool)


def test_a_tools_result_is_in_the_next_gens_prompt_and_in_the_state():
    def lookup(city: str) -> str:
        """Look a city up."""
        return f"RESULT-7f3a from {city}"

    call = '<tool_call>[{"name": "lookup", "arguments": {"city": "Oslo"}}]</tool_call>'
    replies = iter([call, "It is RESULT-free."])
    backend = FakeBackend(reply=lambda prompt, sampling: next(replies))

    @sgl.function
    def agent(s):
        s += sgl.user("Weather?")
        s += sgl.assistant(sgl.gen("step", tools=[lookup]))
        s += sgl.run_tools("step")
        s += sgl.assistant(sgl.gen("answer"))

    state = agent.run(backend=backend)
    (_, first, _), (_, second, _) = backend.calls
    [result] = state.tool_results("step")
    assert result.content == "RESULT-7f3a from Oslo" and not result.is_error
    assert "RESULT-7f3a" not in first
    # The next gen's prompt: the first prompt, the call, then the result as a tool turn (this
    # template has no tool role: a user turn, marked), then the assistant's turn opening.
    tool_turn = TOOL_RESPONSE[0] + "RESULT-7f3a from Oslo" + TOOL_RESPONSE[1]
    assert second.startswith(first + call)
    assert tool_turn in second[len(first + call) :]
    assert second.endswith(tool_turn + "<|im_end|>\n<|im_start|>assistant\n")
    assert state.text() == second + "It is RESULT-free.<|im_end|>\n"
    tool_messages = [m for m in state.messages() if m["role"] == "tool"]
    assert tool_messages == [{"role": "tool", "content": "RESULT-7f3a from Oslo",
                              "tool_call_id": result.call_id, "name": "lookup"}]  # fmt: skip
