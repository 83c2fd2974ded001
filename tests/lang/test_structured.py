"""Structured generation in programs: ``gen(json_schema=, grammar=, ebnf=, regex=, dtype=)``.

On a model-free backend: each constraint is checked where ``gen`` is called (a bad one raises
before anything runs, with the library's message), reaches the backend in the sampling
parameters, survives tracing and compiling, and ``s.parsed`` reads outputs by their gen. On the
tiny random model: the engine's outputs follow the constraint (valid JSON under the schema, a
sentence of the grammar), and a failed program leaves the runtime working with no block leaked.
"""

from __future__ import annotations

import json

import jsonschema
import lark
import pytest
from fake_backend import FakeBackend
from pydantic import BaseModel, Field

import radixlang as sgl
from radixlang.lang.structured import StructuredOutputError
from radixlang.lang.tracer import TracingError


class City(BaseModel):
    name: str = Field(max_length=12)
    population_in_millions: int = Field(ge=0, le=99)
    is_capital: bool


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["name", "rank"],
}
# A Lark grammar and an EBNF one for the same small language: "<color> <count>".
LARK = """
start: color " " count
color: "red" | "green" | "blue"
count: /[1-9][0-9]?/
"""
EBNF = 'root ::= color " " count\ncolor ::= "red" | "green" | "blue"\ncount ::= [1-9] [0-9]?'


def _replying(text: str) -> FakeBackend:
    return FakeBackend(reply=lambda prompt, sampling: text)


# ---- checked at gen(...) ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"regex": "(ab"}, r"gen\('x'\): bad regex '\(ab'.*missing \)"),
        ({"regex": r"(?=a)b"}, r"bad regex.*look-around"),  # Python takes it; llguidance does not
        ({"json_schema": {"type": "strin"}}, r"gen\('x'\): invalid JSON schema at type: 'strin'"),
        ({"json_schema": '{"type": "object",'}, r"json_schema is not valid JSON"),
        ({"json_schema": ["a"]}, r"json_schema must be a JSON-schema dict"),
        ({"json_schema": dict}, r"is a class but not a pydantic model"),
        (
            {"json_schema": {"properties": {"a": {"$ref": "#/$defs/nope"}}}},
            r"unsupported JSON schema: .*nope",
        ),
        (
            {"grammar": 'start: "a" (\n'},
            r"invalid Lark grammar: .*Unclosed parenthesis, at line 1 column 13",
        ),
        ({"grammar": "start: item\n"}, r"invalid Lark grammar: .*item"),
        ({"grammar": 3}, r"grammar must be a str"),
        ({"ebnf": 'root ::= "a" ('}, r"invalid EBNF grammar: .*Expected '\)'"),
        ({"ebnf": "root ::= other"}, r"invalid EBNF grammar: .*other"),
        ({"regex": "a", "json_schema": CITY_SCHEMA}, r"got regex and json_schema: give at most"),
        ({"grammar": LARK, "dtype": int}, r"got grammar and dtype"),
        ({"ebnf": EBNF, "choices": ["a", "b"]}, r"got ebnf and choices"),
    ],
)
def test_a_bad_constraint_raises_at_gen_before_anything_runs(kwargs, message):
    with pytest.raises(StructuredOutputError, match=message):
        sgl.gen("x", **kwargs)
    assert issubclass(StructuredOutputError, ValueError)


def test_a_bad_constraint_inside_a_program_fails_the_run_before_any_backend_call():
    backend = FakeBackend()

    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("a", max_tokens=2)
        s += sgl.gen("b", grammar="start: (")

    with pytest.raises(StructuredOutputError, match="invalid Lark grammar"):
        prog.run(backend=backend)
    # gen("b", ...) raised in the program's Python; only gen "a" had been queued.
    assert len(backend.calls) <= 1 and all("grammar" not in c[2] for c in backend.calls)


def test_good_constraints_are_accepted_including_llguidances_lark_extensions():
    sgl.gen("a", json_schema=CITY_SCHEMA)
    sgl.gen("b", json_schema=json.dumps(CITY_SCHEMA))
    sgl.gen("c", json_schema=City)
    sgl.gen("d", grammar=LARK)
    sgl.gen("e", ebnf=EBNF)
    sgl.gen("f", regex=r"\d{3}-\d{4}")
    # lark rejects %json; llguidance takes it: accepted.
    sgl.gen("g", grammar='start: "Answer: " data\ndata: %json {"type": "integer"}\n')


