"""OpenAI function calling for the chat route: tool definitions and ``tool_choice``, the
prompt that shows the tools to the model, the grammar that makes its calls valid, and reading
the calls back out of the generated text (whole, or streamed as OpenAI's deltas).

The calls' text format, its grammar and its reading are ``radixlang.constrain.tool_calls``'s
(shared with the language's ``gen(tools=...)``); ``"none"`` shows no tools and constrains
nothing.

The calls are written in the model's own format (a ``ToolFormat`` read off its chat template,
or the one ``tool_call_format`` names), so the model writes what it was trained to write and a
client reading raw text sees the model's format. The model sees the tools through its chat
template (``tools=``) when the template writes them into the prompt; otherwise (SmolLM2's
template ignores them) a system message lists them and states the call format. Earlier calls
in the history go to a template that writes calls as they are, and into the content in the
call format otherwise; ``tool`` messages keep their role (or, for a template that refuses the
role, become user messages wrapped in ``<tool_response>``).
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixlang.constrain import ConstraintError, json_schema_text
from radixlang.constrain import tool_calls as call_format
from radixlang.constrain.tool_formats import DEFAULT_FORMAT, ScannedCall, ToolFormat
from radixlang.server.common import APIError

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]  # the arguments' JSON schema
    spec: dict[str, Any]  # the tool as the request gave it (for the chat template)
    where: str  # "tools[2]", for error messages


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none", "auto" or "required" (a named function is "required" with one tool)
    tools: tuple[Tool, ...]  # the tools the output may call
    fmt: ToolFormat = DEFAULT_FORMAT  # how the model writes calls

    @property
    def calls(self) -> bool:
        """Whether the output may hold calls."""
        return self.mode != "none" and bool(self.tools)


def parse_tools(tools: list[Any] | None) -> list[Tool]:
    """The request's function tools; a 400 naming the field for a malformed one."""
    out: list[Tool] = []
    for i, spec in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(spec, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        if spec.get("type") != "function":
            raise APIError(400, f"{where}.type must be 'function', got {spec.get('type')!r}",
                           param=f"{where}.type")  # fmt: skip
        unknown = sorted(set(spec) - {"type", "function"})
        if unknown:
            raise APIError(400, f"{where}: unknown field {unknown[0]}",
                           param=f"{where}.{unknown[0]}")  # fmt: skip
        function = spec.get("function")
        if not isinstance(function, dict):
            raise APIError(400, f"{where}.function must be an object", param=f"{where}.function")
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise APIError(400, f"{where}.function: unknown field {unknown[0]}",
                           param=f"{where}.function.{unknown[0]}")  # fmt: skip
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(
                400,
                f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                param=f"{where}.function.name",
            )
        if any(t.name == name for t in out):
            raise APIError(400, f"{where}.function.name: two tools are named {name!r}",
                           param=f"{where}.function.name")  # fmt: skip
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise APIError(400, f"{where}.function.description must be a string",
                           param=f"{where}.function.description")  # fmt: skip
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise APIError(400, f"{where}.function.strict must be a bool",
                           param=f"{where}.function.strict")  # fmt: skip
        parameters = function.get("parameters")
        if parameters is None:
            parameters = _NO_PARAMETERS
        if not isinstance(parameters, dict):
            raise APIError(400, f"{where}.function.parameters must be a JSON schema object",
                           param=f"{where}.function.parameters")  # fmt: skip
        if parameters.get("type", "object") != "object":
            raise APIError(400, f"{where}.function.parameters must describe an object, got "
                           f"type {parameters.get('type')!r}",
                           param=f"{where}.function.parameters")  # fmt: skip
        try:
            json_schema_text(parameters)
        except ConstraintError as e:
            raise APIError(400, f"{where}.function.parameters: {e}",
                           param=f"{where}.function.parameters") from None  # fmt: skip
        out.append(Tool(name, parameters, {"type": "function", "function": function}, where))
    return out


def parse_tool_choice(
    choice: Any, tools: list[Tool], fmt: ToolFormat = DEFAULT_FORMAT
) -> ToolChoice:
    """``tool_choice`` (OpenAI's default: ``"auto"`` with tools, ``"none"`` without), for a
    model that writes calls in ``fmt``."""
    if choice is None:
        choice = "auto" if tools else "none"
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        return ToolChoice(choice, tuple(tools) if choice != "none" else (), fmt)
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        for tool in tools:
            if tool.name == name:
                return ToolChoice("required", (tool,), fmt)
        raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools",
                       param="tool_choice.function.name")  # fmt: skip
    raise APIError(
        400,
        "tool_choice must be 'none', 'auto', 'required' or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}',
        param="tool_choice",
    )


def call_grammar(choice: ToolChoice, parallel: bool, text_schema: Any = None) -> str:
    """The Lark grammar of the output ``choice`` allows (see ``call_format.call_grammar``)."""
    tools = [(tool.name, tool.parameters) for tool in choice.tools]
    return call_format.call_grammar(choice.mode, tools, parallel, text_schema, choice.fmt)


