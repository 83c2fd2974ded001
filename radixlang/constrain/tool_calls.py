"""Tool calls in a model's own format, shared by the language (``gen(tools=...)``) and the
servers: the prompt that shows tools to a model, the grammar that holds its output to valid
calls, and reading the calls back out of the text.

The format is a :class:`~radixlang.constrain.tool_formats.ToolFormat`: read off the model's
chat template, or named. The default (SmolLM2's, and radixlang's for templates that write no
calls) is one JSON array of calls between markers::

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

How each mode constrains the output (a Lark grammar, see :func:`call_grammar`):

- ``"required"``: the output is the calls, each naming one of the tools and holding arguments
  valid under that tool's ``parameters`` schema (one tool: a call of it).
- ``"auto"``: the calls, OR a reply with none (free text, or JSON under a schema). In a format
  whose template writes text before calls (Hermes/Qwen), the reply's text is free until the
  format's marker (``<tool_call>``), and from the marker on the calls must be valid: a model may
  say what it is about to do, then call (lazily, as llama.cpp's triggered grammars do, but
  exact: the mask holds at every token). In other formats a call starts the output.
- (``"none"`` shows no tools and constrains nothing: callers do not ask for a grammar.)

Torch-free and llguidance-free: the grammar is text that ``radixlang.constrain.grammar``
compiles where the engine runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from radixlang.constrain.sources import json_schema_text
from radixlang.constrain.tool_formats import (
    DEFAULT_FORMAT,
    ID_CHARS,
    ScannedCall,
    ToolFormat,
)

__all__ = ["ScannedCall", "ToolFormat", "call_grammar", "format_calls", "parse_calls",
           "parse_output", "scan_calls", "tools_prompt"]  # fmt: skip

MODES = ("none", "auto", "required")
_REGEX_META = set(".^$*+?()[]{}|\\-")


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is also a Lark string literal


def _lark_regex(text: str) -> str:
    """``text`` as a literal inside a Lark ``/.../`` regex (Rust syntax: only meta characters
    may be escaped; others go in a class, "/" too, since it would end the regex)."""
    out = []
    for c in text:
        if c.isalnum() or c == "_":
            out.append(c)
        elif c == "\n":
            out.append("\\n")
        elif c in _REGEX_META:
            out.append("\\" + c)
        else:
            out.append(f"[{c}]")
    return "".join(out)


def _closed_schema(schema: Mapping[str, Any], fmt: ToolFormat) -> str:
    """``schema`` as the grammar's ``%json`` takes it: objects closed (as all JSON output) and
    the format's layout."""
    out = json.loads(json_schema_text(dict(schema)))
    out["x-guidance"] = {
        "whitespace_flexible": False,
        "item_separator": fmt.item_separator,
        "key_separator": fmt.key_separator,
    }
    return json.dumps(out)


def _sequence(fmt: ToolFormat, *literals: str) -> str:
    """Literal text as grammar items: strings, and the format's marker tokens by id."""
    items = []
    for text in literals:
        for piece in _split_markers(text, fmt.special):
            if isinstance(piece, int):
                items.append(f"<[{piece}]>")
            elif piece:
                items.append(_lark_string(piece))
    return " ".join(items)


def _split_markers(text: str, special: Sequence[tuple[str, int]]) -> list[str | int]:
    """``text`` cut at each marker token: text pieces and marker ids, in order."""
    out: list[str | int] = [text]
    for marker, token in special:
        cut: list[str | int] = []
        for piece in out:
            if isinstance(piece, int):
                cut.append(piece)
                continue
            parts = piece.split(marker)
            for k, part in enumerate(parts):
                if k:
                    cut.append(token)
                cut.append(part)
        out = cut
    return out


def call_grammar(
    mode: str,
    tools: Sequence[tuple[str, Mapping[str, Any]]],
    parallel: bool = True,
    text_schema: Any = None,
    fmt: ToolFormat = DEFAULT_FORMAT,
) -> str:
    """The Lark grammar (llguidance's dialect, with ``%json`` and lazy ``suffix`` rules) of an
    output that calls ``tools`` (their names and arguments' schemas) in ``mode`` ("auto" or
    "required") in ``fmt``: the calls, and for ``auto`` the alternative of a reply (JSON under
    ``text_schema`` if given). With ``parallel`` false (or a format of one call per turn) the
    output holds one call."""
    if mode not in ("auto", "required") or not tools:
        raise ValueError(f"a call grammar needs tools and mode 'auto' or 'required', got {mode!r}")
    trigger = _lark_regex(fmt.trigger)
    marker_token = any(marker == fmt.trigger for marker, _ in fmt.special)
    lines = []
    lazy = mode == "auto" and text_schema is None and fmt.text_before is not None
    if mode == "auto" and text_schema is not None:
        lines.append("start: calls | reply")
        lines.append(f"reply: %json {_closed_schema(_as_schema(text_schema), fmt)}")
    elif lazy and marker_token:
        # The marker is a token, which text (bytes) cannot hold: text ending as the format
        # writes it before calls, then the calls; or text alone. (Free text needs no watch for
        # the marker, which halves its mask time: 33 -> 17 us a token with the default
        # tokenizer, bench_tool_masks.)
        lines.append("start: calls | TEXT_BEFORE calls | TEXT")
        lines.append(f"TEXT_BEFORE: /(?s:.+){_lark_regex(fmt.text_before or '')}/")
        lines.append("TEXT: /(?s:.+)/")
    elif mode == "auto" and marker_token:
        lines.append("start: calls | TEXT")
        lines.append("TEXT: /(?s:.+)/")
    elif lazy:
        # Text, then the calls: the text is lazily matched up to the first marker (which the
        # suffix writes), so a marker always starts the calls; or text without a marker.
        lines.append("start: calls | text calls_after_marker | TEXT")
        lines.append(f"text[suffix={_lark_string(fmt.text_before + fmt.trigger)}]: /(?s:.+)/")
        lines.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*){trigger}(?s:.*)/")
    elif mode == "auto":
        lines.append("start: calls | TEXT")
        # Any text but one that starts with the marker (llguidance's & and ~ on lexemes).
        lines.append(f"TEXT: /(?s:.+)/ & ~/{trigger}(?s:.*)/")
    else:
        lines.append("start: calls")
    more = f" ({_sequence(fmt, fmt.between or '')} call)*" if parallel and fmt.parallel else ""
    tail = _sequence(fmt, fmt.tail)
    lines.append(f"calls: {_sequence(fmt, fmt.head)} call{more} {tail}".rstrip())
    if lazy and not marker_token:
        rest = _sequence(fmt, fmt.head[len(fmt.trigger) :])
        lines.append(f"calls_after_marker: {rest} call{more} {tail}".rstrip())
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, (name, parameters) in enumerate(tools):
        parts = []
        for kind, text in fmt.pieces:
            if kind == "lit":
                parts.append(_sequence(fmt, text))
            elif kind == "name":
                parts.append(_lark_string(name))
            elif kind == "args":
                parts.append(f"args_{i}")
            else:
                parts.append("CALL_ID")
        lines.append(f"call_{i}: " + " ".join(parts))
        lines.append(f"args_{i}: %json {_closed_schema(parameters, fmt)}")
    if fmt.id_length:
        lines.append(f"CALL_ID: /{ID_CHARS}{{{fmt.id_length}}}/")
    return "\n".join(lines) + "\n"


