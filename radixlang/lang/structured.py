"""Structured output in programs: what ``gen(regex=, json_schema=, grammar=, ebnf=, dtype=)``
asks for, checked where the program names it, and how ``s.parsed(name)`` reads the result.

A constraint is checked at ``gen(...)`` time, before anything runs, with the libraries that will
enforce it: Python's ``re`` and llguidance for a regex, ``jsonschema`` (the schema against its
meta-schema) and llguidance for a JSON schema, llguidance and ``lark`` for a Lark grammar (lark's
message says where, with line and column; a grammar only llguidance takes, using its extensions
such as ``%json``, is accepted), llguidance for SGLang's EBNF. A bad one raises
:class:`StructuredOutputError`, a ``ValueError``.

The ``re``, ``lark`` and ``jsonschema`` checks and the schema conversions are
:mod:`radixlang.constrain.sources`'s, the ones the grammar compiler runs too. Nothing here loads
torch or the engine: a program on a remote backend checks its constraints on the client, with
the same messages.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from radixlang.constrain import sources
from radixlang.constrain.errors import ConstraintError

# The keyword arguments of gen that decide the output's form; at most one per gen.
CONSTRAINT_KINDS = ("regex", "json_schema", "grammar", "ebnf", "dtype", "choices")


class StructuredOutputError(ValueError):
    """A gen's regex, JSON schema or grammar is invalid or unsupported (raised by ``gen``), or
    its output does not parse (raised by ``s.parsed``)."""


@dataclass(frozen=True)
class JsonSchema:
    """A gen's JSON schema: its JSON text (what backends send), the schema as a dict (what
    ``s.parsed`` validates against), and the pydantic model it came from, if any."""

    text: str
    schema: dict[str, Any]
    model: type | None = None


def only_one(name: str | None, given: dict[str, Any]) -> None:
    """Raise unless at most one of the output-form arguments is set."""
    used = [k for k in CONSTRAINT_KINDS if given.get(k) is not None]
    if len(used) > 1:
        raise StructuredOutputError(
            f"gen({name!r}) got {' and '.join(used)}: give at most one of "
            f"{', '.join(CONSTRAINT_KINDS)}"
        )


# ---- checks at gen(...) time ------------------------------------------------------------------


def check_regex(name: str | None, regex: Any) -> None:
    if not isinstance(regex, str):
        raise StructuredOutputError(f"gen({name!r}): regex must be a str, got {type(regex)}")
    error = _regex_error(regex)
    if error is not None:
        raise StructuredOutputError(f"gen({name!r}): bad regex {regex!r}: {error}")


@functools.lru_cache(maxsize=256)
def _regex_error(regex: str) -> str | None:
    error = sources.regex_error(regex)
    if error is not None:
        return error
    import llguidance

    error = _llguidance_error(llguidance.LLMatcher.grammar_from_regex(regex))
    if error is None:
        return None
    # llguidance's message holds the regex parser's own line, "error: <what is unsupported>".
    detail = [line[6:].strip() for line in error.splitlines() if line.startswith("error:")]
    return f"not supported by the grammar engine: {detail[0]}" if detail else error


def json_schema(name: str | None, source: Any) -> JsonSchema:
    """A gen's ``json_schema=`` (a dict, its JSON text, or a pydantic model class), checked."""
    if isinstance(source, type) and not sources.is_pydantic_model(source):
        raise StructuredOutputError(
            f"gen({name!r}): json_schema={source.__name__} is a class but not a pydantic "
            "model: give a pydantic BaseModel subclass, a JSON-schema dict or its JSON text"
        )
    if not isinstance(source, (type, str, dict)):
        raise StructuredOutputError(
            f"gen({name!r}): json_schema must be a JSON-schema dict, its JSON text or a pydantic "
            f"model class, got {type(source).__name__}"
        )
    try:
        schema = sources.schema_value(source)
    except ConstraintError as e:  # JSON text that is not JSON
        raise StructuredOutputError(f"gen({name!r}): {e}") from None
    model = source if isinstance(source, type) else None
    if not isinstance(schema, dict):
        raise StructuredOutputError(
            f"gen({name!r}): json_schema must be a JSON object, got {type(schema).__name__}"
        )
    try:
        text = json.dumps(schema, sort_keys=False)
    except (TypeError, ValueError) as e:
        raise StructuredOutputError(f"gen({name!r}): json_schema is not JSON data: {e}") from None
    error = _schema_error(text)
    if error is not None:
        raise StructuredOutputError(f"gen({name!r}): {error}")
    return JsonSchema(text, schema, model)


@functools.lru_cache(maxsize=256)
def _schema_error(text: str) -> str | None:
    import llguidance

    error = sources.schema_error(json.loads(text))
    if error is not None:
        return error
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
    except Exception as e:  # llguidance raises ValueError; any failure is the schema's
        return f"unsupported JSON schema: {e}"
    error = _llguidance_error(grammar)
    return None if error is None else f"unsupported JSON schema: {error}"


