"""The engine's step, in one of two ways chosen once when the engine starts.

:class:`OneAtATime` schedules, runs the batch, samples and takes the tokens before it returns.
:class:`Overlapped` (``overlap``; see ``overlap.py`` for the mechanism) runs the forward and the
sampling on a device thread and schedules the next step while they run. Each owns what its way
needs (the device thread, the step in flight, the requests that must see each token before
the next schedule); the engine calls the same hooks on either: ``step``, ``fence``, ``run`` and
``submit`` for device work, ``admitted`` and ``finished`` for each request.

What a step's tokens mean (stops, constraints, stream events, the end) is
``request_outputs.py``'s; a stepper reaches it, and the engine's batch run, through
:class:`StepHost`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from radixlang.runtime.model_runner import ModelRunner, SequenceInput
from radixlang.runtime.overlap import (
    DeviceWorker,
    InflightStep,
    placeholder,
    resolve_placeholders,
)
from radixlang.runtime.request import Req
from radixlang.runtime.request_outputs import RequestOutputs
from radixlang.runtime.sampling import SamplingRow, all_plain_greedy, sample, uses_penalties
from radixlang.runtime.sampling_rows import sampling_row
from radixlang.runtime.scheduler import Chunk, Scheduler

log = logging.getLogger("radixlang.runtime.engine")  # the engine's: a failed step is its news
T = TypeVar("T")


class StepHost(Protocol):
    """What a stepper needs from the engine."""

    scheduler: Scheduler
    runner: ModelRunner
    _generator: torch.Generator
    _outputs: RequestOutputs  # where a step's tokens go

    def _run_batch(self, chunks: list[Chunk]) -> int:
        """Compute and sample ``chunks`` now, taking their tokens; how many were taken."""

    def _account(self, started: float, new_tokens: int) -> None:
        """Count a step's time and tokens."""

    def _check_step(self) -> None:
        """The integrity check after a step, where asked for."""


class OneAtATime:
    """Schedule, run the batch, sample and take its tokens, all before ``step`` returns; device
    work runs on the engine thread."""

    inflight: InflightStep | None = None  # never one
    thread: threading.Thread | None = None  # no device thread
    overlapped_steps = 0

    def __init__(self, host: StepHost) -> None:
        self.host = host

    def step(self, started: float) -> bool:
        """Schedule, run the batch, sample and take its tokens, all before returning."""
        schedule = self.host.scheduler.schedule()
        for req in schedule.finished:
            self.host._outputs.complete(req)
        if not schedule.chunks:
            self.host._account(started, 0)
            return bool(schedule.finished)
        self.host._account(started, self.host._run_batch(schedule.chunks))
        self.host._check_step()
        return True

    def fence(self) -> int:
        return 0  # nothing in flight

    def run(self, fn: Callable[[], T]) -> T:
        return fn()

    def submit(self, fn: Callable[[], Any]) -> None:
        fn()

    def admitted(self, req: Req) -> None:
        pass

    def finished(self, req: Req) -> None:
        pass

    def close(self) -> None:
        pass


