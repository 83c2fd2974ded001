"""Reasoning models: a model that thinks (``<think> ... </think>``) before it answers.

Three things follow from it, and live here:

- **which tokens mark the thinking**: a tokenizer whose vocabulary has ``<think>`` and
  ``</think>`` as single tokens and whose chat template writes them (Qwen3-style templates,
  DeepSeek-R1's) is a reasoning model's (:func:`reasoning_markers`);
- **constraints apply after the thinking** (``thinking_first.ThinkingFirst``): a JSON schema,
  a regex or a tool-call grammar holds the *answer*, never the reasoning before it. The
  wrapper lets the model open a thinking block first (or finds it opened by the prompt),
  leaves the thinking free (but for ending the output inside it), and hands every token after
  ``</think>`` to the inner constraint;
- **a thinking budget**: after ``budget`` thinking tokens the wrapper forces ``</think>``
  (jump-forward: the engine appends it at once) and the answer follows, under its constraint
  if it has one.

:func:`split_reasoning` separates a finished output into its reasoning and its answer, for the
routes (``reasoning_content``, reasoning items, thinking blocks) and programs.

Torch-free (the language reads answers with it); the constraint is ``thinking_first.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

OPEN = "<think>"
CLOSE = "</think>"
# The thinking markers of the families that think: Qwen3, DeepSeek-R1, SmolLM3, Phi-4-reasoning
# and GLM write <think>; Magistral writes [THINK] (control tokens of its tokenizer).
MARKER_PAIRS = ((OPEN, CLOSE), ("[THINK]", "[/THINK]"))


@dataclass(frozen=True)
class ReasoningMarkers:
    open_id: int
    close_id: int
    # What the template writes between ``</think>`` and the answer (Qwen3's "\n\n"), as
    # tokens: the model writes it before a constrained answer too.
    after_close: tuple[int, ...] = ()
    open_text: str = OPEN
    close_text: str = CLOSE
    # The markers are special tokens (Magistral's): decoding must keep them in the text.
    special: bool = False

    @property
    def texts(self) -> tuple[str, str]:
        return self.open_text, self.close_text


def reasoning_markers(tokenizer: Any) -> ReasoningMarkers | None:
    """The thinking markers' token ids, if ``tokenizer`` is a reasoning model's (both markers
    of one of :data:`MARKER_PAIRS` single tokens, and its chat template writes the opening
    one), and the whitespace its template writes after the thinking."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if tokenizer is None:
        return None
    for pair in MARKER_PAIRS:
        if pair[0] not in template:
            continue
        ids = []
        for marker in pair:
            encoded = tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) != 1:
                break
            ids.append(int(encoded[0]))
        else:
            special = set(getattr(tokenizer, "all_special_ids", None) or ())
            return ReasoningMarkers(
                *ids,
                after_close=_after_close(tokenizer, pair[1]),
                open_text=pair[0],
                close_text=pair[1],
                special=bool(special & set(ids)),
            )
    return None


_THOUGHT, _ANSWER = "radixlang_thought", "radixlang_answer"


def _after_close(tokenizer: Any, close: str = CLOSE) -> tuple[int, ...]:
    """The tokens of the whitespace the chat template writes between ``</think>`` and the
    answer of an assistant turn with ``reasoning_content``; none where it writes none (or does
    not render the reasoning)."""
    turn = {"role": "assistant", "content": _ANSWER, "reasoning_content": _THOUGHT}
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, turn], tokenize=False
        )
    except Exception:
        return ()
    thought = text.find(_THOUGHT)
    at = text.find(close, thought) if thought >= 0 else -1
    answer = text.find(_ANSWER, at) if at >= 0 else -1
    gap = text[at + len(close) : answer] if answer >= 0 else ""
    if not gap or gap.strip():
        return ()
    return tuple(int(t) for t in tokenizer.encode(gap, add_special_tokens=False))


def opened_in_prompt(prompt_ids: Iterable[int], markers: ReasoningMarkers) -> bool:
    """Whether the prompt ends inside a thinking block (its template opened it)."""
    state = False
    for token in prompt_ids:
        if token == markers.open_id:
            state = True
        elif token == markers.close_id:
            state = False
    return state


class ReasoningSplitter:
    """An output's text as it streams, split into reasoning and answer pieces: the text between
    ``<think>`` and ``</think>`` (the prompt may have opened the block: ``opened``), then the
    answer, its leading whitespace dropped. Text that may still be a marker is held back."""

    def __init__(self, opened: bool = False, markers: tuple[str, str] = (OPEN, CLOSE)) -> None:
        self.state = "thinking" if opened else "start"
        self.buffer = ""
        self.thought = False  # a thinking block was seen
        self.open, self.close = markers

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, answer)`` pieces that ``text`` completes."""
        self.buffer += text
        reasoning = answer = ""
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if stripped.startswith(self.open):
                self.state, self.thought, self.buffer = "thinking", True, stripped[len(self.open) :]
            elif not stripped or self.open.startswith(stripped):
                return "", ""  # maybe the marker still
            else:
                self.state = "answer"
        if self.state == "thinking":
            self.thought = True
            before, closed, after = self.buffer.partition(self.close)
            if not closed:
                keep = next((k for k in range(len(self.close) - 1, 0, -1)
                             if self.buffer.endswith(self.close[:k])), 0)  # fmt: skip
                reasoning = self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                return reasoning, ""
            reasoning, self.buffer, self.state = before, after, "answer_start"
        if self.state == "answer_start":
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return reasoning, ""
            self.state = "answer"
        answer, self.buffer = self.buffer, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is held back when the output ends."""
        held, self.buffer = self.buffer, ""
        if self.state == "thinking":
            return held, ""
        return "", held.lstrip() if self.state != "answer" else held


def split_reasoning(
    text: str, opened: bool = False, markers: tuple[str, str] = (OPEN, CLOSE)
) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a whole output, as :class:`ReasoningSplitter` streams it
    (reasoning None when the output has no thinking block)."""
    splitter = ReasoningSplitter(opened, markers)
    r1, a1 = splitter.feed(text)
    r2, a2 = splitter.finish()
    return (r1 + r2 if splitter.thought else None), a1 + a2
