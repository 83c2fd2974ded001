"""The protocol between a program's interpreter and whatever runs the model.

The interpreter hands a backend prompt text and sampling parameters (the engine's names: see
:class:`radixlang.runtime.sampling.SamplingParams`) and gets text and SGLang-style ``meta_info``
back. Nothing below this line knows about programs; nothing above it knows about KV blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from radixlang.chat_template import PLAIN, ChatTemplate
from radixlang.choices import ChoicesDecision, ChoicesSamplingMethod


class Backend(ABC):
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