class Overlapped:
    """Schedule step N+1 while step N's forward runs on the device thread."""

    def __init__(self, host: StepHost) -> None:
        self.host = host
        self.device = DeviceWorker()
        self.thread: threading.Thread | None = self.device.thread
        self.inflight: InflightStep | None = None  # the step submitted and not yet taken
        self._processing = False
        # Requests whose next token the engine must see before it schedules again: while any
        # is present, steps do not overlap.
        self._sync_rids: set[str] = set()
        self.overlapped_steps = 0

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread (after the steps submitted) and wait for it."""
        return self.device.run(fn)

    def submit(self, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` on the device thread behind the steps submitted (e.g. copy-on-write:
        its block may be one a running step still writes)."""
        self.device.submit(fn)

    def admitted(self, req: Req) -> None:
        if needs_each_token(req):
            self._sync_rids.add(req.rid)

    def finished(self, req: Req) -> None:
        self._sync_rids.discard(req.rid)

    def close(self) -> None:
        self.device.close()

    def step(self, started: float) -> bool:
        """Schedule step N+1 while step N's forward runs on the device thread: a batch of plain
        decodes is launched, and then step N's tokens are taken. A step with a prefill chunk,
        or a request that needs each token before the next schedule, runs after a fence."""
        new_tokens = 0
        drafter = self.host.scheduler.drafter
        if (
            self._sync_rids
            or self.inflight is None
            or (drafter is not None and drafter.wants_tokens(self.host.scheduler.running))
        ):
            # Nothing to overlap with, a request that needs each token before the next
            # schedule, or one that drafts (from its tokens, all known): the previous step's
            # tokens first.
            new_tokens = self.fence()
            if not self.host.scheduler.has_work():
                self.host._account(started, new_tokens)
                return bool(new_tokens)
        schedule = self.host.scheduler.schedule()
        for req in schedule.finished:
            self.host._outputs.complete(req)
        chunks = schedule.chunks
        if not chunks:
            new_tokens += self.fence()
            self.host._account(started, new_tokens)
            return bool(schedule.finished or new_tokens)
        if not self._sync_rids and all(_plain_decode(c) for c in chunks):
            launched = self._launch(chunks)
            previous, self.inflight = self.inflight, launched
            if previous is not None:
                new_tokens += self._process(previous)
        else:  # a prefill chunk: its tokens may be needed at once (prompt logprobs, ...)
            new_tokens += self.fence()
            chunks = [c for c in chunks if c.req.finish_reason is None]
            if chunks:
                new_tokens += self.device.run(functools.partial(self.host._run_batch, chunks))
        self.host._account(started, new_tokens)
        self.host._check_step()
        return True

    def _launch(self, chunks: list[Chunk]) -> InflightStep | None:
        """Submit a step of plain decodes, its batch packed here (a stand-in token where the
        input is still being sampled); every request sampled in it gets a placeholder for its
        token (see runtime/overlap.py). None if the batch failed its checks (its requests
        failed, as a failing step's)."""
        seqs: list[SequenceInput] = []
        pending_rows: list[int] = []
        pending: list[int] = []
        for i, chunk in enumerate(chunks):
            req = chunk.req
            token = req.tokens[chunk.start]
            if token < 0:
                pending_rows.append(i)
                pending.append(token)
                token = 0
            seqs.append(SequenceInput([token], chunk.start, req.blocks))
        try:
            prepared = self.host.runner.prepare_decode(seqs)
        except Exception as e:
            log.exception("engine step failed")
            self.host._outputs.fail_chunks(chunks, e)
            return None
        commit = self.host.scheduler.commit
        rows: list[int] = []
        sampling_rows: list[SamplingRow] = []
        sampled: list[Req] = []
        positions: list[int] = []
        for i, chunk in enumerate(chunks):
            req = chunk.req
            commit(chunk)
            if req.num_output >= req.output_limit:
                continue
            params = req.params
            if req.stop_ids and req.num_output < params.min_new_tokens:
                # The row's output is read (its length) on the device thread: a snapshot.
                row = SamplingRow(
                    params, req.prompt_ids, req.output_ids, req.stop_ids, req.generator
                )
            else:
                row = sampling_row(req)
            rows.append(i)
            sampling_rows.append(row)
            positions.append(len(req.tokens))
            req.tokens.append(placeholder(len(sampled)))
            sampled.append(req)
        device, runner, generator = self.device, self.host.runner, self.host._generator
        plain_greedy = all_plain_greedy(sampling_rows)  # here, not on the device thread

        def run() -> Any:
            try:
                ids = resolve_placeholders(pending, device.last_tokens)
                if ids:
                    runner.set_input_ids(prepared, pending_rows, ids)
                logits = runner.run_decode(prepared).logits
                if len(rows) != logits.shape[0]:
                    logits = logits[torch.tensor(rows, device=logits.device)]
                picks = sample(logits, sampling_rows, generator, plain_greedy=plain_greedy)
            except BaseException:
                device.last_tokens = None  # the next step's placeholders have no tokens
                raise
            device.last_tokens = picks.token_ids
            return picks

        self.overlapped_steps += 1
        return InflightStep(device.submit(run), chunks, sampled, positions)

    def _process(self, step: InflightStep) -> int:
        """Take a submitted step's tokens: write them over their placeholders, detokenize,
        stream and stop. A request that stopped meanwhile drops its token."""
        self._processing = True
        try:
            try:
                picks = step.future.result()
            except Exception as e:
                log.exception("engine step failed")
                self.host._outputs.fail_chunks(step.chunks, e)
                return 0
            appended = 0
            token_ids, logprobs, top = picks.token_ids, picks.logprobs, picks.top_logprobs
            accept = self.host._outputs.accept
            for row, req in enumerate(step.sampled):
                if req.finish_reason is not None:
                    continue  # it stopped (or was aborted) before this token came back
                token, position = token_ids[row], step.positions[row]
                req.tokens[position] = token
                accept(req, token, logprobs[row], top[row], position)
                appended += 1
            return appended
        finally:
            self._processing = False

    def fence(self) -> int:
        """Wait for the submitted step, if any, and take its tokens: afterwards no request
        holds a placeholder. (Not from inside another step's processing, e.g. a callback's
        call: that would take the newer step's tokens before the older step's last ones.)"""
        step = self.inflight
        if step is None or self._processing:
            return 0
        self.inflight = None
        return self._process(step)


def needs_each_token(req: Req) -> bool:
    """Whether ``req``'s next step depends on its last token's value (so steps cannot
    overlap while it runs): a constraint's mask, beams, penalties over the output, prompt
    logprobs, token healing's first mask; or it samples nothing (a prefill-only request)."""
    return (
        req.constraint is not None
        or req.beam is not None
        or req.first_token_mask is not None
        or req.wants_prompt_logprobs
        or req.output_limit <= 0
        or uses_penalties(req.params)
    )


def _plain_decode(chunk: Chunk) -> bool:
    """One token after the prompt, no draft: a step of these can be submitted without
    waiting."""
    return (
        chunk.end - chunk.start == 1
        and chunk.start >= len(chunk.req.prompt_ids)
        and not chunk.draft
    )