# ---- what backends get --------------------------------------------------------------------
def test_constraints_reach_the_backend_in_the_sampling_parameters():
    backend = FakeBackend(reply=lambda prompt, sampling: "{}")

    @sgl.function
    def prog(s):
        s += "A" + sgl.gen("a", json_schema=CITY_SCHEMA)
        s += "B" + sgl.gen("b", json_schema=City)
        s += "C" + sgl.gen("c", grammar=LARK)
        s += "D" + sgl.gen("d", ebnf=EBNF)
        s += "E" + sgl.gen("e", regex="[ab]+")
        s += "F" + sgl.gen_int("f")

    prog.run(backend=backend)
    samplings = [sampling for _, _, sampling in backend.calls]
    kinds = ("regex", "json_schema", "grammar", "ebnf")
    given = [{k: s[k] for k in kinds if k in s} for s in samplings]
    assert given[0] == {"json_schema": json.dumps(CITY_SCHEMA)}  # JSON text, as SGLang sends it
    assert json.loads(given[1]["json_schema"]) == City.model_json_schema()
    assert given[2] == {"grammar": LARK}
    assert given[3] == {"ebnf": EBNF}
    assert given[4] == {"regex": "[ab]+"}
    assert set(given[5]) == {"regex"}  # dtype=int is a regex


def test_compiled_programs_carry_the_constraints_and_trace_labels_name_them():
    backend = FakeBackend(reply=lambda prompt, sampling: '{"name": "Oslo", "rank": 2}')

    @sgl.function
    def prog(s, topic):
        s += "About " + topic + ": " + sgl.gen("info", json_schema=CITY_SCHEMA)
        s += " Tag: " + sgl.gen("tag", grammar=LARK)

    graph = prog.trace()
    assert [n.label for n in graph.nodes_of("gen")] == ["info [json_schema]", "tag [grammar]"]
    state = prog.compile().run(topic="Oslo", backend=backend)
    (_, _, first), (_, _, second) = backend.calls
    assert first["json_schema"] == json.dumps(CITY_SCHEMA) and second["grammar"] == LARK
    assert state.parsed("info") == {"name": "Oslo", "rank": 2}


def test_a_traced_program_cannot_parse_a_generated_value():
    @sgl.function
    def prog(s):
        s += sgl.gen("info", json_schema=CITY_SCHEMA)
        if s.parsed("info")["rank"] > 1:
            s += "high"

    with pytest.raises(TracingError, match="parses variable 'info'"):
        prog.trace()


# ---- s.parsed -----------------------------------------------------------------------------
def test_parsed_gives_a_pydantic_instance_and_the_text_stays_the_text():
    text = '{"name": "Oslo", "population_in_millions": 1, "is_capital": true}'

    @sgl.function
    def prog(s):
        s += "City: " + sgl.gen("city", json_schema=City)

    state = prog.run(backend=_replying(text))
    assert state["city"] == text
    city = state.parsed("city")
    assert isinstance(city, City)
    assert city == City(name="Oslo", population_in_millions=1, is_capital=True)


def test_parsed_gives_the_json_value_validated_against_a_dict_or_text_schema():
    @sgl.function
    def prog(s, schema):
        s += sgl.gen("x", json_schema=schema)

    for schema in (CITY_SCHEMA, json.dumps(CITY_SCHEMA)):
        state = prog.run(schema=schema, backend=_replying('{"name": "Rome", "rank": 3}'))
        assert state.parsed("x") == {"name": "Rome", "rank": 3}
    bad = prog.run(schema=CITY_SCHEMA, backend=_replying('{"name": "Rome", "rank": 30}'))
    with pytest.raises(StructuredOutputError, match="does not match the schema at rank"):
        bad.parsed("x")


def test_parsed_says_when_json_was_cut_off():
    @sgl.function
    def prog(s):
        s += sgl.gen("city", json_schema=City)

    state = prog.run(backend=_replying('{"name": "Osl'))
    with pytest.raises(StructuredOutputError, match=r"not a valid City.*max_tokens"):
        state.parsed("city")


def test_parsed_gives_dtype_values_and_lists_for_n_and_forks():
    replies = iter(["42", "-3.5", "True", '"hi"', "7", "8"])
    backend = FakeBackend(reply=lambda prompt, sampling: next(replies))

    @sgl.function
    def prog(s):
        s += sgl.gen_int("i") + sgl.gen("f", dtype=float) + sgl.gen("b", dtype=bool)
        s += sgl.gen_string("s")
        s += sgl.gen("many", dtype=int, n=2)

    state = prog.run(backend=backend)
    assert state.parsed("i") == 42 and state["i"] == "42"
    assert state.parsed("f") == -3.5
    assert state.parsed("b") is True
    assert state.parsed("s") == "hi"
    assert sorted(state.parsed("many")) == [7, 8]

    @sgl.function
    def forked(s):
        branches = s.fork(3)
        branches += lambda i: sgl.gen("rank", json_schema=CITY_SCHEMA)
        branches.join()

    reply = _replying('{"name": "A", "rank": 1}')
    assert forked.run(backend=reply).parsed("rank") == [{"name": "A", "rank": 1}] * 3


