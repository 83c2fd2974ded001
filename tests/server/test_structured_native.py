"""SGLang's /generate with structured output (json_schema, regex, ebnf, Lark grammar), its
lenient top level (SGLang's own fields and unknown keys), and incremental logprobs in streams.
The tiny random model writes garbage, but constrained garbage must still be valid."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from server_checks import assert_no_leak

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
}


def generate(client: httpx.Client, **body) -> dict | list:
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stream_chunks(client: httpx.Client, **body) -> list[dict]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("as_text", [True, False], ids=["schema-string", "schema-object"])
def test_json_schema_output_is_valid(client, as_text):
    schema = json.dumps(PERSON) if as_text else PERSON
    params = {"max_new_tokens": 64, "temperature": 1.0, "json_schema": schema, "n": 3, "seed": 1}
    outs = generate(client, text="A person as JSON:", sampling_params=params)
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), PERSON)
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_batch_items_take_their_own_constraints(client):
    params = [
        {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(PERSON)},
        {"max_new_tokens": 16, "temperature": 0, "regex": r"[a-z]{3}-[0-9]{2}"},
    ]
    first, second = generate(client, text=["Person:", "Code:"], sampling_params=params)
    jsonschema.validate(json.loads(first["text"]), PERSON)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", second["text"])


@pytest.mark.parametrize(
    ("key", "source", "pattern"),
    [
        ("regex", r"(yes|no), [0-9]{1,3}", r"(yes|no), [0-9]{1,3}"),
        ("ebnf", 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]',
         r"(yes|no) [0-9]"),
        ("grammar", 'start: WORD "=" NUMBER\nWORD: /[a-z]{1,5}/\nNUMBER: /[0-9]{1,3}/',
         r"[a-z]{1,5}=[0-9]{1,3}"),
    ],
)  # fmt: skip
def test_regex_ebnf_and_lark_outputs_match(client, key, source, pattern):
    for seed in range(3):
        params = {"max_new_tokens": 24, "temperature": 1.0, "seed": seed, key: source}
        out = generate(client, text="Answer:", sampling_params=params)
        assert re.fullmatch(pattern, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"json_schema": "{not json"}, "sampling_params.json_schema"),
        ({"json_schema": {"type": "nope"}}, "sampling_params.json_schema"),
        ({"json_schema": 5}, "sampling_params.json_schema"),
        ({"ebnf": "root ::= (unclosed"}, "sampling_params.ebnf"),
        ({"grammar": "start: ("}, "sampling_params.grammar"),
        ({"regex": "[a-"}, "sampling_params.regex"),
        ({"regex": "a", "json_schema": "{}"}, "sampling_params.json_schema"),
    ],
)
def test_invalid_constraints_get_a_400_naming_the_field(client, params, param):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 4, **params}}
    response = client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    # In a batch, the item is named; the other (valid) item is not left queued.
    params = [{"max_new_tokens": 4}, body["sampling_params"]]
    batch = {"text": ["x", "y"], "sampling_params": params}
    response = client.post("/generate", json=batch)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param.replace("params", "params[1]")
    assert_no_leak(client)


def test_invalid_schema_message_is_the_librarys(client):
    schema = {"type": "object", "minProperties": -1}
    body = {"text": "x", "sampling_params": {"json_schema": schema}}
    error = client.post("/generate", json=body).json()["error"]
    assert "invalid JSON schema" in error["message"] and "minProperties" in error["message"]


def test_sglang_top_level_fields_and_unknown_keys_are_accepted(client, engine):
    greedy = {"max_new_tokens": 5, "temperature": 0}
    body = {
        "text": "Hello there",
        "sampling_params": greedy,
        # What SGLang's bench_serving (0.5.23) sends, and other GenerateReqInput fields.
        "return_routed_experts": False,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
        "priority": 0,
        "routing_key": "tenant-a",
        "data_parallel_rank": None,
        "bootstrap_host": None,
        "log_metrics": True,
        "token_ids_logprob": None,
        "return_hidden_states": False,
        "session_params": None,
        "custom_logit_processor": None,
        "modalities": [],
        "rid": "structured-top-level-1",
        # Not SGLang's either: ignored, as SGLang ignores it.
        "some_unknown": 1,
    }
    out = generate(client, **body)
    assert out["text"] == engine.generate("Hello there", greedy).text
    assert out["meta_info"]["id"] == "structured-top-level-1"
    with_ids = generate(client, text="Hello there", sampling_params=greedy,
                        return_prompt_token_ids=True)  # fmt: skip
    assert with_ids["prompt_token_ids"] == engine.tokenizer.encode("Hello there")


def test_unknown_sampling_key_is_still_refused(client):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 2, "nucleus": 0.5}, "junk": 1}
    response = client.post("/generate", json=body)
    assert response.status_code == 400
    assert "nucleus" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("image_data", "x.png"), ("return_hidden_states", True), ("token_ids_logprob", [1, 2]),
     ("lora_path", ["a"]), ("return_routed_experts", True)],
)  # fmt: skip
def test_fields_asking_for_what_is_missing_are_refused(client, field, value):
    response = client.post("/generate", json={"text": "x", field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


@pytest.mark.compares_outputs
@pytest.mark.parametrize(
    "sampling",
    [
        {"max_new_tokens": 12, "temperature": 0},
        {"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(PERSON)},
    ],
    ids=["text", "json"],
)
def test_streamed_logprobs_are_incremental(client, sampling):
    body = {"text": "Stream my logprobs", "sampling_params": sampling, "return_logprob": True,
            "top_logprobs_num": 2}  # fmt: skip
    whole = generate(client, **body)
    chunks = stream_chunks(client, **body)
    assert chunks and chunks[-1]["text"] == whole["text"]
    gathered, tops, previous = [], [], 0
    for chunk in chunks:
        meta = chunk["meta_info"]
        for key in ("prompt_tokens", "cached_tokens", "completion_tokens",
                    "output_token_logprobs", "output_token_logprobs_length"):  # fmt: skip
            assert key in meta, (key, meta)
        assert meta["prompt_tokens"] == whole["meta_info"]["prompt_tokens"]
        # SGLang's test_stream_logprobs: this chunk's logprobs only; the length is cumulative.
        assert meta["completion_tokens"] == meta["output_token_logprobs_length"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - previous
        assert len(meta["output_top_logprobs"]) == len(meta["output_token_logprobs"])
        previous = meta["completion_tokens"]
        gathered += meta["output_token_logprobs"]
        tops += meta["output_top_logprobs"]
    expected = whole["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in gathered] == [t for _, t, _ in expected] == whole["output_ids"]
    assert [lp for lp, _, _ in gathered] == pytest.approx([lp for lp, _, _ in expected], abs=1e-4)
    assert len(tops) == len(whole["meta_info"]["output_top_logprobs"])
    # The last chunk is the result: the prompt was cached by the request before this one.
    assert chunks[-1]["meta_info"]["cached_tokens"] > 0
    if "json_schema" in sampling:
        jsonschema.validate(json.loads(whole["text"]), PERSON)


def test_a_pathological_regex_gets_a_400_and_the_engine_keeps_serving(client, engine):
    """Compiling is bounded: a lexer that explodes, or a compilation past the engine's
    ``grammar_compile_timeout``, is refused as a bad request; other requests go on meanwhile."""
    body = {
        "text": "x",
        "sampling_params": {"max_new_tokens": 2, "regex": "(((.{1,30}){1,30}){1,30})"},
    }
    response = client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "sampling_params.regex"
    assert "too many expressions" in response.json()["error"]["message"]
    huge = "(" + "|".join(f"q{i}z" for i in range(20_000)) + ")"
    timeout = engine.grammar_compile_timeout
    engine.grammar_compile_timeout = 0.05
    try:  # the compilation goes on in the background (about a second) while others are served
        body = {"model": "default", "prompt": "x", "max_tokens": 2, "regex": huge}
        response = client.post("/v1/completions", json=body)
        fine = client.post(
            "/generate", json={"text": "y", "sampling_params": {"max_new_tokens": 2}}
        )
    finally:
        engine.grammar_compile_timeout = timeout
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "regex" and "took longer than 0.05 s to compile" in error["message"]
    assert fine.status_code == 200
    assert_no_leak(client)


def test_nothing_leaked_and_the_engine_is_intact(client, engine):
    assert_no_leak(client)
    engine.check_integrity()
