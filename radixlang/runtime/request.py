"""What a generation request is: its public input and result, and the engine's state for it.

``GenerateRequest`` is what callers submit; ``GenerationResult`` and ``StreamEvent`` are what
comes back. ``Req`` is the engine's working state: the token sequence (prompt, then output), the
KV blocks it holds, how much of it is computed, and the cache path it keeps locked.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import torch

from radixlang.runtime.constraint import TokenConstraint
from radixlang.runtime.radix_cache import CacheHandle
from radixlang.runtime.sampling import SamplingParams, SamplingRow


class RequestError(ValueError):
    """A request the engine refuses at submission (bad prompt, bad sampling parameters)."""


# (token id, log-probability) pairs, best first.
TopLogprobs = list[tuple[int, float]]
# The longest cache salt the engine takes: any string, which only seeds the cache's hashes (a
# server may build one from a tenant and a client's salt; it bounds each part on its own).
MAX_CACHE_SALT_CHARS = 1024


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, a stop string, or a finished constraint
    LENGTH = "length"  # max_new_tokens, the context window, or a pool too small for the sequence
    ABORT = "abort"  # abort(request_id), or the engine shut down first
    ERROR = "error"  # the engine failed while running the request; see ``error``


@dataclass
class GenerateRequest:
    """One prompt to complete: ``text`` (tokenized by the engine) or ``input_ids``."""

    text: str | None = None
    input_ids: Sequence[int] | None = None
    sampling: SamplingParams | dict | None = None
    request_id: str | None = None
    # A ready per-token constraint (instead of ``sampling.regex``); one request's, not shared.
    constraint: TokenConstraint | None = None
    # Prefixes cached under one salt are reused only by requests with the same salt (tenant
    # isolation: no time-to-first-token side channel across salts).
    cache_salt: str = ""
    # A router in front of several engines keeps requests with one key (a program's, a
    # chat's) on one engine. The engine takes it as the request's program: for retention and
    # for the "program" schedule policy (the least served program first).
    routing_key: str | None = None
    # Seconds to keep this request's path (prompt and output) cached once it ends, for its
    # program's next call (a program paused at a tool call); 0: a plain LRU path.
    retain_s: float = 0.0


def as_request(
    prompt: GenerateRequest | str | Sequence[int],
    sampling: SamplingParams | dict | None = None,
    request_id: str | None = None,
) -> GenerateRequest:
    """What ``submit`` takes: a request as is, or a prompt (text or token ids) made one."""
    if isinstance(prompt, GenerateRequest):
        return prompt
    is_text = isinstance(prompt, str)
    return GenerateRequest(
        text=prompt if is_text else None,  # type: ignore[arg-type]
        input_ids=None if is_text else prompt,  # type: ignore[arg-type]
        sampling=sampling,
        request_id=request_id,
    )


@dataclass
class StreamEvent:
    """What one engine step produced for one request."""

    request_id: str
    token_ids: list[int]  # new output tokens
    text: str  # new text, safe to show (never part of a stop string)
    logprobs: list[float | None]  # per new token, when return_logprob
    top_logprobs: list[TopLogprobs | None]
    finished: bool = False
    finish_reason: FinishReason | None = None
    # The prompt's tokens and how many of them came from the cache (known once admitted).
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class BeamOutput:
    """One finished beam of a beam-search request."""

    text: str
    output_ids: list[int]
    # Sum of the output tokens' log-probabilities / len(output_ids) ** length_penalty.
    score: float
    finish_reason: FinishReason


@dataclass
class GenerationResult:
    request_id: str
    text: str
    output_ids: list[int]
    prompt_ids: list[int]
    finish_reason: FinishReason
    matched_stop: str | int | None  # the stop string or stop token id that ended it
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens reused from the radix cache at first admission
    output_logprobs: list[float | None]
    output_top_logprobs: list[TopLogprobs | None]
    # Prompt positions logprob_start_len.. : (position's token, its logprob); position 0 has none.
    prompt_logprobs: list[tuple[int, float | None]]
    prompt_top_logprobs: list[TopLogprobs | None]
    time_to_first_token: float | None  # seconds from submission
    latency: float  # seconds from submission to finish
    error: str | None = None
    # Beam search: the finished beams, best first (the result's own output is the first one's).
    beams: list[BeamOutput] = field(default_factory=list)

    @property
    def meta_info(self) -> dict[str, object]:
        """SGLang's ``meta_info`` fields for this result."""
        if self.finish_reason is FinishReason.LENGTH:
            finish: dict[str, object] = {"type": "length", "length": self.completion_tokens}
        else:
            finish = {"type": self.finish_reason.value, "matched": self.matched_stop}
        return {
            "id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": finish,
            "e2e_latency": self.latency,
            **({"beams": [_beam_info(b) for b in self.beams]} if self.beams else {}),
        }


