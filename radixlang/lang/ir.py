"""The expressions a program appends to its state (``s += ...``).

Each is a small immutable record: text, a generation call, a choice, a role boundary, a variable
scope boundary, a reference to another state's variable (used by traced and compiled programs),
a fork's text joined back, or a hint to cache the text so far. Expressions concatenate with
``+`` (with each other and with ``str``) into an :class:`ExprList`. The interpreter executes them
on a real backend; the tracer records them into a call graph.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixlang.lang.choices import ChoicesSamplingMethod
    from radixlang.lang.structured import JsonSchema

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


# Sampling keys that are not sent when unset, so that the backend's own default applies.
# max_new_tokens among them: an engine (and a server) cuts its default (128) to what the
# context window has left, but refuses a max_new_tokens given that does not fit, as SGLang's
# and OpenAI's servers do. So a gen without max_tokens near the end of the context still runs.
_OPTIONAL = (
    "max_new_tokens",
    "seed",
    "repetition_penalty",
    "skip_special_tokens",
    "beam_width",
    "length_penalty",
    "early_stopping",
)


@dataclasses.dataclass
class SamplingDefaults:
    """A program run's defaults for every gen call (the keyword arguments of ``run``)."""

    max_new_tokens: int | None = None  # None: the backend's default (128, cut to fit)
    min_new_tokens: int = 0
    stop: list[str] | str = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    ignore_eos: bool = False
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    seed: int | None = None
    # None: not sent, so a backend's own default applies (1.0 and True everywhere).
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    beam_width: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None

    def resolve(self, overrides: dict[str, Any], extra_stop: Sequence[str] = ()) -> dict[str, Any]:
        """The sampling parameters of one call: the defaults, with the call's overrides on top,
        in the engine's names; ``extra_stop`` (the chat template's end of turn) is added."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # a call's None leaves the run's default in place
            value = overrides.get(f.name)
            out[f.name] = getattr(self, f.name) if value is None else value
        stop = out["stop"]
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        out["stop"] = stop + [s for s in extra_stop if s not in stop]
        out["stop_token_ids"] = list(out["stop_token_ids"] or [])
        out["return_logprob"] = bool(out["return_logprob"])
        out["top_logprobs_num"] = out["top_logprobs_num"] or 0
        if out["logprob_start_len"] is None:
            out["logprob_start_len"] = -1
        for optional in _OPTIONAL:
            if out[optional] is None:
                del out[optional]
        return out


class Gen(Expr):
    """Generate text into variable ``name`` (``None`` keeps it only in the text).

    At most one constraint on the output's form: ``regex``, ``json_schema`` (checked by ``gen``:
    its JSON text, the schema, and the pydantic model it came from), a Lark ``grammar``, an
    ``ebnf`` grammar, or a ``dtype``."""

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
        return None

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
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role!r})"


class RoleEnd(Expr):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role!r})"


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
