"""``gen(beam_width=...)`` in programs: the engine's beam search, its beams in the meta info."""

from __future__ import annotations

import pytest

import radixlang as sgl
from radixlang.lang.backends.openai import _params

BEAMS = {"beam_width": 3, "temperature": 0, "max_tokens": 8, "length_penalty": 0.8}


def test_gen_with_beams_equals_the_engine(tiny_runtime):
    @sgl.function
    def prog(s):
        s += "Once upon a time"
        s += sgl.gen("story", **BEAMS)

    state = prog.run(backend=tiny_runtime)
    want = tiny_runtime.engine.generate(
        "Once upon a time",
        {"beam_width": 3, "temperature": 0, "max_new_tokens": 8, "length_penalty": 0.8},
    )
    assert state["story"] == want.text
    beams = state.get_meta_info("story")["beams"]
    assert [b["output_ids"] for b in beams] == [b.output_ids for b in want.beams]


def test_gen_with_beams_in_a_chat_turn(tiny_runtime):
    """The chat template's end-of-turn stop string is taken by beam search too."""

    @sgl.function
    def prog(s):
        s += sgl.user("Name a color.")
        s += sgl.assistant(sgl.gen("a", beam_width=2, temperature=0, max_tokens=6))

    state = prog.run(backend=tiny_runtime)
    assert len(state.get_meta_info("a")["beams"]) == 2


def test_run_defaults_carry_beam_search(tiny_runtime):
    @sgl.function
    def prog(s):
        s += "Once upon a time"
        s += sgl.gen("story", max_tokens=8)

    state = prog.run(backend=tiny_runtime, beam_width=3, temperature=0, length_penalty=0.8)
    assert len(state.get_meta_info("story")["beams"]) == 3


def test_beam_search_errors_name_the_problem(tiny_runtime):
    @sgl.function
    def prog(s):
        s += "Hi"
        s += sgl.gen("a", beam_width=2, max_tokens=4)  # temperature's default is 1

    with pytest.raises(Exception, match="temperature"):
        prog.run(backend=tiny_runtime).sync()
    with pytest.raises(NotImplementedError, match="beam_width"):
        _params({"beam_width": 2, "temperature": 0}, chat=True)
