"""A chat answer as a sequence of parts (a reasoning model's thinking, a text reply, then tool
calls), built from its text as it streams: the shape the Responses API (output items) and the
Messages API (content blocks) both answer in, where chat completions answer one message with
``tool_calls``.

``AnswerParts.feed`` turns each new piece of output text into part events: a part opens (a
text part, or a call with its id and name), a piece is added to it (text, or the call's
arguments), and a part closes when the next opens or the answer ends. A whole answer is the
same events fed at once, so a streamed answer and a plain one hold the same parts, ids
included. Reading the calls is ``tools.CallStream``'s (the call format's deltas).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from radixlang.constrain.reasoning import ReasoningSplitter
from radixlang.server import tools as tooling


@dataclass
class Part:
    kind: Literal["reasoning", "text", "call"]
    text: str = ""  # the thinking, the reply's text, or the call's arguments (JSON text)
    name: str = ""  # a call's function
    call_id: str = ""  # a call's id in OpenAI's form (the Responses API's ``call_id``)
    item_id: str = ""  # the part's own id (an output item's; a Messages ``tool_use`` block's)
    closed: bool = False


@dataclass(frozen=True)
class PartEvent:
    kind: Literal["open", "delta", "close"]
    index: int  # the part's place in the answer
    piece: str = ""  # a delta's text


@dataclass
class AnswerParts:
    choice: tooling.ToolChoice
    id_prefix: tuple[str, str] = ("msg", "fc")  # the ids of text parts and of call parts
    parts: list[Part] = field(default_factory=list)
    # A reasoning model's output: its thinking is split off first (None: the model does not think).
    splitter: ReasoningSplitter | None = None
    raw: str = ""  # the output's text as fed (the thinking and its markers included)

    def __post_init__(self) -> None:
        self._calls = tooling.CallStream(
            self.choice.calls, self.choice.mode == "required", self.choice.fmt
        )
        self._call_parts: dict[int, int] = {}  # a call's index in the block -> its part

    def feed(self, text: str) -> list[PartEvent]:
        """The events a new piece of output text makes."""
        self.raw += text
        if self.splitter is None:
            return self._events(self._calls.feed(text))
        reasoning, answer = self.splitter.feed(text)
        return self._thinking(reasoning) + self._events(self._calls.feed(answer))

    def finish(self) -> list[PartEvent]:
        """The events of the answer's end: text held back, then every open part closed."""
        events: list[PartEvent] = []
        if self.splitter is not None:
            reasoning, answer = self.splitter.finish()
            events = self._thinking(reasoning) + self._events(self._calls.feed(answer))
        events += self._events(self._calls.finish())
        for k, part in enumerate(self.parts):
            if not part.closed:
                part.closed = True
                events.append(PartEvent("close", k))
        return events

    @property
    def called(self) -> bool:
        """Whether the answer holds calls and their block was closed (a finished call turn)."""
        return self._calls.called and self._calls.closed

    @property
    def reasoning(self) -> str | None:
        """The thinking, if the output had a thinking block."""
        parts = [p.text for p in self.parts if p.kind == "reasoning"]
        return "".join(parts) if parts else None

    def _thinking(self, piece: str) -> list[PartEvent]:
        if not piece:
            return []
        events: list[PartEvent] = []
        if not self.parts or self.parts[-1].kind != "reasoning":
            events = self._open(Part("reasoning"))
        k = len(self.parts) - 1
        self.parts[k].text += piece
        return [*events, PartEvent("delta", k, piece)]

    def _open(self, part: Part) -> list[PartEvent]:
        events = []
        if self.parts and not self.parts[-1].closed:
            self.parts[-1].closed = True
            events.append(PartEvent("close", len(self.parts) - 1))
        prefix = {"reasoning": "rs", "text": self.id_prefix[0]}.get(part.kind, self.id_prefix[1])
        part.item_id = f"{prefix}_{uuid.uuid4().hex[:24]}"
        self.parts.append(part)
        return [*events, PartEvent("open", len(self.parts) - 1)]

    def _events(self, deltas: list[dict[str, Any]]) -> list[PartEvent]:
        events: list[PartEvent] = []
        for delta in deltas:
            if delta.get("content"):
                if not self.parts or self.parts[-1].kind != "text" or self.parts[-1].closed:
                    events += self._open(Part("text"))
                k = len(self.parts) - 1
                self.parts[k].text += delta["content"]
                events.append(PartEvent("delta", k, delta["content"]))
            for item in delta.get("tool_calls", ()):
                function = item.get("function", {})
                if "id" in item:
                    events += self._open(Part("call", name=function["name"], call_id=item["id"]))
                    self._call_parts[item["index"]] = len(self.parts) - 1
                k = self._call_parts[item["index"]]
                piece = function.get("arguments", "")
                if piece:
                    self.parts[k].text += piece
                    events.append(PartEvent("delta", k, piece))
        return events


def whole_answer(
    text: str,
    choice: tooling.ToolChoice,
    id_prefix: tuple[str, str],
    splitter: ReasoningSplitter | None = None,
) -> AnswerParts:
    """A finished answer's parts (fed whole)."""
    parts = AnswerParts(choice, id_prefix, splitter=splitter)
    parts.feed(text)
    parts.finish()
    return parts