def check_grammar(name: str | None, grammar: Any) -> None:
    """A Lark grammar (llguidance's dialect: ``start:`` rule, ``%json``, ``/regex/`` ...)."""
    if not isinstance(grammar, str):
        raise StructuredOutputError(f"gen({name!r}): grammar must be a str, got {type(grammar)}")
    error = _lark_grammar_error(grammar)
    if error is not None:
        raise StructuredOutputError(f"gen({name!r}): invalid Lark grammar: {error}")


@functools.lru_cache(maxsize=128)
def _lark_grammar_error(grammar: str) -> str | None:
    import llguidance

    error = _llguidance_error(llguidance.LLMatcher.grammar_from_lark(grammar))
    if error is None:
        return None
    # llguidance rejects it: lark's message says where (line and column), when lark rejects it
    # too; otherwise (an llguidance limitation, or a mistake inside one of its extensions)
    # llguidance's own message is the one that applies.
    return sources.lark_error(grammar) or error


def check_ebnf(name: str | None, ebnf: Any) -> None:
    """SGLang's EBNF (GBNF) grammar: ``root ::= ...``."""
    if not isinstance(ebnf, str):
        raise StructuredOutputError(f"gen({name!r}): ebnf must be a str, got {type(ebnf)}")
    error = _ebnf_error(ebnf)
    if error is not None:
        raise StructuredOutputError(f"gen({name!r}): invalid EBNF grammar: {error}")


@functools.lru_cache(maxsize=128)
def _ebnf_error(ebnf: str) -> str | None:
    import llguidance

    try:
        grammar = llguidance.grammar_from("ebnf", ebnf)
    except Exception as e:  # llguidance: "Failed to convert the grammar from GBNF to Lark: ..."
        return str(e)
    return _llguidance_error(grammar)


def _llguidance_error(grammar: str) -> str | None:
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if not is_error:
        return None
    return (messages[0] if messages else "rejected by llguidance").strip()


# ---- s.parsed(name) ---------------------------------------------------------------------------


def parse_output(name: str | None, gen: Any, text: Any) -> Any:
    """The value of gen ``gen``'s output ``text``: a pydantic instance or JSON value for a
    json_schema gen, an int/float/bool/str for a dtype gen; a list for a list of outputs (``n``
    samples, or a variable gathered from forked branches)."""
    if isinstance(text, list):
        return [parse_output(name, gen, t) for t in text]
    if not isinstance(text, str):
        raise StructuredOutputError(f"s.parsed({name!r}): the value is not generated text")
    spec = getattr(gen, "schema", None)
    if isinstance(spec, JsonSchema):
        return _parse_json(name, spec, text)
    dtype = getattr(gen, "dtype", None)
    if dtype is not None:
        return _parse_dtype(name, dtype, text)
    kind = next((k for k in ("regex", "grammar", "ebnf") if getattr(gen, k, None)), None)
    made_by = f"gen({name!r}, {kind}=...)" if kind else f"gen({name!r})"
    raise StructuredOutputError(
        f"s.parsed({name!r}): {made_by} has no json_schema or dtype, so there is nothing to "
        f"parse; its text is s[{name!r}]"
    )


def _parse_json(name: str | None, spec: JsonSchema, text: str) -> Any:
    hint = (
        " (an output cut off by max_tokens is incomplete JSON: raise max_tokens)"
        if not text.rstrip().endswith(("}", "]", '"')) and text.strip()
        else ""
    )
    if spec.model is not None:
        try:
            return spec.model.model_validate_json(text)  # type: ignore[attr-defined]
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            raise StructuredOutputError(
                f"s.parsed({name!r}): the output is not a valid {spec.model.__name__}{hint}: {e}"
            ) from e
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise StructuredOutputError(f"s.parsed({name!r}): the output is not JSON{hint}: {e}") from e
    import jsonschema

    try:
        jsonschema.validate(value, spec.schema)
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise StructuredOutputError(
            f"s.parsed({name!r}): the output does not match the schema at {where}: {e.message}"
        ) from e
    return value


def _parse_dtype(name: str | None, dtype: Any, text: str) -> Any:
    kind = dtype.__name__ if isinstance(dtype, type) else str(dtype)
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            if text in ("True", "False"):
                return text == "True"
            raise ValueError(f"{text!r} is not True or False")
        if kind == "str":
            value = json.loads(text) if text.startswith('"') else None
            if isinstance(value, str):
                return value  # the JSON string decoded: its escapes read
            raise ValueError(f"{text!r} is not a double-quoted JSON string")
    except ValueError as e:
        raise StructuredOutputError(f"s.parsed({name!r}): the output is not a {kind}: {e}") from e
    raise StructuredOutputError(f"s.parsed({name!r}): unknown dtype {dtype!r}")
