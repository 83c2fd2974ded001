"""The llguidance-backed grammar engine: sources checked with clear errors, masks that agree one
by one and batched, forced tokens, the may-end semantics, and the compile cache."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import BaseModel

from radixlang.constrain import (
    ANY_JSON_OBJECT,
    ConstraintError,
    GrammarConstraint,
    clear_grammar_cache,
    compile_grammar,
    json_schema_text,
)
from radixlang.constrain.grammar import closed_objects, unpack_bits
from radixlang.model_files import DEFAULT_MODEL, load_model_files

EOS = 2


@pytest.fixture(scope="module")
def tok():
    return load_model_files(DEFAULT_MODEL).load_tokenizer()


def compiled(tok, kind, source):
    return compile_grammar(kind, source, tok, len(tok), [EOS])


def walk(tok, constraint: GrammarConstraint, text: str) -> None:
    for t in tok.encode(text, add_special_tokens=False):
        constraint.advance(t)


class Invoice(BaseModel):
    customer_full_name: str
    total_cents: int


def test_json_schema_text_takes_dicts_strings_and_pydantic_classes():
    as_dict = json.loads(json_schema_text(Invoice))
    assert as_dict["properties"].keys() == {"customer_full_name", "total_cents"}
    assert as_dict["additionalProperties"] is False  # closed: only the listed keys
    assert json.loads(json_schema_text(json.dumps(ANY_JSON_OBJECT))) == ANY_JSON_OBJECT
    # Property order is kept: it is the order the fields are generated in.
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    assert list(json.loads(json_schema_text(schema))["properties"]) == ["b", "a"]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("{not json", "not valid JSON"),
        ({"type": "objec"}, "invalid JSON schema at type"),
        ({"type": "object", "properties": {"n": {"minimum": "x"}}}, "properties/n/minimum"),
        (42, "must be a JSON-schema object"),
    ],
)
def test_bad_schemas_say_what_is_wrong(source, message):
    with pytest.raises(ConstraintError, match=message):
        json_schema_text(source)


def test_closed_objects_leaves_explicit_choices_and_property_names_alone():
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {}}}},
        "$defs": {"open": {"properties": {}, "additionalProperties": True}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a map of names, not a schema
    assert closed["$defs"]["open"]["additionalProperties"] is True
    # allOf branches each name part of the keys: they stay open at their own level.
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {"properties": {}}}}]}
    closed = closed_objects(both)
    assert "additionalProperties" not in closed and all(
        "additionalProperties" not in branch for branch in closed["allOf"]
    )
    assert closed["allOf"][1]["properties"]["b"]["additionalProperties"] is False


@pytest.mark.parametrize(
    ("kind", "source", "message"),
    [
        ("regex", "[0-9", "invalid regex"),
        ("regex", "(?=a)b", "look-around"),
        ("grammar", "start: foo", "lark: Rule 'foo' used but not defined"),
        ("grammar", "start: 'a\n", "line 1,? column 8"),
        ("ebnf", "root ::= (", "invalid EBNF grammar.*Expected"),
        ("json_schema", {"type": "objec"}, "invalid JSON schema"),
        ("yaml", "a: 1", "unknown constraint kind"),
    ],
)
def test_bad_sources_are_constraint_errors(tok, kind, source, message):
    with pytest.raises(ConstraintError, match=message):
        compiled(tok, kind, source)


def test_compiled_grammars_are_cached_per_source(tok):
    clear_grammar_cache()
    a = compiled(tok, "regex", "[0-9]+")
    assert compiled(tok, "regex", "[0-9]+") is a
    assert compiled(tok, "regex", "[0-9]*") is not a
    assert compiled(tok, "json_schema", Invoice) is compiled(tok, "json_schema", Invoice)


def test_regex_masks_and_may_end(tok):
    c = compiled(tok, "regex", "[0-9]{1,3}").new_constraint()
    mask = c.allowed_mask()
    allowed = mask.nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).isdigit() for t in allowed)
    assert not c.may_end() and not c.is_finished()
    walk(tok, c, "12")
    assert c.may_end()  # "12" is complete but could go on
    newline = tok.encode("\n", add_special_tokens=False)[0]
    assert c.ends_on(newline) and not c.ends_on(EOS)
    walk(tok, c, "3")
    assert c.is_finished()  # three digits: nothing may follow
    with pytest.raises(ConstraintError):
        c.advance(tok.encode("4", add_special_tokens=False)[0])


def test_batched_masks_equal_single_masks(tok):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}}
    g = compiled(tok, "json_schema", schema)
    states = ["", '{"name": "', '{"name": "Al', '{"name": "Al"']
    constraints = []
    for prefix in states:
        c = g.new_constraint()
        walk(tok, c, prefix)
        constraints.append(c)
    width = len(tok) + 7  # logits may be wider than the tokenizer
    batch = GrammarConstraint.batch_allowed_masks(constraints, width)
    assert batch.shape == (len(states), width) and batch.dtype == torch.bool
    assert not batch[:, len(tok) :].any()
    for row, c in zip(batch, constraints, strict=True):
        assert torch.equal(row[: len(tok)], c.allowed_mask())
    # After the closing quote only "}" (or ", "?) may come; EOS only once the object closes.
    assert not batch[3, EOS]


def test_forced_tokens_cover_fixed_keys(tok):
    g = compiled(tok, "json_schema", Invoice)
    c = g.new_constraint()
    forced = c.forced_tokens()
    assert tok.decode(forced).startswith('{"customer_full_name":')
    for t in forced:
        c.advance(t)
    walk(tok, c, ' "Ada"')
    more = c.forced_tokens()
    assert tok.decode(more).startswith(', "total_cents":')


def test_unpack_bits_is_little_endian():
    packed = torch.tensor([[0b00000101, 0b10000000]], dtype=torch.uint8)
    out = unpack_bits(packed, 18)
    assert out.shape == (1, 18)
    assert out[0].nonzero().flatten().tolist() == [0, 2, 15]


# ---- what one grammar may cost -------------------------------------------------------------
EXPLODING_LEXER = "(((.{1,30}){1,30}){1,30})"  # llguidance's lexer gives up on its first mask
# 20,000 alternatives: about a second to compile here, far beyond a small timeout.
HUGE_ALTERNATION = "(" + "|".join(f"w{i}x" for i in range(20_000)) + ")"


def test_a_lexer_that_explodes_is_refused_at_compile_time(tok):
    with pytest.raises(ConstraintError, match=r"regex: .*too many expressions"):
        compiled(tok, "regex", EXPLODING_LEXER)


def test_a_grammar_slower_than_the_timeout_is_refused_and_stays_refused(tok, monkeypatch):
    from radixlang.constrain import grammar

    clear_grammar_cache()
    compile_grammar("regex", "[a-z]+", tok, len(tok), [EOS])  # builds the tokenizer view
    with pytest.raises(ConstraintError, match=r"took longer than 0.05 s to compile"):
        compile_grammar("regex", HUGE_ALTERNATION, tok, len(tok), [EOS], timeout=0.05)
    # Refused again at once: from memory, without compiling it again (not timed: the refused
    # compilation goes on in the background and, on a loaded machine, holds a core).
    compiling = []
    real = grammar._compile
    monkeypatch.setattr(grammar, "_compile", lambda *a: compiling.append(a[0]) or real(*a))
    with pytest.raises(ConstraintError, match="took longer than"):
        compile_grammar("regex", HUGE_ALTERNATION, tok, len(tok), [EOS], timeout=0.05)
    assert compiling == []
    # Ordinary grammars still compile with a time limit, once the refused one's compilation is
    # done (the limit here only guards against a hang).
    if grammar._compile_pool is not None:
        grammar._compile_pool.shutdown(wait=True)
        grammar._compile_pool = None  # made again at the next timed compilation
    assert compile_grammar("regex", "[0-9]{3}", tok, len(tok), [EOS], timeout=60)
    assert compiling == ["regex"]


def test_a_str_dtype_gen_can_write_no_raw_control_character(tok):
    """The grammar engine reads the str regex as Python does: inside the quotes no tab or
    newline token is allowed (its JSON escape is), and the closing quote ends the value."""
    from radixlang.constrain import dtype_regex

    c = compiled(tok, "regex", dtype_regex(str)).new_constraint()
    walk(tok, c, '"Europe')
    allowed = set(c.allowed_mask().nonzero().flatten().tolist())
    for raw in ("\t", "\n", "\r"):
        token = tok.encode(raw, add_special_tokens=False)
        assert len(token) == 1 and token[0] not in allowed, repr(raw)
    walk(tok, c, '/Paris \\t"')
    assert c.is_finished()
