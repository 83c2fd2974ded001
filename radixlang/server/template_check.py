"""Whether a chat template is append-only: rendering a conversation plus one more turn must
extend the earlier rendering (with its generation prompt and the answer) character for
character, or the next turn's prompt leaves the radix cache's path where the two differ.

Templates that rewrite past turns break it: Qwen3-style templates drop an earlier answer's
``<think>`` block once a newer user turn follows, and some templates move or reword the system
message as the conversation grows. Measured elsewhere at about 60% of prompt tokens computed
again on such templates; here the server reports it (``/get_server_info``'s
``chat_template``) and warns at start.

The probe renders a short conversation (system, user), its answer (plain, then with a
thinking block when the template mentions thinking) and a next user turn, and finds the first
place the longer rendering stops extending the shorter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_SYSTEM = "You are a helpful assistant."
_ASK = "What is two plus two?"
_ANSWER = "Two plus two is four."
_NEXT = "And three plus three?"


@dataclass(frozen=True)
class TemplateCheck:
    append_only: bool | None  # None: no chat template, or it could not render the probe
    detail: str  # where a rendering stops extending the last (empty when append-only)

    def as_json(self) -> dict[str, Any]:
        return {"append_only": self.append_only, "detail": self.detail}


def check_template(tokenizer: Any) -> TemplateCheck:
    """Probe ``tokenizer``'s chat template (see the module's docstring)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return TemplateCheck(None, "no chat template")
    answers = [_ANSWER]
    if "think" in str(tokenizer.chat_template):
        answers.append(f"<think>\nAdd them.\n</think>\n\n{_ANSWER}")
    for answer in answers:
        head = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _ASK}]
        try:
            before = tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
            grown = [*head, {"role": "assistant", "content": answer},
                     {"role": "user", "content": _NEXT}]  # fmt: skip
            after = tokenizer.apply_chat_template(grown, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that refuses the probe's roles
            return TemplateCheck(None, f"the template did not render the probe: {e}")
        expected = before + answer
        if not after.startswith(expected):
            at = next(
                (i for i, (a, b) in enumerate(zip(after, expected, strict=False)) if a != b),
                min(len(after), len(expected)),
            )
            kind = "an answer with thinking" if "<think>" in answer else "an answer"
            return TemplateCheck(False, f"after {kind}, the next turn's rendering differs from "
                                 f"the earlier prompt and answer at character {at} of "
                                 f"{len(expected)}: {after[at:at + 40]!r} where the cache holds "
                                 f"{expected[at:at + 40]!r}")  # fmt: skip
    return TemplateCheck(True, "")
