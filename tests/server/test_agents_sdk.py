"""A real agent client: the OpenAI Agents SDK (``openai-agents``), through its default model
class (the Responses API) and its chat-completions one, runs an agent with two function tools
against ``radixlang serve`` on the default model, to its final answer."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served():
    from radixlang.runtime.engine import Engine
    from radixlang.server.app import serve_in_thread

    engine = Engine(deterministic=True)
    try:
        with serve_in_thread(engine) as server:
            yield engine, server
    finally:
        engine.shutdown()


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_agents_sdk_agent_calls_a_tool_and_answers(served, api):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no traces sent anywhere
    ran: list[tuple[str, object]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        ran.append(("get_weather", city))
        return f"It is 18 degrees Celsius and sunny in {city}."

    @function_tool
    def celsius_to_fahrenheit(celsius: float) -> float:
        """Convert a temperature from Celsius to Fahrenheit."""
        ran.append(("celsius_to_fahrenheit", celsius))
        return celsius * 9 / 5 + 32

    engine, server = served
    engine.reset_stats()
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(
        name="weather",
        instructions="You answer weather questions using the tools.",
        tools=[get_weather, celsius_to_fahrenheit],
        model=kind(model=engine.files.name, openai_client=client),
        # The first turn must call a tool; the SDK then resets the choice to auto, so the model
        # answers once it has read the tool's output.
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80),
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=6))
    stats = engine.stats()
    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    outputs = [item.raw_item for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert calls and len(outputs) == len(calls)
    for call, output in zip(calls, outputs, strict=True):
        assert call.name in ("get_weather", "celsius_to_fahrenheit")
        arguments = json.loads(call.arguments)  # the server's grammar: valid JSON arguments
        assert (call.name, next(iter(arguments.values()))) in ran
        assert output["call_id"] == call.call_id
    assert isinstance(result.new_items[-1], MessageOutputItem)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    # Every turn after the first extended the conversation before it: it came from the cache.
    assert stats["prompt_tokens_reused"] > 0
