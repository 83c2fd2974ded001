"""Programs report the call graph they ran (``run_graph.py``) to backends made with
``report_programs=True``: forks and joins as chains, each gen and select with its cache
figures, Python that branches on generated values, streamed, compiled and async runs, failures;
and ``RuntimeEndpoint`` posts it to the server, where the dashboard lists it."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from fake_backend import FakeBackend

import radixlang as sgl
from radixlang.lang.backends.endpoint import RuntimeEndpoint


class ReportingBackend(FakeBackend):
    report_programs = True

    def __init__(self, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(**kwargs)
        self.reports: list[tuple[str, dict, str]] = []

    def generate(self, prompt, sampling):  # type: ignore[no-untyped-def]
        text, meta = super().generate(prompt, sampling)
        return text, {**meta, "cached_tokens": len(prompt) // 2, "completion_tokens": len(text)}

    def report_program(self, name: str, graph: dict, status: str) -> None:
        self.reports.append((name, graph, status))


@sgl.function
def ideas(s, topic):
    s += "Ideas about " + topic + ".\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Idea {i}: " + sgl.gen("idea", max_tokens=4)
    forks.join()
    s += "Best: " + sgl.select("best", choices=["0", "1", "2"])


def _kinds(graph: dict) -> list[str]:
    return [n["kind"] for n in graph["nodes"]]


def test_a_forked_program_reports_its_chains_and_cache_figures():
    backend = ReportingBackend()
    ideas.run(topic="tea", backend=backend)
    ((name, graph, status),) = backend.reports
    assert name == "ideas" and status == "finished"
    kinds = _kinds(graph)
    assert kinds.count("fork") == 1 and kinds.count("join") == 1 and kinds.count("gen") == 3
    assert kinds.count("select") == 1
    gens = [n for n in graph["nodes"] if n["kind"] == "gen"]
    assert sorted(n["chain"] for n in gens) == [1, 2, 3]  # one per branch
    for n in gens:
        assert n["prompt_tokens"] > n["cached_tokens"] > 0 and n["completion_tokens"] > 0
    by_id = {n["id"]: n for n in graph["nodes"]}
    edges = {(by_id[e["src"]]["kind"], by_id[e["dst"]]["kind"], e["kind"]) for e in graph["edges"]}
    assert ("fork", "text", "fork") in edges  # each branch starts from the fork
    assert ("gen", "join", "join") in edges  # and comes back at the join
    texts = [n["label"] for n in graph["nodes"] if n["kind"] == "text" and n["chain"] == 0]
    assert texts[0] == "Ideas about tea.\\n"  # consecutive texts merge into one step


@sgl.function
def until_yes(s):
    s += "Ask: " + sgl.gen("a", max_tokens=2)
    while s["a"] != "<3>":  # Python that reads generated values: a trace cannot follow it
        s += " again: " + sgl.gen("a", max_tokens=2)


def test_python_that_branches_on_generated_values_is_drawn_as_it_ran():
    backend = ReportingBackend()
    until_yes.run(backend=backend)
    ((_, graph, _),) = backend.reports
    assert _kinds(graph).count("gen") == 3  # "<1>", "<2>", "<3>"


def test_streamed_compiled_and_async_runs_report_once_finished():
    backend = ReportingBackend()
    backend.stream_delay = 0.001
    # Each run's report is waited for before the next run starts: a streamed run reports from
    # its own thread, whenever that gets to it, so the order would otherwise be the machine's.
    state = ideas.run(topic="x", backend=backend, stream=True)
    list(state.text_iter())
    state.sync()
    _wait_for(lambda: len(backend.reports) == 1)
    ideas.compile(backend=backend).run(topic="y")
    _wait_for(lambda: len(backend.reports) == 2)

    @sgl.function
    async def short(s):
        s += "Hi " + sgl.gen("x", max_tokens=2)

    asyncio.run(short.run_async(backend=backend))
    _wait_for(lambda: len(backend.reports) == 3)
    assert [r[0] for r in backend.reports] == ["ideas", "ideas", "short"]
    assert all(r[2] == "finished" for r in backend.reports)
    assert _kinds(backend.reports[1][1]).count("gen") == 3  # the compiled replay, forks too


def _wait_for(condition) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_failed_run_reports_why():
    backend = ReportingBackend()
    backend.fail_on = "Idea 1"
    with pytest.raises(ValueError):
        ideas.run(topic="tea", backend=backend)
    ((_, graph, status),) = backend.reports
    assert status.startswith("failed: ValueError") and "Idea 1" in status
    assert _kinds(graph).count("fork") == 1


def test_backends_that_do_not_report_record_nothing():
    backend = FakeBackend()
    state = ideas.run(topic="tea", backend=backend)
    assert state.executor.recorder is None


def test_runtime_endpoint_posts_the_graph_and_a_refusal_only_warns(tiny_runtime, caplog):
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(tiny_runtime.engine) as server:
        backend = RuntimeEndpoint(server.url, report_programs=True)
        before = httpx.get(server.url + "/dashboard/api/programs").json()["version"]
        ideas.run(topic="tea", backend=backend)
        listed = httpx.get(server.url + "/dashboard/api/programs").json()
        backend.shutdown()
    assert listed["version"] == before + 1
    program = listed["programs"][-1]
    assert program["name"] == "ideas" and program["status"] == "finished"
    select = next(n for n in program["graph"]["nodes"] if n["kind"] == "select")
    assert select["prompt_tokens"] > 0 and select["cached_tokens"] > 0  # scored over the cache

    def no_dashboard(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m"})
        if request.url.path == "/generate":
            return httpx.Response(200, json={"text": "ok", "meta_info": {}})
        return httpx.Response(404, json={"error": {"message": "Not Found"}})

    quiet = RuntimeEndpoint("http://sglang", transport=httpx.MockTransport(no_dashboard),
                            report_programs=True)  # fmt: skip

    @sgl.function
    def one(s):
        s += "Q: " + sgl.gen("a", max_tokens=2)

    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert one.run(backend=quiet)["a"] == "ok"
    warnings = [r for r in caplog.records if "could not report program" in r.message]
    assert len(warnings) == 1  # once, not per program


def test_a_local_runtime_reports_to_the_engine_a_server_shares(tiny_runtime):
    from radixlang.lang.backends.local import LocalBackend

    backend = LocalBackend(tiny_runtime.engine, report_programs=True)
    before = tiny_runtime.engine.programs.version
    ideas.run(topic="tea", backend=backend)
    assert tiny_runtime.engine.programs.version == before + 1
    program = tiny_runtime.engine.programs.programs()[-1]
    gens = [n for n in program["graph"]["nodes"] if n["kind"] == "gen"]
    assert len(gens) == 3 and all(n["cached_tokens"] > 0 for n in gens)  # the shared prefix


def test_tool_calls_are_nodes_of_their_own_with_their_latency():
    import time

    def lookup(city: str) -> str:
        """Look a city up."""
        time.sleep(0.05)
        return f"{city}: sunny"

    call = '<tool_call>[{"name": "lookup", "arguments": {"city": "Oslo"}}]</tool_call>'
    backend = ReportingBackend(reply=lambda prompt, sampling: "done" if "sunny" in prompt else call)

    @sgl.function
    def agent(s):
        s += sgl.user("Weather?")
        s += sgl.assistant(sgl.gen("step", tools=[lookup]))
        s += sgl.run_tools("step")
        s += sgl.assistant(sgl.gen("answer"))

    state = agent.run(backend=backend)
    # The tool's result reached the answer's prompt (else the model would have called again).
    (_, step_prompt, _), (_, answer_prompt, _) = backend.calls
    assert "Oslo: sunny" not in step_prompt and "Oslo: sunny" in answer_prompt
    assert state["answer"] == "done"
    ((_, graph, status),) = backend.reports
    assert status == "finished"
    (tool,) = [n for n in graph["nodes"] if n["kind"] == "tool"]
    assert tool["label"] == "lookup" and tool["latency_ms"] >= 50
    gens = {n["label"]: n["id"] for n in graph["nodes"] if n["kind"] == "gen"}
    assert gens["step [tools]"] < tool["id"] < gens["answer"]
    # The trace of the same program draws the tool step too, fed by the gen's value.
    traced = agent.trace(backend=FakeBackend())
    (traced_tool,) = traced.nodes_of("tool")
    assert traced_tool.label == "run_tools(step)"
    step = next(n for n in traced.nodes_of("gen") if n.label.startswith("step"))
    assert any(e.src == step.id and e.dst == traced_tool.id for e in traced.edges_of("data"))