def _beam_info(beam: BeamOutput) -> dict[str, object]:
    return {
        "text": beam.text,
        "output_ids": beam.output_ids,
        "score": beam.score,
        "finish_reason": beam.finish_reason.value,
    }


class TokenTail(Sequence[int]):
    """A live, read-only view of ``tokens[start:]``: a request's output as it grows, for its
    sampling row, without copying the output every step."""

    __slots__ = ("_start", "_tokens")

    def __init__(self, tokens: list[int], start: int) -> None:
        self._tokens = tokens
        self._start = start

    def __len__(self) -> int:
        return max(0, len(self._tokens) - self._start)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._tokens[self._start :][index]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, None)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenTail | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"TokenTail({self._tokens[self._start :]!r})"


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class BeamMembership(Protocol):
    """What a request and the engine use of the beam group a request belongs to
    (:class:`radixlang.runtime.beam_search.BeamGroup`, which imports this module)."""

    results: list[BeamOutput]

    def end(self, member: Req, scheduler: Any) -> Req | None:
        """``member`` finished: the group's request to answer, once, or None."""
        ...


@dataclass(eq=False)
class Req:
    """The engine's state for one request (touched only on the engine thread)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    # The most output tokens this request may produce: params.max_new_tokens (what was asked),
    # plus one for a healed token, clipped to the context window.
    output_limit: int
    tokens: list[int] = field(default_factory=list)  # prompt, then output
    status: ReqStatus = ReqStatus.WAITING
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    blocks: list[int] = field(default_factory=list)  # one pool reference each
    num_computed: int = 0  # tokens whose KV is in ``blocks``
    high_water: int = 0  # most tokens ever computed (a retraction resets num_computed)
    handle: CacheHandle | None = None  # the locked cache path under ``blocks``
    cached_tokens: int = 0
    admitted: bool = False  # admitted at least once (retraction re-admits)
    num_retractions: int = 0
    aborted: bool = False
    generator: torch.Generator | None = None
    # Advanced once per sampled token (never again on a re-run after a retraction).
    constraint: TokenConstraint | None = None
    # Token healing: bool [vocab], the tokens the first output token may be (None: any).
    first_token_mask: torch.Tensor | None = None
    # Log-probabilities.
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, float | None]] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    next_prompt_logprob: int = -1  # next prompt position whose logprob is owed; -1: none
    boundary_scores: torch.Tensor | None = None  # log-softmax after the last prefill chunk
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    # The row :func:`sample` takes for this request when nothing changes it for a step (no
    # mask): made once, its output a live view of ``tokens``.
    sampling_row: SamplingRow | None = field(default=None, repr=False)
    # Beam search: the group this request is one beam of (its own Req is the first beam).
    beam: BeamMembership | None = field(default=None, repr=False)
    # The radix cache's salt: this request matches and inserts only prefixes of this salt.
    cache_salt: str = ""
    # Its program (GenerateRequest.routing_key; else its own id) and how long to retain its
    # path when it ends (seconds, already cut to the engine's retain_max_s).
    program: str = ""
    retain_s: float = 0.0
    # Speculative decoding's state for it (runtime/speculative/drafter.py), once it drafts.
    drafting: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        start = self.params.logprob_start_len
        if self.params.return_logprob and 0 <= start < len(self.prompt_ids):
            if start == 0:  # nothing precedes the first token: it has no log-probability
                self.prompt_logprobs.append((self.prompt_ids[0], None))
                self.prompt_top_logprobs.append(None)
                start = 1
            self.next_prompt_logprob = start if start < len(self.prompt_ids) else -1

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    def output_view(self) -> TokenTail:
        """The output tokens as a live view (no copy; it grows with the request)."""
        return TokenTail(self.tokens, len(self.prompt_ids))

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.next_prompt_logprob >= 0

    @property
    def awaits_last_token(self) -> bool:
        """Overlapped scheduling: its last output token is still being sampled (a placeholder,
        see runtime/overlap.py), so it has nothing left to compute."""
        return self.tokens[-1] < 0 and self.num_output >= self.output_limit

    @property
    def is_prefilling(self) -> bool:
        """More than the one newest token is left to compute (a prompt, or a re-admission)."""
        return len(self.tokens) - self.num_computed > 1

    def reuse_limit(self) -> int:
        """How many leading tokens may come from the cache.

        The last token is always computed when its logits are needed (to sample, or to score the
        prompt); a prompt's tokens are computed from one before the first position to score.
        """
        limit = len(self.tokens)
        if self.num_output < self.output_limit or self.wants_prompt_logprobs:
            limit -= 1
        if self.wants_prompt_logprobs:
            limit = min(limit, max(self.next_prompt_logprob - 1, 0))
        return limit
