"""Tools for programs: a Python function or a pydantic model as a tool a model may call (its
name, its description and the JSON schema of its arguments), the calls a model wrote, and
running them.

A function's tool takes its name, its docstring's first paragraph as the description, and its
parameters (annotations, defaults, and the descriptions of a Google-style ``Args:`` section) as
the schema, through a pydantic model of the arguments; a pydantic model class is a tool whose
call returns the validated model. :func:`run_tool_calls` runs a model's calls at once (plain
functions on threads, ``async`` ones awaited) and turns each outcome into a
:class:`ToolResult` the model can read: the value as text, or an error (an unknown tool,
arguments that do not validate, an exception, a timeout). A tool's failure never becomes the
program's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import re
import time
import typing
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field, ValidationError, create_model
from pydantic.fields import FieldInfo

DEFAULT_TIMEOUT_S = 30.0
_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s+(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


@dataclass(frozen=True)
class Tool:
    """A tool a model may call: ``name``, ``description``, ``parameters`` (the JSON schema of
    its arguments object); ``fn`` runs it. ``arguments`` is the pydantic model its arguments
    validate against (a Python tool's); a tool with none (an MCP server's) is checked against
    ``parameters`` itself."""

    name: str
    description: str
    parameters: dict[str, Any]
    arguments: type[BaseModel] | None
    fn: Callable[..., Any]

    def check(self, arguments: Any) -> dict[str, Any]:
        """The keyword arguments ``fn`` takes for a call's ``arguments``; raises
        :class:`InvalidArguments` saying what is wrong."""
        if not isinstance(arguments, Mapping):
            raise InvalidArguments(f"the arguments must be an object, got {arguments!r}")
        if self.arguments is None:
            import jsonschema

            errors = sorted(jsonschema.Draft202012Validator(self.parameters)
                            .iter_errors(dict(arguments)), key=str)  # fmt: skip
            if errors:
                raise InvalidArguments("; ".join(
                    f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
                    for e in errors
                ))  # fmt: skip
            return dict(arguments)
        try:
            parsed = self.arguments.model_validate(dict(arguments))
        except ValidationError as e:
            raise InvalidArguments("; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'arguments'}: {err['msg']}"
                for err in e.errors()
            )) from None  # fmt: skip
        if self.fn is self.arguments:  # a pydantic model tool: called with the model
            return {"": parsed}
        return {name: getattr(parsed, name) for name in type(parsed).model_fields}

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's ``tools`` list takes it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


class InvalidArguments(ValueError):
    """A call's arguments do not fit its tool's schema."""


@dataclass(frozen=True)
class ToolCall:
    """A call a model wrote: the tool's name and its arguments (an object)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    id: str = ""

    def openai(self) -> dict[str, Any]:
        """The call as an OpenAI assistant message's ``tool_calls`` item."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": arguments}}  # fmt: skip


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_choice_of(tool_choice: Any, tools: Sequence[Tool]) -> tuple[str, tuple[Tool, ...]]:
    """``gen``'s ``tool_choice`` (``"auto"``, the default with tools; ``"required"``; ``"none"``;
    or a tool's name, or the tool itself: call that one) as (mode, the tools it may call)."""
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice in ("auto", "required", "none"):
        if tool_choice != "none" and not tools:
            raise ValueError(f"tool_choice={tool_choice!r} needs tools=")
        return tool_choice, tuple(tools) if tool_choice != "none" else ()
    wanted = tool_choice if isinstance(tool_choice, str) else as_tool(tool_choice).name
    for tool in tools:
        if tool.name == wanted:
            return "required", (tool,)
    raise ValueError(
        f"tool_choice={tool_choice!r}: expected 'auto', 'required', 'none' or the name of one "
        f"of the tools ({', '.join(t.name for t in tools) or 'none given'})"
    )


@dataclass(frozen=True)
class ToolResult:
    """What a call gave, as text for the model (``is_error``: it failed; ``content`` says how),
    and how long it took."""

    call_id: str
    name: str
    content: str
    is_error: bool = False
    seconds: float = 0.0


def as_tool(obj: Any, name: str | None = None, description: str | None = None) -> Tool:
    """``obj`` as a :class:`Tool`: a Tool, a pydantic model class, or a function (sync or
    async) whose parameters can be named as keywords."""
    if isinstance(obj, Tool):
        return obj
    if isinstance(obj, type) and issubclass(obj, BaseModel):
        doc = _summary(obj.__doc__)
        return _make(name or obj.__name__, description or doc, obj, obj)
    if not callable(obj):
        raise TypeError(f"a tool is a function, a pydantic model class or a Tool, got {obj!r}")
    fn_name = name or getattr(obj, "__name__", None)
    if not fn_name or fn_name == "<lambda>":
        raise TypeError("a lambda tool needs name=")
    arg_help = _arg_descriptions(obj.__doc__)
    try:  # string annotations (``from __future__ import annotations``) resolved
        hints = typing.get_type_hints(obj, include_extras=True)
    except Exception:  # a name only the function's closure knows: the raw annotations
        hints = {}
    fields: dict[str, Any] = {}
    for param in inspect.signature(obj).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(
                f"tool {fn_name!r}: parameter {param.name!r} cannot be given by name; a tool's "
                "arguments are a JSON object"
            )
        annotation = hints.get(
            param.name, Any if param.annotation is param.empty else param.annotation
        )
        default = ... if param.default is param.empty else param.default
        if isinstance(default, FieldInfo):  # ``x: str = Field(max_length=8)``
            if default.description is None and param.name in arg_help:
                default.description = arg_help[param.name]
            fields[param.name] = (annotation, default)
            continue
        fields[param.name] = (annotation, Field(default, description=arg_help.get(param.name)))
    arguments = create_model(f"{fn_name}_arguments", **fields)
    return _make(fn_name, description or _summary(obj.__doc__), arguments, obj)


