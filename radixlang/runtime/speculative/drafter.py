"""Which tokens each decoding request drafts in a step, and how many.

A request's draft is, in order of trust: what the radix cache holds after exactly its tokens
(an earlier request of the same salt that wrote the same text and went on: a repeated prompt,
a regenerated answer, siblings that agree so far); else the continuation of the longest suffix
(2..5 tokens) that occurred before in its own prompt and output; else in the text of another
recent request of the same salt (siblings writing side by side, an earlier program run).

How many tokens: each request keeps, per kind of draft (from the cache, or a suffix of 3 or
more tokens, of 2, of 1), an estimate ``a`` of how often such draft tokens are accepted
(decayed counts, pulled back towards a prior while it does not draft, so a request that stopped
drafting tries again later). Its ``j``-th draft token is worth ``a ** j`` expected tokens; the
step's tokens are added best first while one is worth more than ``MARGIN`` times what it costs:
the step's tokens per second times the seconds one more token adds (``step_cost.py``). Alone
on a CPU nearly any match is worth drafting; in a batch of 32 only confident ones are.

When nothing waits to be admitted and every request runs to its length limit (EOS ignored:
forked samples, a tree of thoughts), the batch ends when the requests furthest behind do: a
token that puts another request further ahead saves nothing, and one of theirs saves a step
only when all of them take one. Only they draft then, each token worth the chance that all of
them take it. (Where a request may end at EOS, its end is not known; tokens keep their worth.)
"""

from __future__ import annotations

import collections
import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from radixlang.runtime.radix_cache import RadixCache
from radixlang.runtime.request import Req
from radixlang.runtime.speculative.ngram_index import MAX_NGRAM, NgramIndex
from radixlang.runtime.speculative.step_cost import StepCost

# Kinds of draft, most trusted first: the cache's path after exactly the request's tokens, then
# the continuation of a suffix of 3 or more tokens, of 2, of 1.
CACHE, LONG, SHORT, ONE = range(4)
KIND_NAMES = ("cache", "suffix3", "suffix2", "suffix1")
# Acceptance priors per kind: a request's first drafts of a kind are taken as accepted this
# often, with the weight of this many verified tokens.
PRIOR_ACCEPTANCE = (0.8, 0.6, 0.45, 0.3)
PRIOR_WEIGHT = 2.0
DECAY = 0.8  # per verification: older evidence fades
IDLE_DECAY = 0.97  # per step without a draft: the estimate drifts back to the prior
# The recent requests of a salt whose text drafts others' tokens, and the salts kept (the most
# recently drafting ones).
SHARED_SEQUENCES = 16
SHARED_SALTS = 64
# A draft token must be worth more than this many times what it costs (1: more than it costs,
# by the estimates; raise it to draft only what surely pays).
MARGIN = 1.0


@dataclass
class DraftState:
    """A request's drafting state (kept on its ``Req``)."""

    index: NgramIndex
    # Per kind of draft: decayed counts of draft tokens accepted, and verified.
    accepted: list[float] = field(default_factory=lambda: [0.0] * len(KIND_NAMES))
    tried: list[float] = field(default_factory=lambda: [0.0] * len(KIND_NAMES))
    last_draft: int = 0  # tokens drafted in its last step
    last_kind: int = CACHE  # the kind of its last draft

    def acceptance(self, kind: int) -> float:
        prior = PRIOR_ACCEPTANCE[kind] * PRIOR_WEIGHT
        return (self.accepted[kind] + prior) / (self.tried[kind] + PRIOR_WEIGHT)

    def best_acceptance(self) -> float:
        return max(self.acceptance(kind) for kind in range(len(KIND_NAMES)))


@dataclass
class DraftCounters:
    verify_steps: int = 0  # steps that verified at least one draft
    draft_tokens: int = 0  # draft tokens verified
    accepted_tokens: int = 0  # of those, taken
    drafting_requests: int = 0  # requests' verifications (a step counts each request)
    proposals: int = 0  # requests that found a draft in a step
    planned_out: int = 0  # of those, given no tokens by the cost rule
    # Per kind of draft (KIND_NAMES): tokens verified, and accepted.
    kind_drafted: list[int] = field(default_factory=lambda: [0] * len(KIND_NAMES))
    kind_accepted: list[int] = field(default_factory=lambda: [0] * len(KIND_NAMES))


