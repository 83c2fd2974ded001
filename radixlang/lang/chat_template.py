"""Role boundaries for ``system``/``user``/``assistant``, read off the model's own chat template.

A Hugging Face tokenizer carries its chat template as jinja. Rendering a few probe conversations
with a sentinel as the content shows the text each role puts before and after its content, the
default system message the template inserts when a chat starts without one, and the end-of-turn
text (which becomes a stop string for generation inside a role). Models without a template get
a plain ``Role: content`` format.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from radixlang.constrain.tool_formats import DEFAULT_FORMAT, ToolFormat, format_for

ROLES = ("system", "user", "assistant", "tool")
# How a tool's result is marked when the template has no tool role (it becomes a user turn).
TOOL_RESPONSE = ("<tool_response>\n", "\n</tool_response>")
_SENTINEL = "\x00RADIXLANG-CONTENT\x00"


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    prefix: dict[str, str]  # text before a role's content
    suffix: dict[str, str]  # text after it
    first_prefix: dict[str, str] = field(default_factory=dict)  # when the role opens the chat
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = ()
    tool_format: ToolFormat = DEFAULT_FORMAT  # how the model writes tool calls

    def get_prefix_and_suffix(self, role: str, history: list[dict[str, Any]]) -> tuple[str, str]:
        if role == "tool" and "tool" not in self.prefix:  # a user turn, marked
            prefix, suffix = self.get_prefix_and_suffix("user", history)
            return prefix + TOOL_RESPONSE[0], TOOL_RESPONSE[1] + suffix
        if role not in self.prefix:
            raise ValueError(f"unknown role {role!r}: expected one of {sorted(self.prefix)}")
        prefix = self.first_prefix.get(role, self.prefix[role]) if not history else None
        return prefix if prefix is not None else self.prefix[role], self.suffix[role]

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """Messages as prompt text, the way the interpreter writes them."""
        out = ""
        history: list[dict[str, Any]] = []
        if messages and messages[0]["role"] != "system" and self.default_system_prompt:
            messages = [{"role": "system", "content": self.default_system_prompt}, *messages]
        for m in messages:
            pre, suf = self.get_prefix_and_suffix(m["role"], history)
            out += pre + m["content"] + suf
            history.append(m)
        if add_generation_prompt:
            out += self.get_prefix_and_suffix("assistant", history)[0]
        return out


PLAIN = ChatTemplate(
    name="plain",
    prefix={"system": "", "user": "User: ", "assistant": "Assistant:", "tool": "Tool: "},
    suffix={"system": "\n\n", "user": "\n", "assistant": "\n", "tool": "\n"},
)


def _split(rendered: str, before: str) -> tuple[str, str]:
    """(prefix, suffix) of the one message that ``rendered`` adds after ``before``."""
    if not rendered.startswith(before):
        raise ValueError("the template does not extend the conversation's text")
    added = rendered[len(before) :]
    if added.count(_SENTINEL) != 1:
        raise ValueError("the template does not keep the message content verbatim")
    prefix, suffix = added.split(_SENTINEL)
    return prefix, suffix


def from_tokenizer(tokenizer: Any, name: str = "model") -> ChatTemplate:
    """The tokenizer's chat template as role boundaries; ``PLAIN`` when it has none or the
    probes cannot read it. Templates that refuse a system role keep their user and assistant
    turns, and a system message becomes a plain paragraph before the first turn."""
    if not getattr(tokenizer, "chat_template", None):
        return PLAIN

    def render(msgs: list[dict[str, str]], gen: bool = False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    for with_system in (True, False):
        try:
            template = _read(render, name, with_system)
        except Exception:  # a template these probes cannot read
            continue
        return dataclasses.replace(template, tool_format=format_for(tokenizer))
    return PLAIN


class _JinjaTemplate:
    """A jinja chat template rendered the way a tokenizer renders it, for ``from_tokenizer``."""

    def __init__(self, template: str, bos_token: str | None, eos_token: str | None) -> None:
        self.chat_template = template
        # A tokenizer passes only the special tokens it has: an absent one renders as "".
        self.special_tokens = {
            k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v is not None
        }

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
    ) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        return rendered[0]


def from_jinja(
    template: str,
    name: str = "model",
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> ChatTemplate:
    """A jinja chat template's role boundaries (as :func:`from_tokenizer` reads a tokenizer's),
    for a backend that has the template's text but no tokenizer, e.g. from a server."""
    return from_tokenizer(_JinjaTemplate(template, bos_token, eos_token), name)


def _msg(role: str, content: str = _SENTINEL) -> dict[str, str]:
    return {"role": role, "content": content}


def _read(render: Any, name: str, with_system: bool) -> ChatTemplate:
    if with_system:
        sys_prefix, sys_suffix = _split(render([_msg("system")]), "")
        base = [_msg("system", "S"), _msg("user", "U"), _msg("assistant", "A")]
    else:
        sys_prefix, sys_suffix = "", "\n\n"
        base = [_msg("user", "U"), _msg("assistant", "A")]
    prefix, suffix = {"system": sys_prefix}, {"system": sys_suffix}
    before = render(base)
    for role in ("user", "assistant"):
        prefix[role], suffix[role] = _split(render([*base, _msg(role)]), before)
    with contextlib.suppress(Exception):  # a template without a tool role: see TOOL_RESPONSE
        tool_turn = {**_msg("tool"), "tool_call_id": "call_0", "name": "probe"}
        prefix["tool"], suffix["tool"] = _split(render([*base, tool_turn]), before)
    first_prefix = {"system": sys_prefix}
    if with_system:
        # The system role in mid-chat (rare, but programs may do it); a template that forbids
        # it keeps the opening form.
        with contextlib.suppress(Exception):
            prefix["system"], suffix["system"] = _split(render([*base, _msg("system")]), before)
    default_system = None
    opened = render([_msg("user")])
    head = opened[: opened.index(_SENTINEL)]
    lead = head[: len(head) - len(prefix["user"])] if head.endswith(prefix["user"]) else None
    if lead and with_system and lead.startswith(sys_prefix) and lead.endswith(sys_suffix):
        # The template's default system message: kept as a system message, so messages()
        # shows it, and the interpreter writes it before a chat's first other turn.
        default_system = lead[len(sys_prefix) : len(lead) - len(sys_suffix)]
    elif lead:  # an opening token such as BOS
        first_prefix["user"] = head
        if not with_system:  # (a probed system prefix already holds it)
            first_prefix["system"] = lead + sys_prefix
    if default_system is None and "assistant" not in first_prefix:
        with contextlib.suppress(Exception):
            first_prefix["assistant"] = _split(render([_msg("assistant")]), "")[0]
    gen_prompt = render(base, gen=True)[len(before) :]
    if gen_prompt and gen_prompt != prefix["assistant"]:
        # Generation opens the assistant turn with this text: use it, so prompts match.
        prefix["assistant"] = gen_prompt
    end_of_turn = suffix["assistant"].strip()
    return ChatTemplate(
        name=name,
        prefix=prefix,
        suffix=suffix,
        first_prefix=first_prefix,
        default_system_prompt=default_system,
        stop_str=(end_of_turn,) if end_of_turn else (),
    )