def _make(name: str, description: str, arguments: type[BaseModel], fn: Callable[..., Any]) -> Tool:
    schema = arguments.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return make_tool(name, description, schema, fn, arguments)


def make_tool(
    name: str,
    description: str,
    parameters: Mapping[str, Any],
    fn: Callable[..., Any],
    arguments: type[BaseModel] | None = None,
) -> Tool:
    """A tool from its parts: ``fn`` takes the arguments as keywords; with no pydantic
    ``arguments`` model they are checked against the ``parameters`` schema."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise ValueError(f"tool name {name!r}: 1 to 64 letters, digits, '_' or '-'")
    if dict(parameters).get("type", "object") != "object":
        raise ValueError(f"tool {name!r}: its parameters must describe an object")
    return Tool(name, description, dict(parameters), arguments, fn)


def _summary(doc: str | None) -> str:
    """A docstring's first paragraph, on one line."""
    text = inspect.cleandoc(doc or "")
    return " ".join(text.split("\n\n")[0].split())


def _arg_descriptions(doc: str | None) -> dict[str, str]:
    """The descriptions of a Google-style ``Args:`` section, by parameter name."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    in_args, current = False, None
    for line in lines:
        if _ARGS_HEADER.match(line):
            in_args, current = True, None
            continue
        if not in_args:
            continue
        if line and not line[0].isspace():  # the next section
            break
        match = _ARG_LINE.match(line)
        if match and len(line) - len(line.lstrip()) <= 4:
            current = match.group(1).lstrip("*")
            out[current] = match.group(3).strip()
        elif current and line.strip():
            out[current] = f"{out[current]} {line.strip()}".strip()
    return out


def tools_by_name(tools: Iterable[Any]) -> dict[str, Tool]:
    """Each of ``tools`` as a Tool, by name (a name given twice is an error)."""
    out: dict[str, Tool] = {}
    for obj in tools:
        tool = as_tool(obj)
        if tool.name in out:
            raise ValueError(f"two tools are named {tool.name!r}")
        out[tool.name] = tool
    return out


def run_tool_calls(
    calls: Sequence[ToolCall], tools: Iterable[Any], timeout: float = DEFAULT_TIMEOUT_S
) -> list[ToolResult]:
    """Run ``calls`` at once and return their results in order; each call may take up to
    ``timeout`` seconds (a slower one's result is an error; a plain function's thread is left
    to finish on its own, as a thread cannot be stopped)."""
    if not timeout > 0:
        raise ValueError(f"timeout must be seconds > 0, got {timeout!r}")
    by_name = tools_by_name(tools)
    if not calls:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(len(calls), thread_name_prefix="radixlang-tool")
    try:
        started = [(time.perf_counter(), pool.submit(_run_one, c, by_name, timeout)) for c in calls]
        results = []
        for call, (t0, future) in zip(calls, started, strict=True):
            left = max(0.0, timeout - (time.perf_counter() - t0))
            try:
                content, is_error = future.result(timeout=left + 0.05)
            except concurrent.futures.TimeoutError:
                content, is_error = f"error: {call.name} timed out after {timeout:g} s", True
            results.append(
                ToolResult(call.id, call.name, content, is_error, time.perf_counter() - t0)
            )
        return results
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _run_one(call: ToolCall, tools: Mapping[str, Tool], timeout: float) -> tuple[str, bool]:
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool named {call.name!r}; the tools are {', '.join(tools)}", True
    try:
        kwargs = tool.check(call.arguments)
    except InvalidArguments as e:
        return f"error: {call.name}: invalid arguments: {e}", True
    try:
        if "" in kwargs:  # a pydantic model tool: the validated model
            value: Any = kwargs[""]
        else:
            value = tool.fn(**kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(_bounded(value, timeout))
    except TimeoutError:
        return f"error: {call.name} timed out after {timeout:g} s", True
    except Exception as e:  # the tool failed: the model reads why
        return f"error: {call.name} raised {type(e).__name__}: {e}", True
    return _as_text(value), False


async def _bounded(awaitable: Any, timeout: float) -> Any:
    return await asyncio.wait_for(awaitable, timeout)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return json.dumps(value, default=str)