class Drafter:
    """Drafts for a step's decoding requests (``plan``) and learns from their verification
    (``verified``)."""

    def __init__(self, cache: RadixCache, cost: StepCost, max_draft: int) -> None:
        self.cache = cache
        self.cost = cost
        self.max_draft = max_draft
        self.counters = DraftCounters()
        # Per salt, the recent requests' indexes, most recently drafted last (and the salts
        # in that order too).
        self._shared: dict[str, collections.OrderedDict[int, NgramIndex]] = {}

    # ---- a step's drafts -------------------------------------------------------------------
    def plan(self, reqs: list[Req], budget: int, closed: bool = False) -> dict[Req, list[int]]:
        """The drafts for ``reqs`` (decoding requests of the coming step), at most ``budget``
        tokens in all; requests without one are left out. ``closed``: nothing waits to be
        admitted (see the module)."""
        proposals: list[tuple[Req, DraftState, list[int], float]] = []
        behind = _furthest_behind(reqs) if closed else None
        seqs = len(reqs)
        seconds = self.cost.seconds(seqs, seqs)
        per_token = self.cost.per_token
        if behind is not None and len(behind) > 1:
            # Worth nothing unless all of them are likely to take a token: say so before
            # looking for drafts (the best each could have).
            best = math.prod(self._state(r).best_acceptance() for r in behind)
            if best * seconds <= MARGIN * per_token * seqs:
                return {}
        for req in reqs:
            if not self.eligible(req) or (behind is not None and req not in behind):
                continue
            state = self._state(req)
            draft, kind = self.propose(req, state)
            if draft:
                state.last_kind = kind
                proposals.append((req, state, draft, state.acceptance(kind)))
            else:
                _idle(state)
        if behind is not None and proposals:
            # A step is saved only when every request furthest behind takes a token: each
            # one's first token is worth the chance that all the others take theirs.
            if len(proposals) < len(behind):
                return {}
            alphas = [alpha for *_, alpha in proposals]
            proposals = [
                (req, state, draft, alpha * math.prod(alphas[:n] + alphas[n + 1 :]))
                for n, (req, state, draft, alpha) in enumerate(proposals)
            ]
        if not proposals or budget <= 0:
            return {}
        self.counters.proposals += len(proposals)
        tokens_out = float(seqs)
        # Best first: each request's next draft token, worth acceptance ** position.
        heap = [(-alpha, n, 1) for n, (_, _, _, alpha) in enumerate(proposals)]
        heapq.heapify(heap)
        counts = [0] * len(proposals)
        while heap and budget > 0:
            neg_gain, n, position = heapq.heappop(heap)
            gain = -neg_gain
            if gain * seconds <= MARGIN * per_token * tokens_out:
                break  # worth less than it costs; every later one is worth less still
            counts[n] = position
            seconds += per_token
            tokens_out += gain
            budget -= 1
            _, state, draft, alpha = proposals[n]
            if position < min(len(draft), self.max_draft):
                heapq.heappush(heap, (-(alpha ** (position + 1)), n, position + 1))
        planned: dict[Req, list[int]] = {}
        for (req, state, draft, _), count in zip(proposals, counts, strict=True):
            state.last_draft = count
            if count:
                planned[req] = draft[:count]
            else:
                self.counters.planned_out += 1
                _idle(state)
        return planned

    def eligible(self, req: Req) -> bool:
        """Whether ``req`` may draft now: it is decoding (an output token to extend, none still
        being sampled), with room for two more tokens, no beams, and not a seeded sample (a
        seed's samples stay those of decoding without drafts)."""
        return (
            req.beam is None
            and req.num_output >= 1
            and req.tokens[-1] >= 0
            and req.num_output + 1 < req.output_limit
            and (req.generator is None or req.params.is_greedy)
        )

    def propose(self, req: Req, state: DraftState) -> tuple[list[int], int]:
        """Up to ``max_draft`` tokens that may follow ``req``'s tokens (see the module), and
        their kind."""
        limit = min(self.max_draft, req.output_limit - req.num_output - 1)
        tokens = req.tokens
        handle = req.handle
        if handle is not None and handle.valid:
            draft = self.cache.continuation(handle, tokens[handle.length :], limit)
            if draft:
                return draft, CACHE
        index = state.index
        index.update()
        self._touch(req, index)
        suffix = tokens[-MAX_NGRAM:]
        best_n, best_at = index.find(suffix)
        best = index
        for other in reversed(self._shared.get(req.cache_salt, {}).values()):
            if other is index or best_n == MAX_NGRAM:
                continue
            other.update()
            n, at = other.find(suffix)
            if n > best_n:
                best_n, best_at, best = n, at, other
        if not best_n:
            return [], ONE
        kind = LONG if best_n >= 3 else SHORT if best_n == 2 else ONE
        return best.continuation(best_at, limit), kind

    # ---- after verification -------------------------------------------------------------
    def verified(self, req: Req, drafted: int, accepted: int, rejected: bool) -> None:
        """``req``'s ``drafted`` tokens were verified: the first ``accepted`` taken, and the
        next one ``rejected`` (False when the request ended, or its draft ran out, first)."""
        state = self._state(req)
        kind = state.last_kind
        state.accepted[kind] = DECAY * state.accepted[kind] + accepted
        state.tried[kind] = DECAY * state.tried[kind] + accepted + int(rejected)
        c = self.counters
        c.draft_tokens += drafted
        c.accepted_tokens += accepted
        c.drafting_requests += 1
        c.kind_drafted[kind] += drafted
        c.kind_accepted[kind] += accepted

    def wants_tokens(self, reqs: list[Req]) -> bool:
        """Whether some request drafted in its last step (overlapped scheduling waits for
        its tokens, so that it can draft again)."""
        return any(isinstance(r.drafting, DraftState) and r.drafting.last_draft > 0 for r in reqs)

    def stats(self) -> dict[str, float | int]:
        c = self.counters
        return {
            "spec_verify_steps": c.verify_steps,
            "spec_draft_tokens": c.draft_tokens,
            "spec_accepted_tokens": c.accepted_tokens,
            "spec_accept_rate": c.accepted_tokens / c.draft_tokens if c.draft_tokens else 0.0,
            # Tokens a request takes from one verification: its accepted drafts and one more.
            "spec_tokens_per_verify": (
                (c.accepted_tokens + c.drafting_requests) / c.drafting_requests
                if c.drafting_requests
                else 0.0
            ),
            "spec_cost_per_token_ms": 1e3 * self.cost.per_token,
            **{
                f"spec_draft_tokens_{name}": c.kind_drafted[kind]
                for kind, name in enumerate(KIND_NAMES)
            },
            **{
                f"spec_accepted_tokens_{name}": c.kind_accepted[kind]
                for kind, name in enumerate(KIND_NAMES)
            },
        }

    def reset_stats(self) -> None:
        self.counters = DraftCounters()

    def forget(self) -> None:
        """Forget the finished requests' text (the cache was flushed)."""
        self._shared.clear()

    # ---- state ---------------------------------------------------------------------------
    def _state(self, req: Req) -> DraftState:
        state: Any = req.drafting
        if state is None:
            state = req.drafting = DraftState(NgramIndex(req.tokens))
        return state

    def _touch(self, req: Req, index: NgramIndex) -> None:
        salts = self._shared
        shared = salts.pop(req.cache_salt, None)
        if shared is None:
            shared = collections.OrderedDict()
            while len(salts) >= SHARED_SALTS:  # the salt that drafted longest ago goes
                salts.pop(next(iter(salts)))
        salts[req.cache_salt] = shared  # most recent last
        key = id(index)
        shared[key] = index
        shared.move_to_end(key)
        while len(shared) > SHARED_SEQUENCES:
            shared.popitem(last=False)


def _furthest_behind(reqs: list[Req]) -> set[Req] | None:
    """In a batch of requests that all run to their length limit (EOS ignored: forked
    samples, a tree of thoughts), the ones with the most tokens left, which decide when the
    batch ends; None for any other batch."""
    if not all(r.params.ignore_eos for r in reqs):
        return None
    left = [r.output_limit - r.num_output for r in reqs]
    most = max(left)
    return {r for r, n in zip(reqs, left, strict=True) if n == most}


def _idle(state: DraftState) -> None:
    for kind in range(len(KIND_NAMES)):
        state.accepted[kind] *= IDLE_DECAY
        state.tried[kind] *= IDLE_DECAY
    state.last_draft = 0
