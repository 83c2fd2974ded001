"""Where a request's sampled tokens go: each token's meaning (``token_output.py``), its
stream event on the request's handle, the tokens a grammar forces (jump-forward), a finished
beam search's answer, and the request's end (its result, then its handle, detokenizer and
``Req`` forgotten). All on the engine thread.

The engine's batch run and its steppers (``step_loop.py``) hand every token here; nothing here
schedules or runs the model.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import torch

from radixlang.runtime import token_output
from radixlang.runtime.beam_search import advance_beams
from radixlang.runtime.detokenizer import IncrementalDetokenizer
from radixlang.runtime.handle import RequestHandle
from radixlang.runtime.request import (
    FinishReason,
    GenerationResult,
    Req,
    StreamEvent,
    TopLogprobs,
)
from radixlang.runtime.scheduler import Chunk, Scheduler


class RequestOutputs:
    """The engine's live requests' outputs: ``handles``, ``detokenizers`` and ``reqs`` by
    request id (shared with the engine, which adds to them; ``lock`` guards ``handles``),
    and the counts the engine's stats report. ``finished(req)`` is called for every request
    that ends (the stepper's hook)."""

    def __init__(
        self,
        scheduler: Scheduler,
        handles: dict[str, RequestHandle],
        detokenizers: dict[str, IncrementalDetokenizer],
        reqs: dict[str, Req],
        lock: threading.Lock,
        finished: Callable[[Req], None],
    ) -> None:
        self.scheduler = scheduler
        self.handles = handles
        self.detokenizers = detokenizers
        self.reqs = reqs
        self.lock = lock
        self._finished = finished
        self.finished_requests = 0
        self.finished_by_reason: collections.Counter[FinishReason] = collections.Counter()
        self.jump_forward_tokens = 0
        self.jump_forward_jumps = 0

    def reset_counts(self) -> None:
        self.finished_requests = 0
        self.finished_by_reason.clear()
        self.jump_forward_tokens = 0
        self.jump_forward_jumps = 0

    def fail_chunks(self, chunks: list[Chunk], error: BaseException) -> None:
        for chunk in chunks:
            if chunk.req.finish_reason is None:
                chunk.req.error = f"{type(error).__name__}: {error}"
                self.scheduler.finish(chunk.req, FinishReason.ERROR, cache_kv=False)
                self.complete(chunk.req)

    def advance_beams(self, chunks: list[Chunk], rows: list[int], logits: torch.Tensor) -> int:
        """Beam search picks its own tokens (``beam_search.py``); a finished search answers
        its request with the best beam, in one final stream event."""
        done, advanced = advance_beams(self.scheduler, chunks, rows, logits)
        for group in done:
            req = group.root
            text = group.best_text(self.detokenizers.get(req.rid))
            handle = self.handles.get(req.rid)
            if handle is not None:
                handle.push(
                    StreamEvent(
                        req.rid,
                        req.output_ids,
                        text,
                        list(req.output_logprobs),
                        list(req.output_top_logprobs),
                        True,
                        req.finish_reason,
                        req.prompt_len,
                        req.cached_tokens,
                    )
                )
            self.complete(req)
        return advanced

    def jump_forward(self, req: Req) -> int:
        """Append the tokens ``req``'s constraint forces from here; the next step computes them
        in one extend. Requests that want logprobs decode them one by one, so that every output
        token has the model's logprob."""
        forced_tokens = getattr(req.constraint, "forced_tokens", None)
        if forced_tokens is None or req.params.return_logprob:
            return 0
        try:
            forced = forced_tokens()
        except Exception as e:
            self.fail_constraint(req, e)
            return 0
        appended = 0
        for token in forced[: req.output_limit - req.num_output]:
            if req.finish_reason is not None:
                break
            self.append(req, token, None, None)
            appended += 1
        if appended:
            self.jump_forward_tokens += appended
            self.jump_forward_jumps += 1
        return appended

    def _ends_before(self, req: Req, token: int) -> bool:
        """End ``req`` without ``token`` when its constraint is complete and the token would
        leave it (see ``TokenConstraint``)."""
        try:
            if not token_output.ends_before(req, token):
                return False
        except Exception as e:
            self.fail_constraint(req, e)
            return True
        detok = self.detokenizers.get(req.rid)
        text = detok.flush(check_stop=True) if detok else ""
        reason = FinishReason.STOP
        handle = self.handles.get(req.rid)
        if handle is not None:
            handle.push(StreamEvent(req.rid, [], text, [], [], finished=True, finish_reason=reason))
        self.scheduler.finish(req, reason)
        self.complete(req)
        return True

    def stop_done(self, req: Req) -> None:
        """End ``req``, whose constraint is complete, before it samples."""
        self.scheduler.finish(req, FinishReason.STOP)
        self.complete(req)

    def fail_constraint(self, req: Req, error: Exception) -> None:
        req.error = f"constraint: {type(error).__name__}: {error}"
        self.scheduler.finish(req, FinishReason.ERROR)
        self.complete(req)

    def append(self, req: Req, token: int, logprob: float | None, top: TopLogprobs | None) -> None:
        constraint = req.constraint
        if constraint is not None and self._ends_before(req, token):
            return
        req.tokens.append(token)
        self.accept(req, token, logprob, top)

    def accept(
        self,
        req: Req,
        token: int,
        logprob: float | None,
        top: TopLogprobs | None,
        position: int | None = None,
    ) -> None:
        """``token``, now the last real one of ``req.tokens`` (at ``position``; placeholders
        may follow it), as output (``token_output.take_token``), its stream event, and the end
        of the request when it ends here."""
        rid = req.rid
        text, reason = token_output.take_token(
            req, token, logprob, top, self.detokenizers.get(rid), position
        )
        want_logprob = req.params.return_logprob
        handle = self.handles.get(rid)
        if handle is not None:
            handle.push(
                StreamEvent(
                    rid,
                    [token],
                    text,
                    [logprob] if want_logprob else [],
                    [top] if want_logprob else [],
                    reason is not None,
                    reason,
                    len(req.prompt_ids),
                    req.cached_tokens,
                )
            )
        if reason is not None:
            if req.tokens[-1] < 0:  # overlap: the next step's placeholder, and its computed slot
                _drop_placeholders(req)
            self.scheduler.finish(req, reason)
            self.complete(req)

    def complete(self, req: Req) -> None:
        """Hand a finished request its result and forget it."""
        if req.tokens and req.tokens[-1] < 0:  # ended by the scheduler or a failure: see
            _drop_placeholders(req)  # accept for a request that ends on its own token
        self._finished(req)
        if req.beam is not None:  # any beam's end ends its group: answer the request once
            root = req.beam.end(req, self.scheduler)
            if root is None:
                return
            req = root
        detok = self.detokenizers.pop(req.rid, None)
        self.reqs.pop(req.rid, None)
        with self.lock:
            handle = self.handles.pop(req.rid, None)
        reason = req.finish_reason or FinishReason.ABORT
        self.finished_requests += 1
        self.finished_by_reason[reason] += 1
        if handle is None:
            return
        now = time.perf_counter()
        # Every stream ends with a finished event: add one where the last token's was not.
        tail = detok.flush() if detok and reason in (FinishReason.ABORT, FinishReason.ERROR) else ""
        if tail or not handle.saw_finish:
            handle.push(StreamEvent(req.rid, [], tail, [], [], True, reason))
        handle.set_result(
            GenerationResult(
                request_id=req.rid,
                text=detok.text if detok else "",
                output_ids=req.output_ids,
                prompt_ids=req.prompt_ids,
                finish_reason=reason,
                matched_stop=req.matched_stop,
                prompt_tokens=req.prompt_len,
                completion_tokens=req.num_output,
                cached_tokens=req.cached_tokens,
                output_logprobs=req.output_logprobs,
                output_top_logprobs=req.output_top_logprobs,
                prompt_logprobs=req.prompt_logprobs,
                prompt_top_logprobs=req.prompt_top_logprobs,
                time_to_first_token=(
                    req.first_token_time - req.arrival if req.first_token_time else None
                ),
                latency=now - req.arrival,
                error=req.error,
                beams=req.beam.results if req.beam is not None else [],
            )
        )


def _drop_placeholders(req: Req) -> None:
    """A request ending with tokens still being sampled: drop their placeholders, and count as
    computed only what a step not overlapped would have (the KV of its last real token is
    still being written)."""
    tokens = req.tokens
    while tokens and tokens[-1] < 0:
        tokens.pop()
    req.num_computed = min(req.num_computed, max(0, len(tokens) - 1))
