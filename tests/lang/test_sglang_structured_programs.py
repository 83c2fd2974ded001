"""SGLang's structured-output programs on the default model, in process (``sgl.Runtime``-style
LocalBackend) and through ``RuntimeEndpoint`` against a radixlang server on the same engine.

Two sets: programs written here after SGLang's ``test_decode_json``, ``test_decode_json_regex``
and ``test_stream_logprobs`` (always run), and, when the ``sglang`` package is installed, SGLang's
own test functions from ``sglang.test.test_programs``, run unchanged twice: with radixlang
standing in for ``sglang`` (their module's ``sgl``), and with SGLang's own frontend and
``RuntimeEndpoint`` against the radixlang server.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

import radixlang as sgl
from radixlang.lang.backends.endpoint import RuntimeEndpoint
from radixlang.lang.backends.local import LocalBackend

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    from radixlang.runtime.engine import Engine

    # The default model, deterministic: whether a program's JSON closes within its token budget
    # must not depend on what the cache holds (the local run primes the endpoint's) or on batching.
    engine = Engine(deterministic=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(engine):
    from radixlang.server.app import serve_in_thread

    with serve_in_thread(engine, host="127.0.0.1", port=0) as server:
        yield server


@pytest.fixture(params=["local", "endpoint"])
def backend(request, engine):
    if request.param == "local":
        yield LocalBackend(engine)  # not shut down: the engine fixture owns the engine
    else:
        endpoint = RuntimeEndpoint(request.getfixturevalue("server").url)
        yield endpoint
        endpoint.shutdown()


# ---- the programs, in this project's words ----------------------------------------------------
@sgl.function
def city_json_by_dtype(s):
    s += "Write a JSON object with basic facts about the city of Paris.\n"
    with s.var_scope("record"):
        s += "{\n"
        s += '  "name": ' + sgl.gen_string("name") + ",\n"
        s += '  "population": ' + sgl.gen_int("population") + ",\n"
        s += '  "area": ' + sgl.gen("area", dtype=int) + ",\n"
        s += '  "country": ' + sgl.gen_string("country") + "\n"
        s += "}"


def test_decode_json_with_dtype_gens(backend):
    state = city_json_by_dtype.run(backend=backend, temperature=0, max_new_tokens=24)
    record = json.loads(state["record"])
    assert isinstance(record["name"], str) and isinstance(record["population"], int)
    assert isinstance(record["area"], int) and isinstance(record["country"], str)
    assert state.parsed("population") == record["population"]
    assert state.parsed("name") == record["name"]


INT, FLOAT, STRING = r"[-+]?[0-9]+", r"[-+]?[0-9]*\.?[0-9]+", r'"[\w\d\s]*"'


@sgl.function
def city_json_by_regex(s):
    s += "Write a JSON object with basic facts about the city of Paris.\nThe JSON object:\n"
    with s.var_scope("record"):
        s += "{\n"
        s += '  "name": ' + sgl.gen("name", regex=STRING, max_tokens=16) + ",\n"
        s += '  "population": ' + sgl.gen("population", regex=INT, max_tokens=12) + ",\n"
        s += '  "latitude": ' + sgl.gen("latitude", regex=FLOAT, max_tokens=12) + "\n"
        s += "}"


def test_decode_json_with_regex_gens(backend):
    state = city_json_by_regex.run(backend=backend, temperature=0)
    record = json.loads(state["record"])
    assert isinstance(record["name"], str) and isinstance(record["population"], int)
    assert re.fullmatch(FLOAT, state["latitude"])


@sgl.function
def answer_with_logprobs(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", return_logprob=True))


def test_stream_logprobs(backend):
    async def collect():
        state = answer_with_logprobs.run(
            question="Write two sentences about a trip to Hawaii.",
            stream=True,
            temperature=0,
            max_new_tokens=24,
            backend=backend,
        )
        pieces = [p async for p in state.text_async_iter("answer", return_meta_data=True)]
        return state, pieces

    state, pieces = asyncio.run(collect())
    assert pieces and "".join(text for text, _ in pieces) == state["answer"]
    previous = 0
    for text, meta in pieces:
        assert text
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - previous
        previous = meta["completion_tokens"]
        assert meta["prompt_tokens"] > 0 and meta["cached_tokens"] >= 0


# ---- SGLang's own test functions, when sglang is installed ---------------------------------------
SGLANG_PROGRAMS = ["test_decode_json", "test_decode_json_regex", "test_stream_logprobs"]


@pytest.fixture(scope="module")
def sglang_programs():
    pytest.importorskip("sglang", reason="sglang (frontend) is not installed")
    return pytest.importorskip("sglang.test.test_programs")


@pytest.mark.parametrize("name", SGLANG_PROGRAMS)
def test_sglangs_program_runs_on_radixlang(name, sglang_programs, backend, monkeypatch):
    """SGLang's test function, with ``radixlang`` as its ``sgl`` and our backend as default."""
    monkeypatch.setattr(sglang_programs, "sgl", sgl)
    previous = sgl.get_default_backend()
    sgl.set_default_backend(backend)
    try:
        getattr(sglang_programs, name)()
    finally:
        sgl.set_default_backend(previous)


@pytest.mark.parametrize("name", SGLANG_PROGRAMS)
def test_sglangs_frontend_runs_its_program_against_the_radixlang_server(
    name, sglang_programs, server
):
    import sglang

    sglang.set_default_backend(sglang.RuntimeEndpoint(server.url))
    getattr(sglang_programs, name)()
