"""Tracing programs into call graphs, rendering them, and replaying compiled programs."""

from __future__ import annotations

import pytest
from fake_backend import FakeBackend

import radixlang as sgl
from radixlang.lang.tracer import TracingError


@sgl.function
def tips(s, topic):
    s += sgl.user("Give two tips about " + topic)
    s += sgl.assistant_begin()
    s += "Tips:" + sgl.gen("outline", max_tokens=8)
    forks = s.fork(2)
    forks += lambda i: f"\nExpand tip {i + 1} of {s['outline']}:" + sgl.gen("detail")
    forks.join()
    s += "\nSummary of " + topic + ":" + sgl.gen("summary")
    s += sgl.assistant_end()


@sgl.function
def helper(s, x):
    s += "Helper " + x + sgl.gen("h")


@sgl.function
def caller(s):
    s += "Start. "
    helper(s, "arg")
    s += sgl.select("pick", choices=["yes", "no"])


def _reply(prompt, sampling):
    return f"[{len(prompt)}]"


def test_trace_records_nodes_and_edges_of_each_kind():
    graph = tips.trace(backend=FakeBackend())
    kinds = {n.kind for n in graph.nodes}
    assert {"text", "role", "gen", "fork", "join", "argument"} <= kinds
    assert [n.label for n in graph.nodes_of("gen")] == ["outline", "detail", "detail", "summary"]
    assert graph.num_chains == 3  # root + two branches
    assert len(graph.edges_of("fork")) == 2 and len(graph.edges_of("join")) == 2
    outline = graph.nodes_of("gen")[0].id
    data_from_outline = [e for e in graph.edges_of("data") if e.src == outline]
    assert len(data_from_outline) == 2  # both branches read the outline
    topic = graph.arguments["topic"]
    assert len([e for e in graph.edges_of("data") if e.src == topic]) == 2
    dot, mermaid = graph.to_dot(), graph.to_mermaid()
    assert dot.startswith("digraph") and dot.count("->") == len(graph.edges)
    assert "subgraph cluster_1" in dot
    assert mermaid.startswith("flowchart TD") and "==>|fork|" in mermaid and "-.->|data|" in mermaid


def test_trace_with_given_arguments_keeps_them_concrete():
    graph = tips.trace(topic="sleep")
    assert "topic" not in graph.arguments
    assert any("sleep" in n.label for n in graph.nodes)


def test_nested_calls_and_select_appear_in_the_trace():
    graph = caller.trace()
    assert [n.label for n in graph.nodes_of("call")] == ["helper"]
    assert [n.label for n in graph.nodes_of("return")] == ["helper"]
    assert len(graph.nodes_of("select")) == 1


def test_control_flow_on_a_generated_value_cannot_be_traced():
    @sgl.function
    def branchy(s):
        s += sgl.gen("x")
        if s["x"] == "yes":
            s += "!"

    with pytest.raises(TracingError, match="unknown when tracing"):
        branchy.trace()


def test_compiled_program_with_fork_matches_the_eager_run():
    eager = tips.run(topic="sleep", backend=FakeBackend(reply=_reply))
    compiled = tips.compile(backend=FakeBackend(reply=_reply))
    replay = compiled.run(topic="sleep")
    assert replay.text() == eager.text()
    assert replay["detail"] == eager["detail"] and replay["summary"] == eager["summary"]
    assert replay.messages() == eager.messages()
    batch = compiled.run_batch([{"topic": "a"}, {"topic": "b"}])
    assert [b.messages()[-2]["content"] for b in batch] == ["Give two tips about a",
                                                            "Give two tips about b"]  # fmt: skip


def test_compiled_program_checks_its_arguments():
    compiled = tips.compile(backend=FakeBackend())
    with pytest.raises(TypeError, match="missing"):
        compiled.run()
    with pytest.raises(TypeError, match="no arguments"):
        compiled.run(topic="x", other=1)


def test_tracing_a_program_that_reads_its_tool_calls_says_why_it_cannot():
    from radixlang.lang.tracer import TracingError

    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    @sgl.function
    def agent(s):
        s += sgl.user("2+2?")
        s += sgl.assistant(sgl.gen("step", tools=[add]))
        if s.tool_calls("step"):
            s += sgl.run_tools("step")

    with pytest.raises(TracingError, match=r"reads the tool calls of 'step' \(s.tool_calls\)"):
        agent.trace(backend=FakeBackend())
