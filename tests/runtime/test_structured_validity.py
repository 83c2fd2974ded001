"""Structured output on the real default model at temperature 1.0: every output validates.

Twelve JSON schemas (nested objects, arrays with bounds, enums, numbers with bounds, string
patterns, optional fields, anyOf, $ref), three Lark grammars, an EBNF grammar and five regexes,
each sampled 8 times: 100% must validate (``jsonschema``, ``lark``, ``re.fullmatch``), not most.
"""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from radixlang.model_files import DEFAULT_MODEL
from radixlang.runtime import Engine, FinishReason

SAMPLES = 8

SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "active"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"enum": ["Paris", "Berlin", "Rome"]},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["person"],
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 10},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "size": {"enum": ["S", "M", "L", 42]},
        },
        "required": ["color", "size"],
    },
    "numbers": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 1, "maximum": 10},
            "score": {"type": "integer", "minimum": -50, "maximum": 50},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["count", "score", "ratio"],
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        },
        "required": ["code", "email"],
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 20},
            "subtitle": {"type": "string", "maxLength": 20},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        },
        "required": ["title"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 100},
                    {"type": "string", "maxLength": 10},
                    {"type": "null"},
                ]
            }
        },
        "required": ["value"],
    },
    "ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -99, "maximum": 99},
                    "y": {"type": "integer", "minimum": -99, "maximum": 99},
                },
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 10},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["name", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 5,
    },
    "const_and_bool": {
        "type": "object",
        "properties": {
            "kind": {"const": "invoice"},
            "paid": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 12},
        },
        "required": ["kind", "paid", "note"],
    },
}

LARK_GRAMMARS: dict[str, str] = {
    "arithmetic": """
        start: term (OP term)? (OP term)?
        term: NUMBER | "(" NUMBER OP NUMBER ")"
        OP: " + " | " - " | " * "
        NUMBER: /[0-9]{1,3}/
    """,
    "answer_because": """
        start: ANSWER " because " REASON "."
        ANSWER: "yes" | "no"
        REASON: /[a-z]{1,10}( [a-z]{1,10}){0,3}/
    """,
    "key_values": """
        start: pair ("; " pair)?
        pair: KEY "=" VALUE
        KEY: /[a-z]{1,8}/
        VALUE: /[0-9]{1,4}/ | "true" | "false"
    """,
}

EBNF_GRAMMAR = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | [0-9] [0-9]?'
EBNF_CHECK = re.compile(r"The answer is (yes|no|[0-9][0-9]?)\.")

REGEXES = [
    r"[0-9]{1,4}",
    r"(yes|no)",
    r"[A-Z][a-z]{1,10}",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"\d{4}-\d{2}-\d{2}",
]


@pytest.fixture(scope="module")
def real():
    # Deterministic: a seeded sample is then the same whatever shares its batch (which here
    # follows the engine thread's timing), so every run checks the same texts.
    with Engine(DEFAULT_MODEL, kv_memory="256MiB", dtype="bfloat16", deterministic=True) as engine:
        yield engine
        engine.check_integrity()


def chat(engine: Engine, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def sample(engine: Engine, prompt: str, constraint: dict) -> list[str]:
    params = [
        {"temperature": 1.0, "seed": seed, "max_new_tokens": 256} | constraint
        for seed in range(SAMPLES)
    ]
    results = engine.generate([prompt] * SAMPLES, params)
    for r in results:
        assert r.finish_reason is FinishReason.STOP, (constraint, r.text, r.finish_reason)
    return [r.text for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_all_validate(real, name):
    schema = SCHEMAS[name]
    prompt = chat(real, f"Give an example of {name.replace('_', ' ')} data as JSON.")
    for text in sample(real, prompt, {"json_schema": schema}):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LARK_GRAMMARS))
def test_lark_grammar_outputs_all_parse(real, name):
    grammar = LARK_GRAMMARS[name]
    parser = lark.Lark(grammar, start="start")
    prompt = chat(real, f"Write one {name.replace('_', ' ')} line.")
    for text in sample(real, prompt, {"grammar": grammar}):
        parser.parse(text)


@pytest.mark.slow
def test_ebnf_grammar_outputs_all_match(real):
    prompt = chat(real, "Is the sky blue?")
    for text in sample(real, prompt, {"ebnf": EBNF_GRAMMAR}):
        assert EBNF_CHECK.fullmatch(text), text


@pytest.mark.slow
@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_all_fullmatch(real, regex):
    prompt = chat(real, "Answer with one short value.")
    for text in sample(real, prompt, {"regex": regex}):
        assert re.fullmatch(regex, text), (regex, text)