def test_parsed_on_a_gen_without_schema_or_dtype_names_the_reason():
    @sgl.function
    def prog(s):
        s += sgl.gen("plain") + sgl.gen("tag", grammar=LARK)
        s += sgl.select("pick", ["yes", "no"])
        with s.var_scope("scope"):
            s += "text"

    state = prog.run(backend=_replying("red 3"))
    with pytest.raises(StructuredOutputError, match=r"gen\('plain'\) has no json_schema or dtype"):
        state.parsed("plain")
    with pytest.raises(StructuredOutputError, match=r"gen\('tag', grammar=...\) has no json"):
        state.parsed("tag")
    for name in ("pick", "scope"):
        with pytest.raises(StructuredOutputError, match="not made by a gen"):
            state.parsed(name)
    with pytest.raises(KeyError):
        state.parsed("missing")


# ---- text_iter(return_meta_data=True) on the fake backend ------------------------------------
def test_text_iter_with_meta_data_needs_a_variable_and_runs_without_streaming_too():
    @sgl.function
    def prog(s):
        s += "Go:" + sgl.gen("out", max_tokens=4)

    state = prog.run(backend=_replying("abc"))
    assert list(state.text_iter("out", return_meta_data=True)) == [
        ("abc", state.get_meta_info("out"))
    ]
    with pytest.raises(ValueError, match="needs a var_name"):
        list(state.text_iter(return_meta_data=True))


# ---- on the tiny model -------------------------------------------------------------------------
@pytest.fixture
def rt(tiny_runtime):
    yield tiny_runtime
    engine = tiny_runtime.engine
    engine.check_integrity()
    assert tiny_runtime.flush_cache()
    stats = tiny_runtime.stats()
    assert stats["blocks_free"] == stats["blocks_total"]  # nothing leaked
    assert stats["running_requests"] == 0


@pytest.mark.parametrize("schema", [CITY_SCHEMA, json.dumps(CITY_SCHEMA)], ids=["dict", "text"])
def test_json_schema_output_is_valid_json_under_the_schema(rt, schema):
    @sgl.function
    def prog(s):
        s += sgl.user("Describe a city as JSON.")
        s += sgl.assistant(sgl.gen("city", json_schema=schema, max_tokens=64))

    states = prog.run_batch([{}] * 3, backend=rt, temperature=1.0)
    for state in states:
        value = json.loads(state["city"])
        jsonschema.validate(value, CITY_SCHEMA)
        assert state.parsed("city") == value
        assert state["city"] == json.dumps(value, ensure_ascii=False)  # json.dumps's layout


def test_json_schema_from_a_pydantic_model_parses_to_an_instance(rt):
    @sgl.function
    def prog(s):
        s += "A city: " + sgl.gen("city", json_schema=City, max_tokens=64)

    state = prog.run(backend=rt, temperature=0)
    city = state.parsed("city")
    assert isinstance(city, City)
    assert City.model_validate_json(state["city"]) == city
    assert state.text() == "A city: " + state["city"]


def test_lark_and_ebnf_outputs_are_sentences_of_their_grammar(rt):
    @sgl.function
    def prog(s):
        s += "Lark: " + sgl.gen("lark", grammar=LARK, max_tokens=16)
        s += "\nEBNF: " + sgl.gen("ebnf", ebnf=EBNF, max_tokens=16)

    parser = lark.Lark(LARK)
    for state in prog.run_batch([{}] * 3, backend=rt, temperature=1.0):
        for name in ("lark", "ebnf"):
            parser.parse(state[name])  # raises unless the text is a sentence of the grammar
            assert state[name].split()[0] in ("red", "green", "blue")


def test_llguidance_json_extension_in_a_lark_grammar_runs(rt):
    grammar = 'start: "n=" data\ndata: %json {"type": "integer", "minimum": 0, "maximum": 99}\n'

    @sgl.function
    def prog(s):
        s += "Value: " + sgl.gen("v", grammar=grammar, max_tokens=8)

    value = prog.run(backend=rt, temperature=0)["v"]
    assert value.startswith("n=") and 0 <= int(value[2:]) <= 99


def test_regex_and_dtype_gens_still_match_on_the_grammar_engine(rt):
    @sgl.function
    def prog(s):
        s += "Phone: " + sgl.gen("phone", regex=r"[0-9]{3}-[0-9]{4}", max_tokens=12)
        s += "\nCount: " + sgl.gen_int("count", max_tokens=6)
        s += "\nName: " + sgl.gen_string("name", max_tokens=12)
        s += "\nOK: " + sgl.gen("ok", dtype=bool, max_tokens=3)

    import re

    state = prog.run(backend=rt, temperature=0)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", state["phone"])
    assert isinstance(state.parsed("count"), int)
    assert isinstance(state.parsed("ok"), bool)
    # A random model may not close the string within max_tokens: only the start is certain.
    assert state["name"].startswith('"')


