"""Tools in programs on every backend: ``gen(tools=...)``, ``s.tool_calls``, ``run_tools`` and
the ``tool`` role, on the local engine, over HTTP (``RuntimeEndpoint``) and through the
OpenAI backend (chat, sent as ``tools``), all on the tiny random-weight chat model, whose
sampled calls are held to valid ones by the grammar alone."""

from __future__ import annotations

import json
import threading
import time
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

import radixlang as sgl
from radixlang.lang.backends.endpoint import RuntimeEndpoint
from radixlang.lang.backends.openai import OpenAI
from radixlang.lang.tools import as_tool

Small = Annotated[int, Field(ge=-9999, le=9999)]  # a random model's integers end in time


def add(a: Small, b: Small) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


class Weather(BaseModel):
    """Look up the weather of a city."""

    city: str = Field(max_length=12, description="the city")
    unit: Literal["celsius", "fahrenheit"] = "celsius"


async def slow_echo(word: str = Field(max_length=8)) -> str:
    """Echo a word after a while."""
    return word


TOOLS = [add, Weather, slow_echo]


def assert_idle_and_intact(engine) -> None:
    """Every request ended, no KV block held by one, and the pool and cache consistent."""
    deadline = time.monotonic() + 10
    while True:
        stats = engine.stats()
        if stats["running_requests"] == 0 and stats["waiting_requests"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.02)
    assert stats["blocks_used"] == stats["blocks_evictable"], stats
    engine.check_integrity()


@sgl.function
def one_step(s, question, choice="required", parallel=True):
    s += sgl.user(question)
    s += sgl.assistant(
        sgl.gen("step", tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                max_tokens=96)
    )  # fmt: skip


def _valid(calls) -> None:
    by_name = {t.name: t for t in map(as_tool, TOOLS)}
    assert calls, "a required tool choice always calls"
    for call in calls:
        by_name[call.name].arguments.model_validate(call.arguments)  # raises if invalid
        assert call.id.startswith("call_")


def test_a_hundred_sampled_calls_all_parse_and_validate(local, engine):
    states = one_step.run_batch(
        [{"question": f"Question {i}?"} for i in range(100)],
        backend=local,
        temperature=1.0,
        parallel=False,
    )
    names = set()
    for state in states:
        calls = state.tool_calls("step")
        assert len(calls) == 1  # parallel_tool_calls=False: one call per answer
        _valid(calls)
        names.add(calls[0].name)
        assert state["step"].startswith("<tool_call>[")
        assert state.messages()[-1]["tool_calls"][0]["id"] == calls[0].id
    assert len(names) >= 2  # temperature 1.0 wanders over the tools
    assert_idle_and_intact(engine)


def test_auto_may_answer_in_text_and_none_never_calls(local, engine):
    states = one_step.run_batch(
        [{"question": f"Q{i}", "choice": "auto"} for i in range(20)], backend=local,
        temperature=1.0,
    )  # fmt: skip
    for state in states:
        calls = state.tool_calls("step")
        if calls:
            _valid(calls)
        else:
            assert not state["step"].startswith("<tool_call>")
    plain = one_step.run(question="Q", choice="none", backend=local, temperature=0)
    assert plain.tool_calls("step") == []
    assert "<tools>" not in plain.text()  # no tools shown when none may be called
    assert_idle_and_intact(engine)


def test_a_named_tool_is_the_one_called_and_every_tool_is_still_shown(local):
    state = one_step.run(question="Weather?", choice="Weather", backend=local, temperature=1.0)
    calls = state.tool_calls("step")
    assert calls and all(c.name == "Weather" for c in calls)
    system = state.messages()[0]["content"]
    assert all(f'"name": "{name}"' in system for name in ("add", "Weather", "slow_echo"))


@sgl.function
def agent(s, question, steps=3):
    s += sgl.system("You are a careful agent.")
    s += sgl.user(question)
    for i in range(steps):
        # A random model would answer in text at once: the first step must call.
        choice = "required" if i == 0 else "auto"
        s += sgl.assistant(sgl.gen("step", tools=TOOLS, tool_choice=choice, max_tokens=64))
        if not s.tool_calls("step"):
            break
        s += sgl.run_tools("step", timeout=5)


def test_an_agent_loop_runs_its_tools_and_shows_the_results_as_tool_turns(local, engine):
    state = agent.run(question="What is 2 + 3?", backend=local, temperature=1.0, seed=7)
    tool_turns = [m for m in state.messages() if m["role"] == "tool"]
    results = state.tool_results("step")
    assert results and not any(r.is_error for r in results)
    assert tool_turns[-len(results) :] == [
        {"role": "tool", "content": r.content, "tool_call_id": r.call_id, "name": r.name}
        for r in results
    ]
    # The template's own tool role renders each result (SmolLM2's: <|im_start|>tool).
    assert "<|im_start|>tool\n" + results[0].content in state.text()
    # The tools are described once, in the system message the program wrote.
    assert state.text().count("<tools>") == 1
    assert state.messages()[0]["content"].startswith("You are a careful agent.\n\nYou can call")
    assert_idle_and_intact(engine)


