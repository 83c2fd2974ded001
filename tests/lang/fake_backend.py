"""A model-free backend for frontend tests: deterministic replies, every call recorded."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from radixlang.lang.backends.base import Backend
from radixlang.lang.chat_template import ChatTemplate
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod

CHATML = ChatTemplate(
    name="chatml",
    prefix={r: f"<|im_start|>{r}\n" for r in ("system", "user", "assistant")},
    suffix={r: "<|im_end|>\n" for r in ("system", "user", "assistant")},
    default_system_prompt="You are helpful.",
    stop_str=("<|im_end|>",),
)


class FakeBackend(Backend):
    """``generate`` answers ``reply(prompt, sampling)`` (default: ``"<n>"``, n = the call's
    number), cut at the first stop string; ``select`` picks the longest choice."""

    def __init__(self, template: ChatTemplate = CHATML, reply: Any = None) -> None:
        self.template = template
        self.reply = reply
        self.calls: list[tuple[str, str, dict[str, Any]]] = []  # (kind, prompt, sampling)
        self.cached: list[str] = []
        self._lock = threading.Lock()
        self.stream_delay = 0.0  # seconds between streamed characters
        self.fail_on: str | None = None  # a prompt substring that makes generate raise

    def get_chat_template(self) -> ChatTemplate:
        return self.template

    def generate(self, prompt: str, sampling: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        with self._lock:
            self.calls.append(("gen", prompt, sampling))
            n = len(self.calls)
        if self.fail_on is not None and self.fail_on in prompt:
            raise ValueError(f"backend failure on {self.fail_on!r}")
        text = self.reply(prompt, sampling) if self.reply else f"<{n}>"
        for stop in sampling.get("stop", []):
            if stop in text:
                text = text[: text.index(stop)]
        return text, {"prompt_tokens": len(prompt), "finish_reason": {"type": "stop"}}

    def generate_stream(
        self, prompt: str, sampling: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        text, meta = self.generate(prompt, sampling)
        for ch in text:
            time.sleep(self.stream_delay)
            yield ch, {}
        yield "", meta

    def select(
        self,
        prompt: str,
        choices: Sequence[str],
        temperature: float,
        method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        with self._lock:
            self.calls.append(("select", prompt, {"choices": list(choices)}))
        scores = [float(len(c)) for c in choices]
        return method(
            choices=list(choices),
            normalized_prompt_logprobs=scores,
            input_token_logprobs=[[(s, 0, c)] for s, c in zip(scores, choices, strict=True)],
            output_token_logprobs=[[] for _ in choices],
        )

    def cache_prefix(self, prompt: str, wait: bool = False) -> None:
        with self._lock:
            self.cached.append(prompt)
