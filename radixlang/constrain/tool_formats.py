"""How a model writes tool calls: a :class:`ToolFormat`, read off the model's own chat template
(:func:`derive_format`) or named (:data:`NAMED_FORMATS`).

A format is the literal text around the calls' holes, as the template renders an assistant turn
that calls tools::

    head  NAME  "", "arguments": "  ARGS  between  NAME ... ARGS  tail

``head`` comes before the first call's first hole, ``pieces`` are one call's holes (name, args,
and an id where the template writes one) with the literal text between them, ``between`` goes
from one call's last hole to the next call's first, ``tail`` from the last call's last hole to
the end of the turn. Hermes/Qwen's format, for example, has head ``<tool_call>\\n{"name": "``,
between ``}\\n</tool_call>\\n<tool_call>\\n{"name": "`` and tail ``}\\n</tool_call>``.

``text_before`` is what the template writes between an assistant message's text and its calls
(None when the template drops the text of a turn that calls), and ``trigger`` is the marker that
starts the calls (``<tool_call>``): text before a call is free until the marker, then the call
grammar holds (see ``tool_calls.call_grammar``).

Torch-free: the language, the server and the engine share it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
HOLES = ("name", "args", "id")
# The arguments' JSON layouts a template's ``tojson`` may write.
_LAYOUTS = ((", ", ": "), (",", ":"), (", ", ":"), (",", ": "))
# A marker that opens the calls: a tag, a bracketed control word, or a special token.
_MARKER = re.compile(r"<\|[^|<>\s]+\|>|</?[A-Za-z_][^<>\s]*>|\[[A-Z_]+\]")
ID_CHARS = "[A-Za-z0-9]"
# A thinking block at the start of an assistant turn (Qwen3, DeepSeek-R1; Magistral's tags).
_THINKING = re.compile(r"(?s:<think>.*?</think>|\[THINK\].*?\[/THINK\])\s*")


class ToolFormatError(ValueError):
    """A chat template whose tool-call format cannot be read."""


class NoToolCallsError(ToolFormatError):
    """A chat template that does not write tool calls at all (SmolLM2's)."""


@dataclass(frozen=True)
class ScannedCall:
    name: str
    arguments: str  # the arguments' JSON text so far
    complete: bool  # the arguments are whole
    id: str | None = None  # the call's id, in formats where the model writes one


@dataclass(frozen=True)
class ToolFormat:
    name: str
    head: str
    pieces: tuple[tuple[str, str], ...]  # ("name"|"args"|"id", "") holes and ("lit", text)
    between: str | None  # None: one call per turn
    tail: str
    text_before: str | None
    item_separator: str = ", "
    key_separator: str = ": "
    id_length: int | None = None  # the id's length where the format holds one
    # Markers the model's tokenizer has as tokens of their own (Qwen's <tool_call>, Mistral's
    # [TOOL_CALLS]), with their ids: the grammar names those tokens, not their text.
    special: tuple[tuple[str, int], ...] = ()

    def as_json(self) -> dict[str, Any]:
        """The format as JSON (a server's /get_model_info: its clients then write and read
        calls in it)."""
        out = dataclasses.asdict(self)
        out["pieces"] = [list(p) for p in self.pieces]
        out["special"] = [list(p) for p in self.special]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ToolFormat:
        """The format :meth:`as_json` wrote; ``ValueError`` if it is not one."""
        try:
            fields = dict(data)
            fields["pieces"] = tuple((str(k), str(t)) for k, t in fields["pieces"])
            fields["special"] = tuple((str(m), int(i)) for m, i in fields.get("special", ()))
            fmt = cls(**fields)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a tool-call format: {e}") from None
        if not {k for k, _ in fmt.pieces} >= {"name", "args"}:
            raise ValueError("not a tool-call format: its calls need a name and arguments")
        return fmt

    @property
    def trigger(self) -> str:
        """The text that starts the calls: the head's leading marker, else the whole head."""
        found = _MARKER.match(self.head)
        return found.group(0) if found else self.head

    @property
    def parallel(self) -> bool:
        return self.between is not None

    # ---- writing ------------------------------------------------------------------------------
    def dumps(self, value: Any) -> str:
        return json.dumps(
            value, ensure_ascii=False, separators=(self.item_separator, self.key_separator)
        )

    def render(self, calls: Sequence[tuple[str, Any] | tuple[str, Any, str | None]]) -> str:
        """Calls (name, arguments[, id]) as the format writes them, head to tail."""
        if not calls:
            return ""
        if len(calls) > 1 and not self.parallel:
            raise ValueError(f"the {self.name} tool-call format holds one call per turn")
        out = [self.head]
        for k, call in enumerate(calls):
            name, arguments = call[0], call[1]
            call_id = call[2] if len(call) > 2 else None  # type: ignore[misc]
            if k:
                out.append(self.between or "")
            for kind, text in self.pieces:
                if kind == "lit":
                    out.append(text)
                elif kind == "name":
                    out.append(name)
                elif kind == "args":
                    out.append(arguments if isinstance(arguments, str) else self.dumps(arguments))
                else:
                    out.append(call_id or _default_id(k, self.id_length))
        out.append(self.tail)
        return "".join(out)

    # ---- reading ------------------------------------------------------------------------------
    def locate(self, text: str, start: int = 0) -> tuple[str, int] | None:
        """Where an output's calls begin (at or after ``start``): (the text before them, the
        offset of the head), or None when the output holds no call (so far)."""
        if start == 0 and text.startswith(self.trigger):
            return "", 0
        if self.text_before is None:
            return None
        at = text.find(self.text_before + self.trigger, start)
        if at < 0:
            return None
        return text[:at], at + len(self.text_before)

    def may_become_calls(self, text: str) -> int:
        """How many characters at the end of ``text`` (which holds no call yet) could still be
        the start of the calls: text a stream holds back."""
        if self.trigger.startswith(text):
            return len(text)
        if self.text_before is None:
            return 0
        marker = self.text_before + self.trigger
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if marker.startswith(text[-n:]):
                return n
        return 0

    def scan(self, text: str) -> tuple[list[ScannedCall], bool]:
        """The calls in ``text`` (the calls' text from the head on, whole or the start of it)
        so far, and whether the calls are closed (the tail written). A call is reported once
        its name is whole, with its arguments so far."""
        calls: list[ScannedCall] = []
        if not text.startswith(self.head):
            return calls, False
        pos = len(self.head)
        while True:
            found: dict[str, str] = {}
            complete = False
            for i, (kind, lit) in enumerate(self.pieces):
                if kind == "lit":
                    if not text.startswith(lit, pos):
                        return _partial(calls, found, complete), False
                    pos += len(lit)
                    continue
                if kind == "args":
                    end = _value_end(text, pos)
                    found["args"] = text[pos : len(text) if end is None else end]
                    if end is None:
                        return _partial(calls, found, False), False
                    complete = True
                else:
                    stop = self._next_literal(i)
                    end = text.find(stop, pos) if stop else -1
                    if end < 0:
                        return _partial(calls, found, complete), False
                    found[kind] = text[pos:end]
                pos = end
            calls.append(ScannedCall(found["name"], found["args"], True, found.get("id")))
            if self.between is not None and text.startswith(self.between, pos):
                pos += len(self.between)
                continue
            return calls, text.startswith(self.tail, pos)

    def _next_literal(self, i: int) -> str:
        """The literal after hole ``i`` (the between or tail text after the last hole): where a
        name or id ends."""
        for kind, lit in self.pieces[i + 1 :]:
            if kind == "lit":
                return lit
            raise ToolFormatError(f"{self.name}: two holes with no text between them")
        ends = [t for t in (self.between, self.tail) if t]
        return _common_prefix(ends) if ends else ""

    def parse(self, text: str) -> tuple[str, list[ScannedCall], bool] | None:
        """An output's text before its calls, its calls and whether they are closed; None for
        an output that holds no call."""
        at = self.locate(text)
        first = None
        while at is not None:
            before, start = at
            calls, closed = self.scan(text[start:])
            if closed or start == 0:
                return before, calls, closed
            # (A marker token's text written as text, in a free reply before the real calls:
            # the calls are where the text after the marker reads as calls.)
            first = first or (before, calls, closed)
            at = self.locate(text, start + 1)
        return first


def _partial(calls: list[ScannedCall], found: dict[str, str], complete: bool) -> list[ScannedCall]:
    if "name" in found:
        calls.append(ScannedCall(found["name"], found.get("args", ""), complete, found.get("id")))
    return calls


def _common_prefix(texts: Sequence[str]) -> str:
    first = texts[0]
    n = 0
    while n < len(first) and all(n < len(t) and t[n] == first[n] for t in texts):
        n += 1
    return first[:n]


def _default_id(k: int, length: int | None) -> str:
    return f"{k:0{length or 9}d}"


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value that starts at ``text[start]`` ends (one past it), or None if
    ``text`` stops before it does. A scalar ends at the first character that cannot be part
    of it, so it needs one character after it."""
    if start >= len(text):
        return None
    if text[start] == '"' or text[start] in "{[":
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
        if text[i] in ",}] \n\t<":
            return i
    return None


# ---- named formats ------------------------------------------------------------------------


def _json_format(name: str, head: str, key: str, between: str | None, tail: str,
                 text_before: str | None) -> ToolFormat:  # fmt: skip
    pieces = (("name", ""), ("lit", f'", "{key}": '), ("args", ""))
    return ToolFormat(name, head, pieces, between, tail, text_before)


# SmolLM2's: one JSON array of calls between the markers (radixlang's format before formats
# were read from templates, and still the default for templates that do not write calls).
RADIXLANG = _json_format(
    "radixlang", '<tool_call>[{"name": "', "arguments", '}, {"name": "', "}]</tool_call>", None
)
# Hermes, Qwen2.5, Qwen3: one block per call, a newline after the text before them.
HERMES = _json_format(
    "hermes",
    '<tool_call>\n{"name": "',
    "arguments",
    '}\n</tool_call>\n<tool_call>\n{"name": "',
    "}\n</tool_call>",
    "\n",
)
# Llama 3.1-3.3's JSON tool calling: the whole turn is one bare call, "parameters" its key.
LLAMA3_JSON = _json_format("llama3-json", '{"name": "', "parameters", None, "}", None)
# Mistral's: a list after the [TOOL_CALLS] control word.
MISTRAL = _json_format(
    "mistral", '[TOOL_CALLS][{"name": "', "arguments", '}, {"name": "', "}]", None
)
NAMED_FORMATS = {f.name: f for f in (RADIXLANG, HERMES, LLAMA3_JSON, MISTRAL)}
DEFAULT_FORMAT = RADIXLANG


def named_format(name: str) -> ToolFormat:
    try:
        return NAMED_FORMATS[name]
    except KeyError:
        known = ", ".join(["auto", "template", *NAMED_FORMATS])
        raise ValueError(f"unknown tool-call format {name!r}: expected one of {known}") from None


# ---- reading a format off a chat template -------------------------------------------------

_PROBES = (
    ("radixlang_probe_a", {"radixlang_key": "radixlang_value", "radixlang_n": 7}, "a1b2c3d4e"),
    ("radixlang_probe_b", {"radixlang_key": "radixlang_other", "radixlang_n": 8}, "f5g6h7i8j"),
)
_PROBE_TEXT = "radixlang_preamble"

Render = Callable[[list[dict[str, Any]], bool], str]


def _call_message(calls: Sequence[tuple[str, Any, str]], content: str | None) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for n, a, i in calls
        ],
    }


def derive_format(render: Render, name: str = "template") -> ToolFormat:
    """The tool-call format ``render`` (messages, add_generation_prompt -> text, e.g. a
    tokenizer's ``apply_chat_template``) writes, from probe conversations: an assistant turn
    with one call, with two, and with text before a call. :class:`ToolFormatError` names what
    was found when the calls cannot be read."""
    base = [{"role": "user", "content": "radixlang_question"}]
    prompt = render(base, True)
    end_of_turn = _turn_end(render, base, prompt)

    def region(calls: Sequence[tuple[str, Any, str]], content: str | None) -> str:
        text = None
        for value in (content, None) if content == "" else (content,):
            try:
                text = render([*base, _call_message(calls, value)], False)
                break
            except Exception as e:  # a template that insists on content or ids
                error = e
        if text is None:
            raise ToolFormatError(f"the chat template refused a tool call: {error}")
        if not text.startswith(prompt):
            raise ToolFormatError(
                "the chat template writes a turn with tool calls that does not continue its "
                "generation prompt"
            )
        text = _without_thinking(text[len(prompt) :])
        return text[: len(text) - len(end_of_turn)] if text.endswith(end_of_turn) else text

    one = region(_PROBES[:1], "")
    if _PROBES[0][0] not in one:
        raise NoToolCallsError(
            "the chat template does not write an assistant message's tool_calls "
            f"(it wrote {one!r} for a turn with one call)"
        )
    spans, layout = _holes(one, _PROBES[0])
    head = one[: spans[0][1]]
    tail = one[spans[-1][2] :]
    pieces: list[tuple[str, str]] = []
    for k, (kind, start, _) in enumerate(spans):
        if k:
            lit = one[spans[k - 1][2] : start]
            if not lit:
                raise ToolFormatError(f"two holes with no text between them: {one!r}")
            pieces.append(("lit", lit))
        pieces.append((kind, ""))
    between = _between(region, head, tail, pieces, spans, layout)
    text_before = _text_before(region, head)
    id_length = len(_PROBES[0][2]) if any(k == "id" for k, _ in pieces) else None
    return ToolFormat(name, head, tuple(pieces), between, tail, text_before, *layout, id_length)


def _without_thinking(text: str) -> str:
    """``text`` without the thinking block a reasoning model's template opens its last turn
    with (Qwen3's ``<think>\n\n</think>\n\n``): the thinking comes before the answer, under
    the reasoning constraint, and the calls are the answer's."""
    found = _THINKING.match(text)
    return text[found.end() :] if found else text


def _turn_end(render: Render, base: list[dict[str, Any]], prompt: str) -> str:
    """What the template writes after an assistant message's text."""
    text = render([*base, {"role": "assistant", "content": _PROBE_TEXT}], False)
    at = text.rfind(_PROBE_TEXT)
    return text[at + len(_PROBE_TEXT) :] if at >= 0 else ""


Span = tuple[str, int, int]  # a hole's kind, start and end


def _holes(text: str, probe: tuple[str, Any, str]) -> tuple[list[Span], tuple[str, str]]:
    """Where the probe call's name, arguments (and id) are in ``text``, in order, and the
    arguments' JSON layout."""
    name, arguments, call_id = probe
    spans = []
    at = text.find(f"{name}")
    spans.append(("name", at, at + len(name)))
    for layout in _LAYOUTS:
        dumped = json.dumps(arguments, separators=layout)
        at = text.find(dumped)
        if at >= 0:
            spans.append(("args", at, at + len(dumped)))
            break
    else:
        if json.dumps(json.dumps(arguments))[1:-1] in text or "'radixlang_key'" in text:
            raise ToolFormatError(
                "the template writes a call's arguments as a string, not as a JSON object: "
                f"{text!r}"
            )
        raise ToolFormatError(f"the template's call arguments are not JSON: {text!r}")
    at = text.find(call_id)
    if at >= 0:
        spans.append(("id", at, at + len(call_id)))
    spans.sort(key=lambda s: s[1])
    return spans, layout


def _between(region: Callable[..., str], head: str, tail: str, pieces: list[tuple[str, str]],
             spans: list[tuple[str, int, int]], layout: tuple[str, str]) -> str | None:  # fmt: skip
    """The text between two calls, None when the template holds one call per turn; checked
    against a rendering of the two calls."""
    try:
        two = region(_PROBES, "")
    except ToolFormatError:
        return None  # e.g. Llama 3.1's "only supports single tool-calls at once"
    first = ToolFormat("probe", head, tuple(pieces), None, "", None, *layout)
    one_call = first.render([_PROBES[0]])
    second = first.render([_PROBES[1]])[len(head) :]
    if not two.startswith(one_call) or not two.endswith(second + tail):
        raise ToolFormatError(f"the template's two calls are not written alike: {two!r}")
    between = two[len(one_call) : len(two) - len(second) - len(tail)]
    return between or None


def _text_before(region: Callable[..., str], head: str) -> str | None:
    """What the template writes between an assistant message's text and its calls; None when
    it drops the text or writes it after the calls."""
    try:
        mixed = region(_PROBES[:1], _PROBE_TEXT)
    except ToolFormatError:
        return None
    if not mixed.startswith(_PROBE_TEXT):
        return None
    rest = mixed[len(_PROBE_TEXT) :]
    at = rest.find(head)
    return rest[:at] if at >= 0 else None


def from_jinja_render(tokenizer: Any) -> Render:
    """``derive_format``'s render from a tokenizer (or anything with ``apply_chat_template``)."""

    def render(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    return render


def format_for(tokenizer: Any, choice: str | None = None) -> ToolFormat:
    """The tool-call format for a model: ``choice`` names one; "template" reads it off the
    tokenizer's chat template (:class:`ToolFormatError` naming what was found if it cannot);
    "auto" (or None) reads it too, falling back to :data:`DEFAULT_FORMAT` for a template that
    writes no calls, and with a warning that says why for one whose calls cannot be read.
    Markers the tokenizer holds as tokens of their own are noted."""
    if choice not in (None, "auto", "template"):
        fmt = named_format(choice)
    elif tokenizer is None or not getattr(tokenizer, "chat_template", None):
        if choice == "template":
            raise NoToolCallsError("the model has no chat template to read a tool-call format from")
        fmt = DEFAULT_FORMAT
    else:
        try:
            fmt = derive_format(from_jinja_render(tokenizer))
        except ToolFormatError as e:
            if choice == "template":
                raise
            if not isinstance(e, NoToolCallsError):
                log.warning("tool calls: %s; writing them in radixlang's format instead", e)
            fmt = DEFAULT_FORMAT
    special = marker_tokens(fmt, tokenizer)
    return dataclasses.replace(fmt, special=special) if special else fmt


def marker_tokens(fmt: ToolFormat, tokenizer: Any) -> tuple[tuple[str, int], ...]:
    """The format's markers that ``tokenizer`` encodes as one added token (which constrained
    decoding treats as a token, not as text), with their ids."""
    added = getattr(tokenizer, "get_added_vocab", None)
    if added is None:
        return ()
    try:
        added_ids = set(added().values())
    except Exception:
        return ()
    found = []
    markers = {fmt.trigger, *_MARKER.findall(fmt.head + (fmt.between or "") + fmt.tail)}
    for marker in sorted(markers):
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in added_ids:
            found.append((marker, int(ids[0])))
    return tuple(found)
