"""/load, /run and /graph without a terminal: loading files, checking arguments, a streamed run
whose forked gens arrive labelled, a stopped run that leaves nothing held."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from radixlang.lang.backends.local import LocalBackend
from radixlang.repl.programs import (
    ProgramError,
    ProgramRun,
    ProgramStopped,
    check_arguments,
    load_programs,
    trace,
)

ROOT = Path(__file__).resolve().parents[2]

PROGRAMS = """
import radixlang as sgl

@sgl.function
def pair(s, topic, tokens=12):
    s += sgl.user(f"Two words about {topic}.")
    s += sgl.assistant(sgl.gen("first", max_tokens=tokens))
    forks = s.fork(2)
    forks += lambda i: sgl.user(f"Variant {i}?")
    forks += lambda i: sgl.assistant(sgl.gen("variant", max_tokens=tokens))
    forks.join()

@sgl.function
def endless(s):
    s += sgl.user("Go on forever.")
    s += sgl.assistant(sgl.gen("story", max_tokens=900, temperature=0))

not_a_program = 3
"""


@pytest.fixture()
def programs(tmp_path):
    path = tmp_path / "progs.py"
    path.write_text(PROGRAMS)
    return load_programs(path)


def test_load_finds_the_function_programs(programs, tmp_path):
    assert sorted(programs) == ["endless", "pair"]
    assert sorted(load_programs(ROOT / "examples" / "fork_join.py")) == ["tips"]
    (tmp_path / "empty.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("raise ValueError('bad config')\n")
    (tmp_path / "notes.txt").write_text("")
    for path, message in [
        (tmp_path / "missing.py", "no such file"),
        (tmp_path / "notes.txt", r"not a Python file \(.py\)"),
        (tmp_path / "empty.py", "defines no @function programs"),
        (tmp_path / "broken.py", "importing .* failed: ValueError: bad config"),
    ]:
        with pytest.raises(ProgramError, match=message):
            load_programs(path)


def test_arguments_are_checked_before_running(programs):
    pair = programs["pair"]
    check_arguments(pair, {"topic": "tea"})
    check_arguments(pair, {"topic": "tea", "temperature": 0.2})  # a run default
    with pytest.raises(ProgramError, match=r"pair needs topic=\.\.\."):
        check_arguments(pair, {})
    with pytest.raises(ProgramError, match="pair has no argument colour: it takes topic, tokens"):
        check_arguments(pair, {"topic": "tea", "colour": "red"})
    check_arguments(pair, {}, tracing=True)  # missing arguments stay symbolic in a trace


class PollGate:
    """Holds each stream's next piece until the test has polled the run twice since the last
    one arrived, so a whole poll (``new_pieces``) falls between any two: each piece is then
    read by a poll of its own, however the threads are scheduled. A stream held 30 s (polls
    that stopped) opens the gate for good, so a broken run fails a test rather than hangs it."""

    def __init__(self) -> None:
        self.polls = 0
        self.open = False
        self._cond = threading.Condition()

    def polled(self) -> None:
        with self._cond:
            self.polls += 1
            self._cond.notify_all()

    def hold(self) -> None:
        with self._cond:
            seen = self.polls
            if not self.open and not self._cond.wait_for(lambda: self.polls >= seen + 2, 30):
                self.open = True


class GatedBackend(LocalBackend):
    """The engine's stream, each piece handed on after the executor took the one before (the
    generator resumes only then) and the gate let it through."""

    def __init__(self, engine, gate: PollGate) -> None:  # type: ignore[no-untyped-def]
        super().__init__(engine)
        self.gate = gate

    def generate_stream(self, prompt, sampling):  # type: ignore[no-untyped-def]
        for item in super().generate_stream(prompt, sampling):
            yield item
            self.gate.hold()


def run_to_end(run: ProgramRun, gate: PollGate | None = None, timeout: float = 120.0) -> list:
    pieces = []
    deadline = time.monotonic() + timeout
    while not run.wait(0.005):
        assert time.monotonic() < deadline
        pieces += run.new_pieces()
        if gate is not None:
            gate.polled()
    return pieces + run.new_pieces()


def test_a_run_streams_every_gen_labelled_by_branch(programs, local_chat):
    defaults = {"temperature": 0.7, "max_new_tokens": 8, "seed": 1}
    args = {"topic": "tea", "tokens": 48}
    gate = PollGate()
    run = ProgramRun(programs["pair"], args, GatedBackend(local_chat.engine, gate), defaults)
    pieces = run_to_end(run, gate)
    assert run.error is None and not gate.open
    sources = {(p.label, p.var) for p in pieces}
    assert sources == {("main", "first"), ("fork 1", "variant"), ("fork 2", "variant")}
    # Piece by piece as the engine streamed them, not all at the end: one per event with text.
    fork_1 = run.state.executor.children[0].stream_chunks["variant"]
    events = sum(bool(piece) for piece, _ in fork_1)
    assert events > 1 and sum(p.label == "fork 1" for p in pieces) == events
    variables = run.variables()
    assert "".join(p.text for p in pieces if p.var == "first") == variables["first"]
    for i, label in enumerate(("fork 1", "fork 2")):
        streamed = "".join(p.text for p in pieces if p.label == label)
        assert streamed == variables["variant"][i]


def test_stopping_a_run_aborts_its_requests(programs, local_chat):
    run = ProgramRun(programs["endless"], {}, local_chat.program_backend(), {})
    deadline = time.monotonic() + 30
    while not run.new_pieces():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert run.stop(30)
    assert isinstance(run.error, ProgramStopped)
    stats = local_chat.stats()
    assert stats["running_requests"] == 0 and stats["blocks_held_by_requests"] == 0
    assert stats["integrity"] == "ok"


def test_graph_traces_forks(programs, local_chat):
    graph = trace(programs["pair"], {"topic": "tea"}, local_chat.program_backend())
    assert [n.label for n in graph.nodes_of("gen")] == ["first", "variant", "variant"]
    assert len(graph.edges_of("fork")) == 2 and graph.num_chains == 3
