"""The one text format of tool calls, shared by the language (``gen(tools=...)``) and the
OpenAI server: the prompt that shows tools to a model, the grammar that holds its output to
valid calls, and reading the calls back out of the text.

The format (SmolLM2's, and close to Hermes' and Qwen's)::

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

one JSON array of calls between the markers, written compactly as ``json.dumps`` writes it.

How each mode constrains the output (a Lark grammar, see :func:`call_grammar`):

- ``"required"``: the output is a call block, each call naming one of the tools and holding
  arguments valid under that tool's ``parameters`` schema (one tool: a call of it).
- ``"auto"``: EITHER a call block as above OR a reply that does not start with ``<tool_call>``
  (free text, or JSON under a schema). Nothing forces a call: the model's own first tokens
  decide, and once it has written the marker the rest must be a valid call.
- (``"none"`` shows no tools and constrains nothing: callers do not ask for a grammar.)

Torch-free and llguidance-free: the grammar is text that ``radixlang.constrain.grammar``
compiles where the engine runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixlang.constrain.sources import json_schema_text

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
MODES = ("none", "auto", "required")
# The arguments' JSON layout, as the rest of radixlang's JSON output (see radixlang.constrain).
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is also a Lark string literal


def _closed_schema(schema: Mapping[str, Any]) -> str:
    """``schema`` as the grammar's ``%json`` takes it: objects closed (as all JSON output) and
    the compact layout."""
    out = json.loads(json_schema_text(dict(schema)))
    out["x-guidance"] = _JSON_LAYOUT
    return json.dumps(out)


def call_grammar(
    mode: str,
    tools: Sequence[tuple[str, Mapping[str, Any]]],
    parallel: bool = True,
    text_schema: Any = None,
) -> str:
    """The Lark grammar (llguidance's dialect, with ``%json``) of an output that calls
    ``tools`` (their names and arguments' schemas) in ``mode`` ("auto" or "required"): a call
    block, and for ``auto`` the alternative of a reply that does not start with the call marker
    (JSON under ``text_schema`` if given). With ``parallel`` false a block holds one call."""
    if mode not in ("auto", "required") or not tools:
        raise ValueError(f"a call grammar needs tools and mode 'auto' or 'required', got {mode!r}")
    lines = []
    if mode == "auto":
        if text_schema is not None:
            lines.append("start: calls | reply")
            lines.append(f"reply: %json {_closed_schema(_as_schema(text_schema))}")
        else:
            lines.append("start: calls | TEXT")
            # Any text but one that starts with the marker (llguidance's & and ~ on lexemes).
            lines.append(f"TEXT: /(?s:.+)/ & ~/{re.escape(CALL_START)}(?s:.*)/")
    else:
        lines.append("start: calls")
    more = ' (", " call)*' if parallel else ""
    opening, closing = _lark_string(CALL_START + "["), _lark_string("]" + CALL_END)
    lines.append(f"calls: {opening} call{more} {closing}")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, (name, parameters) in enumerate(tools):
        head = _lark_string(f'{{"name": "{name}", "arguments": ')
        lines.append(f'call_{i}: {head} args_{i} "}}"')
        lines.append(f"args_{i}: %json {_closed_schema(parameters)}")
    return "\n".join(lines) + "\n"


def _as_schema(schema: Any) -> dict[str, Any]:
    return json.loads(schema) if isinstance(schema, str) else dict(schema)


def tools_prompt(mode: str, specs: Sequence[Mapping[str, Any]]) -> str:
    """The tools (OpenAI's ``{"type": "function", "function": {...}}`` dicts) and the call
    format, for a system message (when the chat template does not show tools itself)."""
    listed = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in specs)
    call = '{"name": <function name>, "arguments": <arguments object>}'
    example = f"{CALL_START}[{call}]{CALL_END}"
    text = (
        "You can call these functions (tools):\n<tools>\n"
        f"{listed}\n</tools>\n"
        f"To call functions, reply with nothing but {example}, one JSON object per call in the "
        "array."
    )
    if mode == "auto":
        return text + " Otherwise, reply to the user as usual."
    if len(specs) == 1:
        return text + f" Now call the function {specs[0]['function']['name']}."
    return text + " Now call at least one of them."


def format_calls(calls: Sequence[tuple[str, Any]]) -> str:
    """Calls (name, arguments) as a call block: how an earlier turn's calls are written back
    into a prompt."""
    items = [json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
             for name, arguments in calls]  # fmt: skip
    return f"{CALL_START}[{', '.join(items)}]{CALL_END}"


@dataclass
class ScannedCall:
    name: str
    arguments: str  # the arguments' JSON text so far
    complete: bool  # the arguments are whole


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value that starts at ``text[start]`` ends (one past it), or None if
    ``text`` stops before it does. A scalar ends at the first character that cannot be part
    of it, so it needs one character after it."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"' or first in "{[":
        depth, in_string, escaped = 0, False, False
        for i in range(start, len(text)):
            c = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_string = False
                    if depth == 0:
                        return i + 1
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
        return None
    for i in range(start, len(text)):
        if text[i] in ",}] \n\t":
            return i
    return None


def scan_calls(text: str) -> tuple[list[ScannedCall], bool]:
    """The calls in ``text`` (a call block, or the start of one) so far, and whether the block
    is closed. Each call is reported once its name is known, with the arguments so far."""
    calls: list[ScannedCall] = []
    pos = len(CALL_START) + 1  # past "<tool_call>["
    if not text.startswith(CALL_START + "["):
        return calls, False
    while True:
        head = '{"name": "'
        if not text.startswith(head, pos):
            return calls, False
        name_end = text.find('"', pos + len(head))
        if name_end < 0:
            return calls, False
        name = text[pos + len(head) : name_end]
        args_key = ', "arguments": '
        if not text.startswith(args_key, name_end + 1):
            return calls, False
        start = name_end + 1 + len(args_key)
        end = _value_end(text, start)
        calls.append(ScannedCall(name, text[start : len(text) if end is None else end],
                                 end is not None))  # fmt: skip
        if end is None or not text.startswith("}", end):
            return calls, False
        pos = end + 1
        if text.startswith(", ", pos):
            pos += 2
            continue
        return calls, text.startswith("]" + CALL_END, pos)


def parse_calls(text: str) -> list[tuple[str, Any]]:
    """The whole calls (name, arguments object) of an output that is a call block; none for a
    text reply, or a block cut off before its first call is whole (e.g. by ``max_tokens``).
    Arguments that are not JSON (only from a service that does not follow the grammar) are
    kept as their text."""
    out: list[tuple[str, Any]] = []
    for call in scan_calls(text.strip())[0]:
        if not call.complete:
            break
        try:
            out.append((call.name, json.loads(call.arguments)))
        except json.JSONDecodeError:
            out.append((call.name, call.arguments))
    return out