def tools_prompt(choice: ToolChoice) -> str:
    """The tools and the call format, for a system message (when the chat template does not
    show the tools itself)."""
    return call_format.tools_prompt(choice.mode, [tool.spec for tool in choice.tools], choice.fmt)


def call_block(tool_calls: Sequence[Any], where: str, fmt: ToolFormat = DEFAULT_FORMAT) -> str:
    """An assistant message's ``tool_calls`` in ``fmt``, for chat templates that do not write
    tool calls themselves; a 400 naming the field if they are malformed."""
    calls = []
    for j, call in enumerate(tool_calls):
        here = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(400, f"{here}.function.name must be a string",
                           param=f"{here}.function.name")  # fmt: skip
        arguments = function.get("arguments")  # type: ignore[union-attr]
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # else shown as the string it is
                arguments = json.loads(arguments) if arguments.strip() else {}
        calls.append((name, arguments, call.get("id")))
    try:
        return call_format.format_calls(calls, fmt)
    except ValueError as e:  # more calls than the format holds
        raise APIError(400, f"{where}.tool_calls: {e}", param=f"{where}.tool_calls") from None


def template_tool_calls(tool_calls: Sequence[Any]) -> list[Any]:
    """``tool_calls`` as Hugging Face chat templates take them: ``arguments`` as an object."""
    out = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError:
                arguments = function["arguments"]
            call = {**call, "function": {**function, "arguments": arguments}}
        out.append(call)
    return out


# ---- reading calls out of the output --------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls_json(calls: Sequence[ScannedCall], ids: Sequence[str]) -> list[dict[str, Any]]:
    """OpenAI's ``message.tool_calls`` (``ids``: for calls whose format writes none)."""
    return [
        {"id": call.id or ids[k], "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
        for k, call in enumerate(calls)
    ]  # fmt: skip


@dataclass
class CallStream:
    """One streamed choice's output as OpenAI's deltas: text as ``content``; calls as
    ``tool_calls`` items (the first for each call with its ``id``, ``type`` and name, then its
    arguments in pieces). With ``auto``, text that could still become the start of the calls is
    held back until it either is (the calls begin) or cannot be."""

    may_call: bool
    must_call: bool
    fmt: ToolFormat = DEFAULT_FORMAT
    text: str = ""
    mode: str | None = None  # "text" or "calls" once known
    ids: list[str] = field(default_factory=list)
    sent_arguments: list[int] = field(default_factory=list)
    closed: bool = False
    _sent: int = 0  # the text sent as content
    _calls_at: int = 0  # where the calls begin in ``text``

    def __post_init__(self) -> None:
        if not self.may_call:
            self.mode = "text"
        elif self.must_call:
            self.mode = "calls"

    def feed(self, new_text: str) -> list[dict[str, Any]]:
        """The deltas ``new_text`` makes (none, content deltas, tool-call deltas)."""
        self.text += new_text
        if self.mode == "text":
            return self._content(len(self.text))
        if self.mode == "calls":
            return self._call_deltas()
        found = self.fmt.locate(self.text)
        if found is not None:
            before, self._calls_at = found
            self.mode = "calls"
            return self._content(len(before)) + self._call_deltas()
        held = self.fmt.may_become_calls(self.text)
        if not held and self.fmt.text_before is None:
            self.mode = "text"  # calls start the output in this format: this is a reply
        return self._content(len(self.text) - held)

    def _content(self, end: int) -> list[dict[str, Any]]:
        piece, self._sent = self.text[self._sent : end], max(self._sent, end)
        return [{"content": piece}] if piece else []

    def _call_deltas(self) -> list[dict[str, Any]]:
        calls, self.closed = self.fmt.scan(self.text[self._calls_at :])
        items = []
        for k, call in enumerate(calls):
            piece = call.arguments[self.sent_arguments[k] :] if k < len(self.ids) else ""
            if k == len(self.ids):  # a new call: its first item has the id, type and name
                self.ids.append(call.id or new_call_id())
                self.sent_arguments.append(0)
                piece = call.arguments
                items.append({"index": k, "id": self.ids[k], "type": "function",
                              "function": {"name": call.name, "arguments": piece}})  # fmt: skip
            elif piece:
                items.append({"index": k, "function": {"arguments": piece}})
            self.sent_arguments[k] = len(call.arguments)
        return [{"tool_calls": items}] if items else []

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for text still held back when the output ends (a reply that ended in what
        could have started a call)."""
        if self.mode is None:
            self.mode = "text"
            return self._content(len(self.text))
        return []

    @property
    def called(self) -> bool:
        return self.mode == "calls" and bool(self.ids)


def parse_output(text: str, choice: ToolChoice) -> tuple[str, list[ScannedCall], bool] | None:
    """A whole output's text before its calls, its calls and whether they are closed; None if
    the output is a text reply."""
    if not choice.calls:
        return None
    if choice.mode == "required":
        return "", *choice.fmt.scan(text)
    return choice.fmt.parse(text)