def test_a_failed_program_leaves_the_runtime_working(rt):
    @sgl.function
    def fails_mid_way(s):
        s += "Hello" + sgl.gen("a", json_schema=CITY_SCHEMA, max_tokens=32)
        s += sgl.gen("b", json_schema={"type": "object", "properties": {"x": {"type": "nope"}}})

    with pytest.raises(StructuredOutputError, match="invalid JSON schema"):
        fails_mid_way.run(backend=rt)

    @sgl.function
    def fine(s):
        s += "Hello" + sgl.gen("a", json_schema=CITY_SCHEMA, max_tokens=64)
        branches = s.fork(2)
        branches += lambda i: sgl.gen("tag", ebnf=EBNF, max_tokens=8)
        branches.join()

    state = fine.run(backend=rt, temperature=0)
    jsonschema.validate(json.loads(state["a"]), CITY_SCHEMA)
    assert len(state["tag"]) == 2


def test_a_constraint_the_engine_refuses_fails_only_its_program(rt):
    from radixlang.lang.ir import Gen
    from radixlang.runtime.engine import RequestError

    @sgl.function
    def unchecked(s):
        s += "Hello"
        s += Gen("x", {"max_new_tokens": 4}, grammar="start: (")  # past gen()'s check

    with pytest.raises(RequestError, match=r"^grammar"):
        unchecked.run(backend=rt)

    @sgl.function
    def prog(s):
        s += "Hello" + sgl.gen("x", grammar=LARK, max_tokens=8)

    lark.Lark(LARK).parse(prog.run(backend=rt, temperature=0)["x"])


# ---- streaming with meta data on the tiny model ------------------------------------------------
@sgl.function
def _answer(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", return_logprob=True))


def _check_pieces(chunks, meta_final):
    assert chunks
    prev_tokens = prev_len = 0
    for text, meta in chunks:
        assert text
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev_tokens
        assert len(meta["output_token_logprobs"]) == meta["output_token_logprobs_length"] - prev_len
        assert meta["prompt_tokens"] == meta_final["prompt_tokens"]
        assert meta["cached_tokens"] == meta_final["cached_tokens"]
        prev_tokens, prev_len = meta["completion_tokens"], meta["output_token_logprobs_length"]
    streamed = [e for _, m in chunks for e in m["output_token_logprobs"]]
    whole = meta_final["output_token_logprobs"]
    assert streamed == whole[: len(streamed)]  # the pieces' logprobs, in order, are the whole's
    assert len(whole) - len(streamed) <= 2  # at most the end's text-less tokens are left out
    for logprob, token_id, text in streamed:
        assert logprob <= 0 and isinstance(token_id, int) and text is None


def test_text_iter_with_meta_data_gives_each_pieces_logprobs(rt):
    state = _answer.run(question="Tell me about Hawaii.", stream=True, temperature=0,
                        max_new_tokens=24, backend=rt)  # fmt: skip
    chunks = list(state.text_iter("answer", return_meta_data=True))
    assert "".join(text for text, _ in chunks) == state["answer"]
    _check_pieces(chunks, state.get_meta_info("answer"))


def test_text_async_iter_with_meta_data_as_sglangs_stream_logprobs_program(rt):
    import asyncio

    async def collect():
        state = _answer.run(question="Compose a travel blog post about Hawaii.", stream=True,
                            temperature=0, max_new_tokens=32, backend=rt)  # fmt: skip
        chunks = [c async for c in state.text_async_iter("answer", return_meta_data=True)]
        return state, chunks

    state, chunks = asyncio.run(collect())
    _check_pieces(chunks, state.get_meta_info("answer"))
    plain = _answer.run(question="x", stream=True, temperature=0, max_new_tokens=4, backend=rt)
    assert "".join(plain.text_iter("answer")) == plain["answer"]  # the plain form is unchanged


def test_meta_data_without_logprobs_has_the_counts(rt):
    @sgl.function
    def prog(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=12, ignore_eos=True)

    state = prog.run(backend=rt, stream=True, temperature=0)
    chunks = list(state.text_iter("story", return_meta_data=True))
    counts = [meta["completion_tokens"] for _, meta in chunks]
    assert counts == sorted(counts) and counts[-1] <= 12
    assert all("output_token_logprobs" not in meta for _, meta in chunks)
    assert state.get_meta_info("story")["completion_tokens"] == 12
