"""Structured generation and streamed meta data through RuntimeEndpoint against the real
radixlang server, on the same engine as a LocalBackend: greedy programs with json_schema,
grammar and ebnf give the same text both ways, the wire carries SGLang's fields (json_schema as
JSON text inside sampling_params), and a stream's pieces carry their own logprobs."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import lark
import pytest
from pydantic import BaseModel, Field

import radixlang as sgl
from radixlang.lang.backends.endpoint import EndpointError, RuntimeEndpoint
from radixlang.lang.ir import Gen


class Item(BaseModel):
    label: str = Field(max_length=10)
    count: int = Field(ge=0, le=20)


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
    "required": ["ok", "n"],
}
LARK = 'start: animal " x" count\nanimal: "cat" | "dog"\ncount: /[1-9]/\n'
EBNF = 'root ::= ("yes" | "no") "!"'


@pytest.fixture(scope="module")
def endpoint(server):
    backend = RuntimeEndpoint(server.url)
    yield backend
    backend.shutdown()


@sgl.function
def structured(s):
    s += sgl.user("Fill in a record.")
    s += sgl.assistant(sgl.gen("item", json_schema=Item, max_tokens=48))
    s += sgl.user("And a flag.")
    s += sgl.assistant(sgl.gen("flag", json_schema=SCHEMA, max_tokens=32))
    s += "\nPet: " + sgl.gen("pet", grammar=LARK, max_tokens=8)
    s += "\nSure? " + sgl.gen("sure", ebnf=EBNF, max_tokens=4)


@pytest.mark.compares_outputs
def test_structured_programs_match_the_local_backend(server, local, recording):
    endpoint = RuntimeEndpoint(server.url, transport=recording)
    try:
        remote = structured.run(backend=endpoint, temperature=0)
    finally:
        endpoint.shutdown()
    here = structured.run(backend=local, temperature=0)
    assert remote.text() == here.text()
    assert isinstance(remote.parsed("item"), Item) and remote.parsed("item") == here.parsed("item")
    jsonschema.validate(remote.parsed("flag"), SCHEMA)
    lark.Lark(LARK).parse(remote["pet"])
    assert remote["sure"] in ("yes!", "no!")
    bodies = [body for method, path, body in recording.requests if path == "/generate"]
    params = [b["sampling_params"] for b in bodies if isinstance(b, dict) and "text" in b]
    kinds = [[k for k in ("json_schema", "grammar", "ebnf", "regex") if k in p] for p in params]
    assert kinds == [["json_schema"], ["json_schema"], ["grammar"], ["ebnf"]]
    assert params[0]["json_schema"] == json.dumps(Item.model_json_schema())  # JSON text
    assert json.loads(params[1]["json_schema"]) == SCHEMA
    assert params[2]["grammar"] == LARK and params[3]["ebnf"] == EBNF


def test_a_constraint_the_server_refuses_is_an_endpoint_error(endpoint):
    @sgl.function
    def unchecked(s):
        s += "Hello"
        s += Gen("x", {"max_new_tokens": 4}, ebnf="root ::= missing")  # past gen()'s check

    with pytest.raises(EndpointError) as info:
        unchecked.run(backend=endpoint)
    assert info.value.status_code == 400 and "ebnf" in str(info.value)


@sgl.function
def _answer(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", return_logprob=True))


@pytest.mark.compares_outputs
def test_a_streamed_gen_with_logprobs_gives_each_piece_its_tokens(endpoint, local):
    async def collect():
        state = _answer.run(question="Tell me about Hawaii.", stream=True, temperature=0,
                            max_new_tokens=24, backend=endpoint)  # fmt: skip
        chunks = [c async for c in state.text_async_iter("answer", return_meta_data=True)]
        return state, chunks

    state, chunks = asyncio.run(collect())
    assert chunks and "".join(text for text, _ in chunks) == state["answer"]
    prev = 0
    for text, meta in chunks:
        assert text
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - prev
        prev = meta["completion_tokens"]
    here = _answer.run(question="Tell me about Hawaii.", temperature=0, max_new_tokens=24,
                       backend=local)  # fmt: skip
    assert state["answer"] == here["answer"]
    remote_lps = state.get_meta_info("answer")["output_token_logprobs"]
    local_lps = here.get_meta_info("answer")["output_token_logprobs"]
    assert [tok for _, tok, _ in remote_lps] == [tok for _, tok, _ in local_lps]
    assert [lp for lp, _, _ in remote_lps] == pytest.approx([lp for lp, _, _ in local_lps])
    streamed = [tok for _, m in chunks for _, tok, _ in m["output_token_logprobs"]]
    assert streamed == [tok for _, tok, _ in local_lps][: len(streamed)]
