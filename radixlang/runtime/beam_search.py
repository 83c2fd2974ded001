"""Beam search: ``beam_width`` sequences of one prompt that share their KV blocks.

What it computes is transformers' ``generate(num_beams=k, do_sample=False, length_penalty=...,
early_stopping=...)`` (version 5's beam search), token for token. Each step every running beam's
log-softmax is added to its running score, and the best ``max(2, 1 + stop ids) * k`` candidates
of all ``k x vocab`` are ranked. A candidate that ends (a stop token id, a stop string, or the
last allowed token) is a finished hypothesis if it ranks among the first ``k``, scored
``sum(logprobs) / generated_tokens ** length_penalty``; the ``k`` best candidates that do not end
run on. The ``k`` best hypotheses are kept. The search ends at ``max_new_tokens``, or, once ``k``
hypotheses are in, with ``early_stopping`` at once, and without it as soon as the best running
beam, scored at its current length, does not beat the worst hypothesis. The best hypothesis is
the result; all of them are its ``beams``. The first step ranks the prompt's one row:
transformers starts ``k`` copies with all but one at -1e9, which yields the same candidates.

Memory. The beams are ``k`` requests of the scheduler that decode in the same batch as any
other. A beam that continues beam ``j`` takes ``j``'s block table (one more reference per block)
and drops its own, so beams hold one copy of every block they have in common: the prompt's, and
every prefix they share. Only a partly written last block that two beams would both write into
is copied (``BlockPool.copy_on_write``), and only for the second of them.

A beam retracted under memory pressure breaks the lockstep. While other requests run (and will
free memory) the search starts over from its cached prompt: deterministic, it finds the same
beams again. A search running alone that does not fit the pool ends there instead, with the
best of its hypotheses and running beams so far (finish reason ``length``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlang.runtime.detokenizer import IncrementalDetokenizer
from radixlang.runtime.request import BeamOutput, FinishReason, Req, ReqStatus, TopLogprobs
from radixlang.runtime.scheduler import Chunk, Scheduler


class BeamSearchError(ValueError):
    """A request asks for beam search with something beam search here does not do."""


_F32 = torch.finfo(torch.float32)


def length_normalised(scores: torch.Tensor, length: int, penalty: float) -> list[float]:
    """``scores / length ** penalty``, transformers' beam score, in the same float32 arithmetic
    (so that ties and rounding agree). An extreme penalty (any finite one is allowed) would
    overflow the power or divide by zero: the divisor and the scores stay within float32's
    finite range instead, so the scores order the same way and are JSON numbers."""
    try:
        divisor = length**penalty
    except OverflowError:
        divisor = math.inf
    divisor = min(max(divisor, _F32.tiny), _F32.max)
    return (scores / divisor).clamp(_F32.min, _F32.max).tolist()


@dataclass
class Hypothesis:
    """A finished beam."""

    output_ids: list[int]
    score: float
    finish_reason: FinishReason
    matched_stop: str | int | None
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)


class BeamGroup:
    """The beams of one request: its own ``Req`` is the first, the others join after the
    prompt's first step. Runs on the engine thread."""

    def __init__(self, root: Req, tokenizer: Any | None, vocab_size: int) -> None:
        params = root.params
        self.root = root
        self.width = params.beam_width
        # As transformers: enough candidates that ``width`` of them go on even if every beam's
        # best ones end, at least twice the width.
        self.keep = max(2, 1 + len(root.stop_ids)) * self.width
        if self.keep > vocab_size:
            raise BeamSearchError(
                f"beam_width {self.width} needs {self.keep} candidates per step but the "
                f"vocabulary has {vocab_size} tokens"
            )
        self.beams: list[Req] = [root]  # running, best score first
        self.scores = torch.zeros(1)  # float32 running sums of log-probabilities
        self.num_output = 0  # tokens every running beam has generated
        self.hypotheses: list[Hypothesis] = []  # best first, at most width
        self.results: list[BeamOutput] = []
        self.finalized = False  # the search is over; the root holds the best beam
        self.answered = False  # the engine has completed the request
        self.restarts = 0  # times the search started over after losing a beam
        self._rows: dict[int, torch.Tensor] = {}  # id(beam) -> its logits, this step
        self._tokenizer = tokenizer
        self._stop_ids = sorted(root.stop_ids)

    # ---- the step ----------------------------------------------------------------------------
    def offer(self, beam: Req, logits: torch.Tensor) -> None:
        """``beam``'s next-token logits from this step's forward pass."""
        self._rows[id(beam)] = logits

    def advance(self, scheduler: Scheduler) -> bool:
        """Select this step's beams from the logits offered; True when the search is over."""
        if any(id(b) not in self._rows for b in self.beams):
            # A beam did not run this step (retracted): the beams are no longer in lockstep.
            self._rows.clear()
            return self._out_of_memory(scheduler)
        rows = torch.stack([self._rows.pop(id(b)) for b in self.beams]).float()
        self._rows.clear()
        if self.root.first_token_time is None:
            self.root.first_token_time = time.perf_counter()
        return self._select(scheduler, rows)

    def _select(self, scheduler: Scheduler, logits: torch.Tensor) -> bool:
        params, width = self.root.params, self.width
        logprobs = torch.log_softmax(logits, dim=-1)
        vocab = logprobs.shape[1]
        scored = logprobs
        if self.num_output < params.min_new_tokens and self._stop_ids:
            scored = logprobs.clone()
            scored[:, self._stop_ids] = -math.inf
        totals = (scored + self.scores.to(scored.device)[:, None]).view(-1)
        values, flat = totals.topk(min(self.keep, totals.numel()))
        num_output = self.num_output + 1
        scaled = length_normalised(values, num_output, params.length_penalty)
        parents, tokens = (flat // vocab).tolist(), (flat % vocab).tolist()
        at_limit = num_output >= self.root.output_limit
        going: list[int] = []  # ranks of the candidates that run on
        for rank, (parent, token) in enumerate(zip(parents, tokens, strict=True)):
            if rank >= width and (at_limit or len(going) == width):
                break
            ended = self._ends(self.beams[parent], token, num_output)
            if ended is None and not at_limit:
                if len(going) < width:
                    going.append(rank)
            elif rank < width:  # only the first width candidates may become hypotheses
                reason, matched = ended or (FinishReason.LENGTH, None)
                beam = self.beams[parent]
                lp, top = self._token_logprobs(logprobs, parent, token)
                self._add(
                    Hypothesis(
                        [*beam.output_ids, token],
                        scaled[rank],
                        reason,
                        matched,
                        beam.output_logprobs + lp,
                        beam.output_top_logprobs + top,
                    )
                )
        # With width hypotheses in: early_stopping ends the search; otherwise it ends once the
        # best running beam, scored at its current length, does not beat the worst of them.
        over = len(self.hypotheses) >= width and (
            params.early_stopping or not (going and scaled[going[0]] > self.hypotheses[-1].score)
        )
        if at_limit or not going or over:
            self.finalize(scheduler, with_running=False)
            return True
        picks = []
        for rank in going:
            parent, token = parents[rank], tokens[rank]
            picks.append((parent, token, *self._token_logprobs(logprobs, parent, token)))
        self.scores = values[going]
        self.num_output = num_output
        if not self._fork(scheduler, picks):
            return self._out_of_memory(scheduler)
        return False

    def _out_of_memory(self, scheduler: Scheduler) -> bool:
        """The pool could not keep every beam going; True when that ends the search."""
        if any(r.beam is not self for r in scheduler.running):
            self._restart(scheduler)  # the others will finish and make room: search again
            return False
        self.finalize(scheduler, with_running=True)  # alone, it does not fit the pool
        return True

    def _ends(self, beam: Req, token: int, num_output: int) -> tuple[FinishReason, Any] | None:
        """Whether ``beam`` followed by ``token`` ends: a stop token, or a stop string."""
        if token in self.root.stop_ids:
            return FinishReason.STOP, token
        params = self.root.params
        if not params.stop or self._tokenizer is None or num_output < params.min_new_tokens:
            return None
        text = self._tokenizer.decode(
            [*beam.output_ids, token], skip_special_tokens=params.skip_special_tokens
        )
        found = [(text.find(s), len(s), s) for s in params.stop if s in text]
        return (FinishReason.STOP, min(found)[2]) if found else None

    def _token_logprobs(
        self, logprobs: torch.Tensor, beam: int, token: int
    ) -> tuple[list[float | None], list[TopLogprobs | None]]:
        params = self.root.params
        if not params.return_logprob:
            return [], []
        top = None
        if params.top_logprobs_num:
            v, ids = logprobs[beam].topk(min(params.top_logprobs_num, logprobs.shape[1]))
            top = list(zip(ids.tolist(), v.tolist(), strict=True))
        return [float(logprobs[beam, token])], [top]

    def _add(self, hyp: Hypothesis) -> None:
        hyps = self.hypotheses
        hyps.append(hyp)
        hyps.sort(key=lambda h: -h.score)  # stable: an earlier one wins a tie
        del hyps[self.width :]

    # ---- memory --------------------------------------------------------------------------
    def _fork(
        self,
        scheduler: Scheduler,
        picks: list[tuple[int, int, list[float | None], list[TopLogprobs | None]]],
    ) -> bool:
        """Make beam ``i`` continue ``picks[i]``'s parent with its token; False if the pool
        cannot give the blocks copied on write."""
        pool, cache = scheduler.pool, scheduler.cache
        old = self.beams
        # Each beam takes its parent's table and cache lock before any old table is dropped:
        # a parent may be continued by several beams, or by none. Parents are read in full
        # first, since a beam may be the parent of another.
        states = []
        for parent_index, token, lp, top in picks:
            p = old[parent_index]
            pool.incref(_held(p.blocks))
            assert p.handle is not None, "a running beam holds a locked cache path"
            cache.lock(p.handle)
            states.append(
                (
                    [*p.tokens, token],
                    list(p.blocks),
                    p.num_computed,
                    p.high_water,
                    p.handle,
                    p.output_logprobs + lp,
                    p.output_top_logprobs + top,
                )
            )
        for beam in old:
            pool.decref(_held(beam.blocks))
            if beam.handle is not None:
                cache.unlock(beam.handle)
        beams = old + [self._new_beam(i) for i in range(len(old), len(states))]
        for beam, state in zip(beams, states, strict=True):
            (
                beam.tokens,
                beam.blocks,
                beam.num_computed,
                beam.high_water,
                beam.handle,
                beam.output_logprobs,
                beam.output_top_logprobs,
            ) = state
            beam.sampling_row = None  # it viewed the old token list
        for beam in beams[len(old) :]:
            beam.status = ReqStatus.RUNNING
            scheduler.running.append(beam)
        self.beams = beams
        return self._copy_shared_tails(scheduler)

    def _copy_shared_tails(self, scheduler: Scheduler) -> bool:
        """Give every beam a last block of its own to write its next token into: where beams
        share a partly written one, the first keeps it and the others copy it."""
        pool, bs = scheduler.pool, scheduler.block_size
        writes: list[tuple[Req, int]] = []  # (beam, valid slots) that must copy
        claimed: set[int] = set()
        for beam in self.beams:
            slots = beam.num_computed % bs
            if not slots:  # the next token starts a new block: the scheduler allocates it
                continue
            last = beam.blocks[beam.num_computed // bs]
            if last in claimed:
                writes.append((beam, slots))
            claimed.add(last)
        short = len(writes) - pool.num_free
        if short > 0:
            scheduler.cache.evict(short)
        if len(writes) > pool.num_free:
            return False
        for beam, slots in writes:
            index = beam.num_computed // bs
            beam.blocks[index] = pool.copy_on_write(beam.blocks[index], slots)
        return True

    def _restart(self, scheduler: Scheduler) -> None:
        """Start the search over: the root waits to be admitted again with its prompt (cached
        by now) and the other beams are dropped, their KV left in the cache. The search is
        deterministic, so it finds the same beams, at the cost of computing them again."""
        root = self.root
        for beam in self.beams[1:]:
            scheduler.finish(beam, FinishReason.ABORT)  # released; not a request of its own
        if root.status is ReqStatus.RUNNING:
            scheduler.retract(root)
        root.tokens = list(root.prompt_ids)
        root.output_logprobs, root.output_top_logprobs = [], []
        root.sampling_row = None
        self.beams = [root]
        self.scores = torch.zeros(1)
        self.num_output = 0
        self.hypotheses = []
        self.restarts += 1

    def _new_beam(self, index: int) -> Req:
        root = self.root
        beam = Req(
            rid=f"{root.rid}#beam{index}",
            prompt_ids=root.prompt_ids,
            params=root.params,
            stop_ids=root.stop_ids,
            output_limit=root.output_limit,
            arrival=root.arrival,
            first_token_time=root.first_token_time,
            cached_tokens=root.cached_tokens,
            admitted=True,
            beam=self,
            cache_salt=root.cache_salt,
        )
        # The prompt's log-probabilities are the root's (computed once).
        beam.prompt_logprobs, beam.prompt_top_logprobs = [], []
        beam.next_prompt_logprob = -1
        return beam

    # ---- the end ---------------------------------------------------------------------------
    def finalize(self, scheduler: Scheduler, with_running: bool) -> None:
        """End the search: every beam's KV goes to the cache, the root takes the best beam.
        ``with_running``: the running beams count as hypotheses at their current length."""
        if with_running and self.num_output:
            penalty = self.root.params.length_penalty
            scaled = length_normalised(self.scores, self.num_output, penalty)
            for beam, score in zip(self.beams, scaled, strict=True):
                self._add(
                    Hypothesis(
                        beam.output_ids,
                        score,
                        FinishReason.LENGTH,
                        None,
                        list(beam.output_logprobs),
                        list(beam.output_top_logprobs),
                    )
                )
        for beam in self.beams:
            if beam.status is not ReqStatus.FINISHED:
                scheduler.finish(beam, FinishReason.LENGTH)
        root = self.root
        best = self.hypotheses[0] if self.hypotheses else None
        if best is not None:
            root.tokens = list(root.prompt_ids) + best.output_ids
            root.output_logprobs = list(best.logprobs)
            root.output_top_logprobs = list(best.top_logprobs)
            root.finish_reason, root.matched_stop = best.finish_reason, best.matched_stop
        self.results = [
            BeamOutput(self._text(h, self._detokenizer()), h.output_ids, h.score, h.finish_reason)
            for h in self.hypotheses
        ]
        self.finalized = True

    def best_text(self, detokenizer: IncrementalDetokenizer | None) -> str:
        """The best beam's text, pushed through the request's own detokenizer."""
        return self._text(self.hypotheses[0], detokenizer) if self.hypotheses else ""

    def end(self, member: Req, scheduler: Scheduler) -> Req | None:
        """``member`` ended (the search finished, or it was aborted, failed or outgrew the
        pool): end every beam. Returns the request's own Req the first time, None after."""
        if self.answered:
            return None
        self.answered = True
        if not self.finalized:
            reason = member.finish_reason or FinishReason.ABORT
            for beam in self.beams:
                if beam.status is not ReqStatus.FINISHED:
                    scheduler.finish(beam, reason, cache_kv=reason is not FinishReason.ERROR)
            self.root.finish_reason = reason
            self.root.error = self.root.error or member.error
        return self.root

    def _detokenizer(self) -> IncrementalDetokenizer | None:
        if self._tokenizer is None:
            return None
        params = self.root.params
        return IncrementalDetokenizer(
            self._tokenizer, self.root.prompt_ids, params.stop, params.skip_special_tokens
        )

    def _text(self, hyp: Hypothesis, detokenizer: IncrementalDetokenizer | None) -> str:
        """``hyp``'s text as a request that generated its tokens would have it: without its
        stop token, cut before its stop string."""
        if detokenizer is None:
            return ""
        ids = hyp.output_ids
        if ids and hyp.matched_stop == ids[-1] and not isinstance(hyp.matched_stop, str):
            ids = ids[:-1]
        min_new = self.root.params.min_new_tokens
        for i, token in enumerate(ids):
            detokenizer.push(token, check_stop=i + 1 >= min_new)
            if detokenizer.stopped:
                return detokenizer.text
        detokenizer.flush()
        return detokenizer.text


def _held(blocks: list[int]) -> list[int]:
    """The entries of a block table that hold a reference (a sliding window marks the blocks
    it released with a negative id)."""
    return [b for b in blocks if b >= 0]


def split_beam_rows(chunks: Sequence[Chunk], sampled: list[int]) -> tuple[list[int], list[int]]:
    """(rows of ordinary requests, rows of beams) among the rows to sample."""
    rest = [i for i in sampled if chunks[i].req.beam is None]
    if len(rest) == len(sampled):
        return sampled, []
    return rest, [i for i in sampled if chunks[i].req.beam is not None]


def advance_beams(
    scheduler: Scheduler, chunks: Sequence[Chunk], rows: list[int], logits: torch.Tensor
) -> tuple[list[BeamGroup], int]:
    """Hand each beam its logits row and take every group one step; returns the groups whose
    search is over (their root to complete) and how many beams were advanced."""
    groups: dict[int, BeamGroup] = {}
    for i in rows:
        req = chunks[i].req
        group = req.beam
        assert group is not None
        group.offer(req, logits[i])
        groups[id(group)] = group
    done = [g for g in groups.values() if g.advance(scheduler)]
    return done, len(rows)
