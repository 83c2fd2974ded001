"""The expressions a program appends to its state (``s += ...``).

Each is a small immutable record: text, a generation call, a choice, a role boundary, a variable
scope boundary, a reference to another state's variable (used by traced and compiled programs),
a fork's text joined back, or a hint to cache the text so far. Expressions concatenate with
``+`` (with each other and with ``str``) into an :class:`ExprList`. The interpreter executes them
on a real backend; the tracer records them into a call graph.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from radixlang.sampling_fields import PROGRAM_FIELDS

if TYPE_CHECKING:
    from radixlang.lang.choices import ChoicesSamplingMethod
    from radixlang.lang.structured import JsonSchema
    from radixlang.lang.tools import Tool

_ids = itertools.count()


class Expr:
    """Something a program appends to its state."""

    def __init__(self) -> None:
        self.node_id = next(_ids)

    def __add__(self, other: object) -> ExprList:
        return ExprList([*_items(self), *_items(as_expr(other))])

    def __radd__(self, other: object) -> ExprList:
        return ExprList([*_items(as_expr(other)), *_items(self)])


def as_expr(value: object) -> Expr:
    """A program's appended value as an expression (str and numbers become text)."""
    if isinstance(value, Expr):
        return value
    if value is None:
        raise TypeError("cannot append None to a program state")
    if isinstance(value, str | int | float):
        return Text(str(value))
    raise TypeError(
        f"cannot append a {type(value).__name__} to a program state: "
        "append text, gen(...), select(...), a role, or their sums"
    )


def _items(expr: Expr) -> list[Expr]:
    return list(expr.items) if isinstance(expr, ExprList) else [expr]


class ExprList(Expr):
    def __init__(self, items: Sequence[Expr]) -> None:
        super().__init__()
        self.items = list(items)

    def __repr__(self) -> str:
        return f"ExprList({self.items!r})"


class Text(Expr):
    def __init__(self, value: str) -> None:
        super().__init__()
        self.value = value

    def __repr__(self) -> str:
        return f"Text({self.value!r})"


class _ResolveSampling:
    def resolve(self, overrides: dict[str, Any], extra_stop: Sequence[str] = ()) -> dict[str, Any]:
        """The sampling parameters of one call: the call's overrides, else the run's defaults,
        else the table's default (or nothing, for a field the backend defaults itself: see
        ``SamplingField.omit_unset``), in the engine's names; ``extra_stop`` (the chat
        template's end of turn) is added."""
        out: dict[str, Any] = {}
        for f in PROGRAM_FIELDS:
            value = overrides.get(f.name)  # a call's None leaves the run's default in place
            if value is None:
                value = getattr(self, f.name)
            if value is None:
                if f.omit_unset:
                    continue
                value = copy.copy(f.default)
            out[f.name] = value
        stop = out["stop"]
        stop = [stop] if isinstance(stop, str) else list(stop)
        out["stop"] = stop + [s for s in extra_stop if s not in stop]
        out["stop_token_ids"] = list(out["stop_token_ids"])
        return out


# A program run's defaults for every gen call (the sampling keywords of ``run``, in the
# engine's names): one field per program row of sampling_fields.SAMPLING_FIELDS, None unset.
SamplingDefaults = dataclasses.make_dataclass(
    "SamplingDefaults",
    [(f.name, f.annotation | None, dataclasses.field(default=None)) for f in PROGRAM_FIELDS],
    bases=(_ResolveSampling,),
    namespace={"__module__": __name__},
)


class Gen(Expr):
    """Generate text into variable ``name`` (``None`` keeps it only in the text).

    At most one constraint on the output's form: ``regex``, ``json_schema`` (checked by ``gen``:
    its JSON text, the schema, and the pydantic model it came from), a Lark ``grammar``, an
    ``ebnf`` grammar, or a ``dtype``. With ``tools`` (and ``tool_mode`` "auto" or "required")
    the output may be (or must be) calls of them; with "auto" a reply may follow
    ``json_schema``."""

    def __init__(
        self,
        name: str | None,
        sampling: dict[str, Any],
        *,
        n: int = 1,
        dtype: type | str | None = None,
        regex: str | None = None,
        json_schema: JsonSchema | None = None,
        grammar: str | None = None,
        ebnf: str | None = None,
        tools: Sequence[Tool] = (),
        shown_tools: Sequence[Tool] = (),
        tool_mode: str = "none",
        parallel_tool_calls: bool = True,
    ) -> None:
        super().__init__()
        self.name = name
        self.sampling = {k: v for k, v in sampling.items() if v is not None}
        self.n = n
        self.dtype = dtype
        self.regex = regex
        self.schema = json_schema
        self.grammar = grammar
        self.ebnf = ebnf
        self.tools = tuple(tools)  # the tools it may call (none when tool_mode is "none")
        self.shown_tools = tuple(shown_tools) or self.tools  # all it was given
        self.tool_mode = tool_mode
        self.parallel_tool_calls = parallel_tool_calls

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_mode != "none"

    @property
    def json_schema(self) -> str | None:
        """The JSON schema's text, as backends send it."""
        return None if self.schema is None else self.schema.text

    @property
    def constraint_kind(self) -> str | None:
        """Which constraint the output follows: regex, json_schema, grammar, ebnf, dtype."""
        for kind in ("regex", "json_schema", "grammar", "ebnf", "dtype"):
            if getattr(self, kind) is not None:
                return kind
        return "tools" if self.calls_tools else None

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class Select(Expr):
    """Choose one of ``choices`` by the model's likelihood of each; the choice becomes text."""

    def __init__(
        self,
        name: str | None,
        choices: Sequence[str],
        temperature: float,
        method: ChoicesSamplingMethod,
    ) -> None:
        super().__init__()
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.method = method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, {self.choices!r})"


class RoleBegin(Expr):
    def __init__(self, role: str, attrs: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.role = role
        self.attrs = attrs or {}  # a tool turn's call id and tool name, for its message

    def __repr__(self) -> str:
        return f"RoleBegin({self.role!r})"


class RoleEnd(Expr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role!r})"


class RunTools(Expr):
    """Run the tool calls that gen ``name`` wrote (with that gen's tools, at once) and append
    each result as a ``tool`` turn."""

    def __init__(self, name: str, timeout: float) -> None:
        super().__init__()
        self.name = name
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"RunTools({self.name!r})"


class VarScopeBegin(Expr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class VarScopeEnd(Expr):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


class Variable(Expr):
    """The value of variable ``name`` of ``source`` (a state's executor), appended as text once
    it is ready. Traced programs hold these where a generated value is used."""

    def __init__(self, name: str, source: Any) -> None:
        super().__init__()
        self.name = name
        self.source = source

    def __repr__(self) -> str:
        return f"Variable({self.name!r})"


class ConcatenateAndAppend(Expr):
    """Append what each forked state (executor) added after the fork
    (``join("concate_and_append")``)."""

    def __init__(self, states: Sequence[Any]) -> None:
        super().__init__()
        self.states = list(states)
