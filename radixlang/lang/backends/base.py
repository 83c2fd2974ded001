"""The protocol between a program's interpreter and whatever runs the model.

The interpreter hands a backend prompt text and sampling parameters (the engine's names: see
:class:`radixlang.runtime.sampling.SamplingParams`) and gets text and SGLang-style ``meta_info``
back. Nothing below this line knows about programs; nothing above it knows about KV blocks.

A streamed generation (``generate_stream``) yields ``(new text, meta_info)`` per piece and ends
with ``("", the whole generation's meta_info)``. A piece's meta_info is SGLang's streamed chunk
meta_info, as far as the backend knows it: ``prompt_tokens``, ``cached_tokens`` and
``completion_tokens`` so far and, when the gen asked for log-probabilities, that piece's own
``output_token_logprobs`` with the running ``output_token_logprobs_length``. A piece may have no
text (tokens whose text is not complete yet). :class:`StreamMeta` turns whatever a service sends
(cumulative or incremental log-probability lists) into that shape.

A chat-model backend (``is_chat_model``: a chat-completions service) sees messages, not prompt
text: the interpreter calls ``generate_chat`` with the conversation so far, and only where an
assistant turn has just begun, since such a service writes whole assistant messages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Self

from radixlang.constrain.reasoning import CLOSE as THINK_CLOSE
from radixlang.constrain.reasoning import OPEN as THINK_OPEN
from radixlang.lang.chat_template import PLAIN, ChatTemplate
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod

# Streamed meta_info lists that hold one entry per output token.
INCREMENTAL_KEYS = ("output_token_logprobs", "output_top_logprobs")
# Counts every piece's meta_info carries forward (the latest known value).
COUNT_KEYS = ("prompt_tokens", "cached_tokens", "completion_tokens")


class StreamMeta:
    """One streamed generation's meta_info, piece by piece.

    ``piece(meta)`` takes a piece's meta_info as a service sent it, where the per-token lists
    may hold every token so far (cumulative) or only the piece's (incremental: SGLang's
    ``incremental_streaming_output``, told apart by ``output_token_logprobs_length``), and
    returns SGLang's chunk meta_info: the piece's own per-token entries, the running
    ``output_token_logprobs_length`` and the counts so far. ``final(meta)`` is the whole
    generation's meta_info with every token's entries."""

    def __init__(self) -> None:
        self.entries: dict[str, list[Any]] = {key: [] for key in INCREMENTAL_KEYS}
        self.counts: dict[str, Any] = {}

    def piece(self, meta: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in meta.items() if k not in INCREMENTAL_KEYS and k != "output_ids"}
        for key in COUNT_KEYS:
            if meta.get(key) is not None:
                self.counts[key] = meta[key]
            elif key in self.counts:
                out[key] = self.counts[key]
        have = len(self.entries["output_token_logprobs"])
        total = meta.get("output_token_logprobs_length", meta.get("completion_tokens"))
        if meta.get("output_token_logprobs") is not None:
            for key in INCREMENTAL_KEYS:
                got = list(meta.get(key) or [])
                mine = self.entries[key]
                # Cumulative when it holds as many entries as there are tokens so far.
                new = got[len(mine) :] if total is not None and len(got) == total else got
                mine.extend(new)
                out[key] = new
            out["output_token_logprobs_length"] = len(self.entries["output_token_logprobs"])
        elif have:
            out["output_token_logprobs"] = []
            out["output_token_logprobs_length"] = have
        return out

    def final(self, meta: dict[str, Any]) -> dict[str, Any]:
        """The last piece's ``meta`` (already taken by :meth:`piece`) with every token's
        entries."""
        out = dict(meta)
        if self.entries["output_token_logprobs"]:
            out.update({key: list(self.entries[key]) for key in INCREMENTAL_KEYS})
            out["output_token_logprobs_length"] = len(self.entries["output_token_logprobs"])
        return out


def merge_pieces(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Consecutive pieces' chunk meta_info as one piece's: their per-token entries joined, the
    latest counts."""
    out: dict[str, Any] = {}
    for meta in metas:
        for key, value in meta.items():
            if key in INCREMENTAL_KEYS:
                out[key] = list(out.get(key, [])) + list(value or [])
            else:
                out[key] = value
    return out


def usage_of(metas: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The summed ``prompt_tokens`` and ``cached_tokens`` of the requests one call made (a
    select's scoring requests): its cache figures."""
    return {
        key: sum(int(m.get(key) or 0) for m in metas) for key in ("prompt_tokens", "cached_tokens")
    }


class Backend(ABC):
    is_chat_model: bool = False
    # Whether the model thinks before it answers (<think> ... </think>): a gen's variable is
    # then its answer, and its meta_info's "reasoning" the thinking.
    thinks: bool = False
    thinking_markers: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)  # the model's tags
    # Whether programs run on this backend send their call graph to report_program.
    report_programs: bool = False

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

    def release_program(self, key: str) -> None:  # noqa: B027
        """The program with routing key ``key`` ended: the paths its calls asked the cache to
        retain (``retain_s``, sent with a gen that may call tools) can go. Backends that cannot
        say so leave them to their deadline."""

    def report_program(self, name: str, graph: dict[str, Any], status: str) -> None:  # noqa: B027
        """Hand a finished run's call graph (``run_graph.RunRecorder.to_dict``) to a viewer:
        the server's dashboard. Backends with no viewer ignore it."""

    def shutdown(self) -> None:  # noqa: B027
        """Release what the backend holds (an engine, a connection)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving a ``with`` block shuts the backend down."""
        self.shutdown()