def free_text_marker(source: str) -> str | None:
    """The marker of a grammar :func:`call_grammar` wrote for ``auto`` with free text before
    calls and the marker as text (the form ``free_text.FreeText`` skips masks in), or None for
    any other grammar."""
    lines = source.splitlines()
    head = "start: calls | text calls_after_marker | TEXT"
    if len(lines) < 3 or lines[0] != head or not lines[1].startswith("text[suffix="):
        return None
    try:
        suffix = json.loads(lines[1][len("text[suffix=") : lines[1].index("]: ")])
    except (ValueError, TypeError):
        return None
    for k in range(len(suffix)):
        marker = suffix[k:]
        if lines[2] == f"TEXT: /(?s:.+)/ & ~/(?s:.*){_lark_regex(marker)}(?s:.*)/":
            return marker
    return None


def _as_schema(schema: Any) -> dict[str, Any]:
    return json.loads(schema) if isinstance(schema, str) else dict(schema)


def tools_prompt(mode: str, specs: Sequence[Mapping[str, Any]],
                 fmt: ToolFormat = DEFAULT_FORMAT) -> str:  # fmt: skip
    """The tools (OpenAI's ``{"type": "function", "function": {...}}`` dicts) and the call
    format, for a system message (when the chat template does not show tools itself)."""
    listed = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in specs)
    text = f"You can call these functions (tools):\n<tools>\n{listed}\n</tools>\n"
    if fmt == DEFAULT_FORMAT:  # (equal, not only the same object: one read from a server)
        call = '{"name": <function name>, "arguments": <arguments object>}'
        example = f"<tool_call>[{call}]</tool_call>"
        text += (
            f"To call functions, reply with nothing but {example}, one JSON object per call in "
            "the array."
        )
    else:
        placeholder = ("<function name>", "<arguments object>")
        text += f"To call a function, write {fmt.render([placeholder])}"
        if fmt.parallel:
            text += f"; to call several, {fmt.render([placeholder] * 2)}"
        text += "."
    if mode == "auto":
        return text + " Otherwise, reply to the user as usual."
    if len(specs) == 1:
        return text + f" Now call the function {specs[0]['function']['name']}."
    return text + " Now call at least one of them."


def format_calls(calls: Sequence[tuple[str, Any]], fmt: ToolFormat = DEFAULT_FORMAT) -> str:
    """Calls (name, arguments[, id]) as the format writes them: how an earlier turn's calls are
    written back into a prompt."""
    return fmt.render(calls)


def scan_calls(text: str, fmt: ToolFormat = DEFAULT_FORMAT) -> tuple[list[ScannedCall], bool]:
    """The calls in ``text`` (the calls' text, or the start of it) so far, and whether they are
    closed. Each call is reported once its name is known, with the arguments so far."""
    return fmt.scan(text)


def parse_output(text: str, fmt: ToolFormat = DEFAULT_FORMAT) -> tuple[str, list[ScannedCall]]:
    """An output's text before its calls (all of it when it calls nothing) and its whole calls
    (a call cut off, e.g. by ``max_tokens``, and those after it are dropped)."""
    found = fmt.parse(text)
    if found is None:
        return text, []
    before, calls, _ = found
    whole = []
    for call in calls:
        if not call.complete:
            break
        whole.append(call)
    return (before, whole) if whole else (text, [])


def parse_calls(text: str, fmt: ToolFormat = DEFAULT_FORMAT) -> list[tuple[str, Any]]:
    """The whole calls (name, arguments object) in an output; none for a reply without calls.
    Arguments that are not JSON (only from a service that does not follow the grammar) are
    kept as their text."""
    out: list[tuple[str, Any]] = []
    for call in parse_output(text.strip(), fmt)[1]:
        try:
            out.append((call.name, json.loads(call.arguments)))
        except json.JSONDecodeError:
            out.append((call.name, call.arguments))
    return out
