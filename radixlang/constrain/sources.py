"""A constraint's source, checked and converted without the grammar engine: no torch, no
llguidance, no numpy, so the language layer checks a ``gen(...)``'s constraint on the client
with the same code and messages as :mod:`radixlang.constrain.grammar` uses before compiling.

Python's ``re`` checks a regex, ``lark`` checks a Lark grammar (saying where, with line and
column), ``jsonschema`` checks a JSON schema against its meta-schema; a JSON schema given as a
pydantic model class, its JSON text or a dict becomes one JSON text (:func:`json_schema_text`).
The checks return the complaint (None when there is none), so each caller raises its own error.
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixlang.constrain.errors import ConstraintError


def regex_error(regex: str) -> str | None:
    """Python's ``re``'s complaint about ``regex``, or None if it compiles."""
    try:
        re.compile(regex)
    except re.error as e:
        return str(e)
    return None


def lark_error(grammar: str, *, verbatim: bool = False) -> str | None:
    """lark's complaint about ``grammar``, or None if lark takes it: ``line L, column C: ...``
    for a parse error, otherwise the error's type name and text (stripped of surrounding
    whitespace). With ``verbatim``, the texts are kept as lark wrote them and lark's own
    ``GrammarError`` goes without its type name (the compiler's wording)."""
    import lark

    try:
        lark.Lark(grammar, start="start", parser="earley")
    except lark.exceptions.UnexpectedInput as e:
        text = str(e) if verbatim else str(e).strip()
        return f"line {e.line}, column {e.column}: {text.splitlines()[0]}"
    except Exception as e:  # GrammarError, and the plain errors lark raises for bad input
        text = str(e) if verbatim else str(e).strip()
        if verbatim and isinstance(e, lark.exceptions.GrammarError):
            return text
        return f"{type(e).__name__}: {text}"
    return None


def is_pydantic_model(source: Any) -> bool:
    """Whether ``source`` is a pydantic model class (it has a JSON schema of its own)."""
    return isinstance(source, type) and hasattr(source, "model_json_schema")


def schema_value(source: Any) -> Any:
    """The JSON schema ``source`` stands for: a pydantic model class's schema, JSON text
    parsed (:class:`ConstraintError` if it is not JSON), anything else as it is."""
    if is_pydantic_model(source):
        return source.model_json_schema()
    if isinstance(source, str):
        try:
            return json.loads(source)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"json_schema is not valid JSON: {e}") from None
    return source


def schema_error(schema: dict[str, Any]) -> str | None:
    """``jsonschema``'s complaint about ``schema`` against its meta-schema (saying where in the
    schema), or None if it is a valid JSON schema."""
    import jsonschema

    try:
        validator = jsonschema.validators.validator_for(
            schema, default=jsonschema.Draft202012Validator
        )
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        return f"invalid JSON schema at {where}: {e.message}"
    return None


def json_schema_text(schema: Any) -> str:
    """A JSON schema as text, from a dict, a JSON string or a pydantic model class, with its
    objects closed (:func:`closed_objects`); :class:`ConstraintError` if it is not a valid
    schema."""
    schema = schema_value(schema)
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise ConstraintError(
            "json_schema must be a JSON-schema object (a dict or its JSON text) or a pydantic "
            f"model class, got {type(schema).__name__}"
        )
    error = schema_error(schema)
    if error is not None:
        raise ConstraintError(error)
    return json.dumps(closed_objects(schema))


# Where a JSON schema holds subschemas: maps of them, lists of them, and single ones.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
               "propertyNames", "additionalItems", "unevaluatedItems")  # fmt: skip


def closed_objects(schema: Any, close: bool = True) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists its
    ``properties`` and says nothing about other keys.

    JSON Schema lets such an object hold any other key, and a sampling model takes that door
    (seen: invented keys until the token limit cut the JSON off). Structured output wants the
    listed fields, as OpenAI's strict mode and xgrammar's default do; a schema that wants other
    keys says so with ``additionalProperties`` or ``patternProperties``. The branches of an
    ``allOf`` stay open at their own level (each names only part of the keys), their nested
    objects are closed.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub, close=key != "allOf") for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if (
        close
        and "properties" in out
        and "additionalProperties" not in out
        and "patternProperties" not in out
        and "unevaluatedProperties" not in out
        and "allOf" not in out
    ):
        out["additionalProperties"] = False
    return out