def test_each_step_of_an_agent_reuses_the_whole_prompt_before_it(local):
    @sgl.function
    def two_steps(s):
        s += sgl.user("Add 20 and 22.")
        for i in range(2):
            # add's calls: digits, which the tokenizer reads back as the tokens they were
            # sampled as (a random model's free text need not be).
            s += sgl.assistant(sgl.gen(f"step{i}", tools=[add], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=64))  # fmt: skip
            s += sgl.run_tools(f"step{i}")

    state = two_steps.run(backend=local, temperature=1.0, seed=3)
    first, second = state.get_meta_info("step0"), state.get_meta_info("step1")
    assert state.tool_calls("step0") and state.tool_calls("step1")
    # The second step's prompt extends the first's prompt and answer: the first prompt and
    # most of the answer came from the cache (not the answer's last tokens: a random model
    # may spell the block's end with other tokens than the text's own tokenization).
    assert first["finish_reason"]["type"] == "stop"
    assert second["cached_tokens"] >= first["prompt_tokens"] + first["completion_tokens"] // 2


def test_parallel_tool_use_in_forks(local, engine):
    @sgl.function
    def team(s):
        s += sgl.system("Workers.")
        s += sgl.user("Each of you: use a tool.")
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += sgl.assistant(sgl.gen("work", tools=TOOLS, tool_choice="required",
                                       max_tokens=64, seed=i))  # fmt: skip
            f += sgl.run_tools("work")
        forks.join()

    state = team.run(backend=local, temperature=1.0)
    per_fork = state.tool_calls("work")
    assert len(per_fork) == 3 and all(calls for calls in per_fork)
    for calls in per_fork:
        _valid(calls)
    assert_idle_and_intact(engine)


def test_tools_over_http_give_what_the_local_engine_gives(server, local):
    endpoint = RuntimeEndpoint(server.url)
    try:
        for seed in range(3):
            here = one_step.run(question="Hi", backend=local, temperature=1.0, seed=seed)
            there = one_step.run(question="Hi", backend=endpoint, temperature=1.0, seed=seed)
            assert there["step"] == here["step"]
            assert [(c.name, c.arguments) for c in there.tool_calls("step")] == [
                (c.name, c.arguments) for c in here.tool_calls("step")
            ]
    finally:
        endpoint.shutdown()


def test_tools_through_the_openai_backend_are_sent_as_tools(server, engine):
    backend = OpenAI(engine.files.name, base_url=server.url + "/v1", api_key="none")
    try:
        state = agent.run(question="What is 2 + 3?", backend=backend, temperature=1.0, seed=5)
    finally:
        backend.shutdown()
    messages = state.messages()
    calls = [m for m in messages if m.get("tool_calls")]
    assert calls, messages  # the server's grammar made the first answer a valid call or text
    first = calls[0]["tool_calls"][0]
    assert first["id"].startswith("call_") and first["type"] == "function"
    json.loads(first["function"]["arguments"])
    results = [m for m in messages if m["role"] == "tool"]
    assert results and results[0]["tool_call_id"] == first["id"]
    assert_idle_and_intact(engine)


def test_a_failing_and_a_timing_out_tool_become_error_results_and_the_program_goes_on(local):
    # sleepy outlasts any timeout (it waits for the test's end); the timeout is seconds, so
    # broken's failure is what comes back for it even on a loaded machine.
    release = threading.Event()

    def broken(x: int) -> int:
        """Always fails."""
        raise RuntimeError("disk on fire")

    def sleepy(x: int) -> int:
        """Never answers in time."""
        release.wait(60)
        return x

    @sgl.function
    def prog(s):
        s += sgl.user("Go.")
        s += sgl.assistant(sgl.gen("step", tools=[broken, sleepy], tool_choice="required",
                                   max_tokens=64))  # fmt: skip
        s += sgl.run_tools("step", timeout=3)
        s += sgl.assistant(sgl.gen("after", max_tokens=4))

    try:  # (seed 5: the model calls both tools here)
        state = prog.run(backend=local, temperature=1.0, seed=5)
    finally:
        release.set()
    results = state.tool_results("step")
    assert results and all(r.is_error for r in results)
    for r in results:
        assert ("disk on fire" in r.content) if r.name == "broken" else ("timed out" in r.content)
        assert r.content in state.text()  # the model reads the error
    assert isinstance(state["after"], str)


def test_bad_tool_arguments_are_refused_where_the_program_names_them():
    with pytest.raises(ValueError, match="tool_choice='required' needs tools"):
        sgl.gen("x", tool_choice="required")
    with pytest.raises(ValueError, match="the name of one of the tools"):
        sgl.gen("x", tools=[add], tool_choice="multiply")
    with pytest.raises(ValueError, match="cannot be combined with regex"):
        sgl.gen("x", tools=[add], regex="a+")
    with pytest.raises(ValueError, match="n=1"):
        sgl.gen("x", tools=[add], n=2)
    with pytest.raises(ValueError, match="two tools are named"):
        sgl.gen("x", tools=[add, add])
    with pytest.raises(TypeError, match="a tool is a function"):
        sgl.gen("x", tools=[42])
