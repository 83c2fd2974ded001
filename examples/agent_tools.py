"""The local tools the agent examples use (react_agent.py, multi_agent.py): plain Python
functions, which ``gen(tools=[...])`` turns into tools from their signatures and docstrings.

- ``calculate``: arithmetic on numbers (+ - * / // % ** and parentheses), read with ``ast``,
  never ``eval``: anything else in the expression is refused.
- ``search_docs``: the documents of ``data/agent_docs.json`` (ten short facts) that share the
  most words with the query.
- ``convert_units``: length, mass and temperature between common units.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

DOCS = json.loads((Path(__file__).parent / "data" / "agent_docs.json").read_text())

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


# The schemas say more than "a string": the grammar built from them then lets a model write
# only arithmetic into calculate, words into search_docs, and known units into convert_units.
Arithmetic = Annotated[str, Field(pattern=r"^[0-9][0-9+*/%(). -]{0,40}$")]
Words = Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z ]{2,40}$")]
Unit = Literal["m", "km", "mi", "ft", "kg", "g", "lb", "c", "f"]


def calculate(expression: Arithmetic) -> float:
    """Evaluate an arithmetic expression, e.g. "(8849 - 330) / 2".

    Args:
        expression: numbers with + - * / // % ** and parentheses
    """
    return _value(ast.parse(expression.replace("^", "**"), mode="eval").body)


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)}")


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if len(w) > 2}


def search_docs(query: Words) -> str:
    """Search a small encyclopedia of geography and nature facts.

    Args:
        query: a few words about what to look up
    """
    wanted = _words(query)
    scored = sorted(DOCS, key=lambda d: -len(wanted & _words(d["title"] + " " + d["text"])))
    hits = [d for d in scored[:2] if wanted & _words(d["title"] + " " + d["text"])]
    if not hits:
        return "no document matches"
    return "\n".join(f"{d['title']}: {d['text']}" for d in hits)


# Each unit as (kind, factor to the kind's base unit); temperatures are converted apart.
_UNITS = {
    "m": ("length", 1.0), "km": ("length", 1000.0), "mi": ("length", 1609.344),
    "ft": ("length", 0.3048), "kg": ("mass", 1.0), "lb": ("mass", 0.45359237),
    "g": ("mass", 0.001), "c": ("temperature", 1.0), "f": ("temperature", 1.0),
}  # fmt: skip


def convert_units(value: float, from_unit: Unit, to_unit: Unit) -> float:
    """Convert a value between units: m, km, mi, ft (length); kg, g, lb (mass); c, f
    (temperature in Celsius or Fahrenheit).

    Args:
        value: the amount to convert
        from_unit: the unit it is in
        to_unit: the unit wanted
    """
    source, target = from_unit.lower().strip(), to_unit.lower().strip()
    if source not in _UNITS or target not in _UNITS:
        raise ValueError(f"unknown unit; known: {', '.join(_UNITS)}")
    if _UNITS[source][0] != _UNITS[target][0]:
        raise ValueError(f"cannot convert {_UNITS[source][0]} to {_UNITS[target][0]}")
    if source == target:
        return value
    if source == "c":
        return value * 9 / 5 + 32 if target == "f" else value
    if source == "f":
        return (value - 32) * 5 / 9
    return round(value * _UNITS[source][1] / _UNITS[target][1], 6)


TOOLS = [search_docs, calculate, convert_units]
