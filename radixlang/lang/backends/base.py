"""The protocol between a program's interpreter and whatever runs the model.

The interpreter hands a backend prompt text and sampling parameters (the engine's names: see
:class:`radixlang.runtime.sampling.SamplingParams`) and gets text and SGLang-style ``meta_info``
back. Nothing below this line knows about programs; nothing above it knows about KV blocks.

A chat-model backend (``is_chat_model``: a chat-completions service) sees messages, not prompt
text: the interpreter calls ``generate_chat`` with the conversation so far, and only where an
assistant turn has just begun, since such a service writes whole assistant messages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from radixlang.lang.chat_template import PLAIN, ChatTemplate
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod


class Backend(ABC):
    is_chat_model: bool = False

    def get_chat_template(self) -> ChatTemplate:
        return PLAIN

    @abstractmethod
    def generate(self, prompt: str, sampling: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Complete ``prompt``: (the new text, its meta_info)."""

    def generate_stream(
        self, prompt: str, sampling: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Complete ``prompt`` piece by piece: (new text, meta_info so far) per piece."""
        yield self.generate(prompt, sampling)

    def generate_chat(
        self, messages: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """The next assistant message after ``messages``: (its text, its meta_info)."""
        raise NotImplementedError(f"{type(self).__name__} is not a chat-model backend")

    def generate_chat_stream(
        self, messages: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """``generate_chat`` piece by piece, as ``generate_stream``."""
        yield self.generate_chat(messages, sampling)

    @abstractmethod
    def select(
        self,
        prompt: str,
        choices: Sequence[str],
        temperature: float,
        method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        """Pick one of ``choices`` as the continuation of ``prompt``."""

    def cache_prefix(self, prompt: str, wait: bool = False) -> None:  # noqa: B027
        """Compute ``prompt``'s KV into the cache, so calls that extend it share it. A hint:
        backends without a cache ignore it."""

    def flush_cache(self) -> bool:
        return False

    def shutdown(self) -> None:  # noqa: B027
        """Release what the backend holds (an engine, a connection)."""
