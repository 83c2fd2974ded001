"""The scheduler: which requests compute which tokens in the next step, and the KV blocks for it.

Every step it (1) gives each running request its next tokens — one for a decode, a chunk under
the token budget for a prompt still prefilling — and secures their blocks, evicting cached
prefixes and, when that is not enough, retracting the running request that loses least; then
(2) admits waiting requests in a prefix-aware order while the budget and the pool (free plus
evictable blocks, less a reserve for the running requests' growth) allow.

Prefix reuse is token-granular: an admitted request takes the blocks of its longest cached prefix
(one reference each), copies a partly shared last block on write, and computes only the rest. A
prompt's progress goes into the radix cache after every prefill chunk, so requests that share an
uncached prefix with a prompt being computed wait for it and then hit it, instead of computing
it again. Finished and retracted requests leave their KV in the cache.

The scheduler owns no model: the engine runs the chunks and reports back through ``commit``.
"""

from __future__ import annotations

import enum
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixlang.runtime.block_pool import (
    RELEASED,
    BlockPool,
    IntegrityError,
    OutOfBlocksError,
    blocks_for,
    dead_blocks,
)
from radixlang.runtime.radix_cache import MatchResult, RadixCache, common_prefix_len
from radixlang.runtime.request import FinishReason, Req, ReqStatus
from radixlang.runtime.return_times import ReturnTimes

# Waiting queues longer than this are ordered first-come-first-served: prefix-aware ordering
# walks the tree once per waiting request every step.
MAX_PREFIX_ORDERED = 1024
# Prompt-logprob chunks are capped: every token of them needs a full row of logits.
MAX_LOGPROB_CHUNK = 512
# The reserve for running requests' growth assumes they generate this fraction of their
# remaining max_new_tokens; it decays while memory holds and jumps after a retraction.
INITIAL_NEW_TOKEN_RATIO = 0.5
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002
# A predicted return's load starts this early, plus its copy time (PREFETCH_LEAD_BLOCKS blocks
# at the tier's measured speed): a few decode steps on a CPU.
PREFETCH_LEAD_S = 0.1
PREFETCH_LEAD_BLOCKS = 256
# The "program" policy: a request waiting this long goes first whatever its program's service;
# the service of this many programs is remembered (the least recently served forgotten first).
STARVATION_S = 10.0
MAX_PROGRAMS_SERVED = 8192


class Preemption(enum.StrEnum):
    """What a retracted request's KV becomes."""

    # It stays in the device cache as a prefix like any other; if eviction takes it before the
    # request runs again, the request computes it again (or loads it, where the tier kept it).
    RECOMPUTE = "recompute"
    # It is moved to the host tier at once (its blocks free now, other prefixes untouched) and
    # loaded back when the request is admitted again. Needs a host tier.
    SWAP = "swap"


class SchedulePolicy(enum.StrEnum):
    LPM = "lpm"  # longest cached prefix first
    DFS_WEIGHT = "dfs-weight"  # depth-first over the waiting prompts' trie, largest subtree first
    FCFS = "fcfs"  # arrival order
    # The least attained service first (Autellix's PLAS): a program's requests so far count,
    # so short agents are not stuck behind long ones; requests that waited STARVATION_S go
    # first whatever their program.
    PROGRAM = "program"


@dataclass
class Chunk:
    """Compute ``req.tokens[start:end]`` in the next forward pass, then ``draft``: tokens
    proposed to follow (speculative decoding; a decode only), whose KV is written after the
    request's and kept only for the ones verification accepts."""

    req: Req
    start: int
    end: int
    draft: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.req.tokens[self.start : self.end]


@dataclass
class Schedule:
    chunks: list[Chunk] = field(default_factory=list)
    # Requests that finished without computing anything: prefill-only prompts already cached,
    # or sequences that outgrew the whole pool.
    finished: list[Req] = field(default_factory=list)


@dataclass
class SchedulerCounters:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    prompt_tokens_reused: int = 0  # of those, taken from the cache
    prompt_tokens_computed: int = 0  # prompt positions computed (not counting re-runs)
    recomputed_tokens: int = 0  # positions computed again after a retraction
    tier_loaded_tokens: int = 0  # positions admitted requests loaded back from the host tier
    swapped_out_blocks: int = 0  # device blocks retracted requests freed by moving to the tier
    retractions: int = 0
    steps: int = 0


class DraftPlanner(Protocol):
    """Speculative decoding's drafts for a step (``runtime/speculative/drafter.py``)."""

    def plan(self, reqs: list[Req], budget: int, closed: bool) -> dict[Req, list[int]]:
        """Drafts for some of ``reqs`` (decoding requests), at most ``budget`` tokens in all;
        ``closed``: no request waits to be admitted."""
        ...

    def wants_tokens(self, reqs: list[Req]) -> bool:
        """Whether some of ``reqs`` would draft if their last tokens were known."""
        ...


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        cache: RadixCache,
        max_batch_tokens: int = 2048,
        max_running_requests: int = 256,
        policy: SchedulePolicy | str = SchedulePolicy.LPM,
        defer_min_shared_tokens: int = 1,
        sliding_window: int | None = None,
        preemption: Preemption | str = Preemption.RECOMPUTE,
        drafter: DraftPlanner | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``clock`` reads the time on the clock of ``Req.arrival`` (``time.perf_counter``);
        tests pass a fake one to age requests without waiting."""
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        if max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        try:
            self.policy = SchedulePolicy(policy)
        except ValueError:
            names = ", ".join(p.value for p in SchedulePolicy)
            raise ValueError(f"schedule_policy must be one of {names}; got {policy!r}") from None
        try:
            self.preemption = Preemption(preemption)
        except ValueError:
            names = ", ".join(p.value for p in Preemption)
            raise ValueError(f"preemption must be one of {names}; got {preemption!r}") from None
        if self.preemption is Preemption.SWAP and cache.tier is None:
            raise ValueError("preemption 'swap' needs a host tier to swap to")
        self.pool = pool
        self.cache = cache
        self.block_size = pool.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running_requests = max_running_requests
        self.defer_min_shared_tokens = defer_min_shared_tokens
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        # A model whose every layer attends within this window: running requests release the
        # blocks before it (see _release_dead_blocks), so the pool bounds the window, not the
        # context.
        self.sliding_window = sliding_window
        # Speculative decoding: decodes may compute a draft after their token (see _draft).
        self.drafter = drafter
        self.clock = clock
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.new_token_ratio = INITIAL_NEW_TOKEN_RATIO
        self.counters = SchedulerCounters()
        # The cache's eviction count at the last reset: stats count evictions from there.
        self._evicted_base = cache.evicted_blocks_total
        # Tokens computed per program, least recently served first (the "program" policy).
        self.service: dict[str, int] = {}
        # When paused programs return (return_times.py): eviction order among retained paths,
        # and when to load a retained path back from the tier (with the cache's copier).
        self.return_times = ReturnTimes()
        self._last_schedule: float | None = None
        self._step_seconds = 0.0  # recent steps' length (an average)

    # ---- queue ---------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.status = ReqStatus.WAITING
        self.waiting.append(req)
        self.return_times.resumed(req.program)
        if self.cache.copier is not None and self.cache.tiered_tokens:
            # Load its tiered prefix now, on the copy thread, while this step's forward runs:
            # admission then finds it resident. Room comes as admission's would (plain leaves,
            # then retained paths predicted back later than now), less what running requests
            # will still write.
            cache = self.cache
            room = max(0, cache.evictable_size() - self._reserve_blocks())
            key = req.tokens[: req.reuse_limit()]
            now = self.return_times.now()
            cache.prefetch_prefix(key, req.cache_salt, req.program, room, needed_at=now)

    def prefetch_due(self) -> None:
        """Load back the retained paths of paused programs predicted to return soon (with a
        copier and a tier holding something); room for them comes from plain cached prefixes
        and from retained paths predicted back later, never from running requests' needs."""
        cache = self.cache
        if cache.copier is None or not cache.tiered_tokens:
            return
        for program in self.return_times.due(self.prefetch_lead()):
            room = max(0, cache.evictable_size() - self._reserve_blocks())
            cache.prefetch_retained(program, room)

    def prefetch_lead(self) -> float:
        """How early to start a predicted return's load: a few steps plus its copy."""
        return PREFETCH_LEAD_S + self.cache.tier_seconds_per_block() * PREFETCH_LEAD_BLOCKS

    def next_prefetch_in(self) -> float | None:
        """Seconds until a paused program's load falls due (None: nothing to wait for)."""
        if self.cache.copier is None or not self.cache.tiered_tokens:
            return None
        at = self.return_times.next_due(self.prefetch_lead())
        return None if at is None else max(0.0, at - self.return_times.now())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> Schedule:
        """Choose the next step's chunks and hold the blocks they write."""
        now = self.clock()
        if self._last_schedule is not None:  # a step's length: the time between two schedules
            self._step_seconds = 0.8 * self._step_seconds + 0.2 * (now - self._last_schedule)
        self._last_schedule = now
        if self.cache.loads_in_flight():
            self.cache.settle_loads()  # copies done since the last step join the tree
        self.prefetch_due()
        out = Schedule()
        budget = self.max_batch_tokens
        plan: list[tuple[Req, int]] = []
        prefilling: list[Req] = []
        for req in self.running:  # decodes first: one token each, never starved
            if req.awaits_last_token:
                continue
            n = len(req.tokens) - req.num_computed
            if n > 1:  # still prefilling (see Req.is_prefilling)
                prefilling.append(req)
            else:
                plan.append((req, n))
                budget -= n
        for req in prefilling:  # then prompts still prefilling, oldest first
            if budget > 0:
                plan.append((req, self._chunk_len(req, budget)))
                budget -= plan[-1][1]
        plan = self._secure_blocks(plan, out)
        drafts = self._draft(plan, budget) if self.drafter is not None else {}
        budget -= sum(map(len, drafts.values()))
        if budget > 0 and self.waiting:
            self._admit(plan, budget, out)
        out.chunks = [
            Chunk(req, req.num_computed, req.num_computed + n, drafts.get(req, []))
            for req, n in plan
        ]
        if out.chunks:
            self.counters.steps += 1
            self.new_token_ratio = max(
                MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
            )
        return out

    def commit(self, chunk: Chunk) -> None:
        """The chunk's KV is now in the request's blocks."""
        req, start, end = chunk.req, chunk.start, chunk.end
        assert req.num_computed == start, "chunks must be committed in order"
        req.num_computed = end
        high, prompt_len = req.high_water, len(req.prompt_ids)
        if start < high or start < prompt_len:  # not a plain decode past everything before
            counters = self.counters
            # Positions below the high-water mark were computed before a retraction.
            counters.recomputed_tokens += max(0, min(end, high) - start)
            counters.prompt_tokens_computed += max(0, min(end, prompt_len) - max(start, high))
        if end > high:
            req.high_water = end
        self._serve(req, end - start)
        if (start < prompt_len or end - start > 1) and not _has_released(req):
            self._cache_progress(req)
        if self.sliding_window is not None:
            self._release_dead_blocks(req, self.sliding_window)

    def commit_draft(self, req: Req) -> None:
        """One more of ``req``'s tokens is computed: the draft token after its last computed
        one, which verification accepted (its KV was written by the step's forward)."""
        req.num_computed += 1
        if req.num_computed > req.high_water:
            req.high_water = req.num_computed
        self._serve(req, 1)
        if self.sliding_window is not None:
            self._release_dead_blocks(req, self.sliding_window)

    def drop_draft_blocks(self, req: Req) -> None:
        """After verification: give back the blocks ``req`` took for draft tokens it did not
        keep (beyond its computed tokens and the one it computes next)."""
        keep = blocks_for(req.num_computed + 1, self.block_size)
        if len(req.blocks) > keep:
            self.pool.decref(req.blocks[keep:])
            del req.blocks[keep:]

    def finish(self, req: Req, reason: FinishReason, cache_kv: bool = True) -> None:
        """Release everything ``req`` holds; its computed KV stays in the cache (retained
        for its program's next call when it asked: ``retain_s``)."""
        if req.status is ReqStatus.RUNNING:
            keep = req.retain_s > 0 and cache_kv and req.num_computed and not _has_released(req)
            path = req.tokens[: req.num_computed] if keep else None
            self._release(req, cache_kv)
            self.running.remove(req)
            if path is not None and reason in (FinishReason.STOP, FinishReason.LENGTH):
                try:
                    handle = self.cache.handle_of(path, req.cache_salt)
                except KeyError:  # not all of it was cached: nothing whole to keep
                    handle = None
                if handle is not None:
                    self.return_times.paused(req.program)
                    expected = self.return_times.expected_return(req.program)
                    self.cache.retain(handle, req.program, req.retain_s, expected)
        elif req.status is ReqStatus.WAITING:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason

    def retract(self, req: Req) -> None:
        """Send a running request back to the queue; its KV stays in the cache for the re-run
        (with swap preemption: in the host tier, its device blocks freed at once)."""
        computed = req.tokens[: req.num_computed]
        self._release(req, cache_kv=True)
        if self.preemption is Preemption.SWAP:
            self.counters.swapped_out_blocks += len(self.cache.swap_out(computed, req.cache_salt))
        self.running.remove(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.waiting.insert(0, req)
        self.counters.retractions += 1
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    # ---- memory --------------------------------------------------------------------------
    def _secure_blocks(self, plan: list[tuple[Req, int]], out: Schedule) -> list[tuple[Req, int]]:
        """Allocate the blocks ``plan`` writes; evict, then retract, when the pool is short."""
        while True:
            short = self._short_of_blocks(plan)  # most decodes need no new block
            need = sum(k for _, k in short)
            if need > self.pool.num_free:
                self.cache.evict(need - self.pool.num_free)
            if need <= self.pool.num_free:
                break
            if len(self.running) == 1:  # alone, with everything else evictable: it outgrew
                (req,) = self.running  # the whole pool
                if self._unpin_stale_blocks(req):
                    continue
                if self.cache.loads_in_flight():  # a background load holds blocks: it joins
                    self.cache.settle_loads(wait=True)  # the tree, evictable, and is evicted
                    continue
                self.finish(req, FinishReason.LENGTH)
                out.finished.append(req)
                plan = []
                continue
            victim = self._retract_victim()
            self.retract(victim)
            plan = [(r, n) for r, n in plan if r is not victim]
        failed = []
        for req, k in short:
            try:
                req.blocks += self.pool.alloc(k)  # all k or none
            except OutOfBlocksError:  # the pool failed us after all: this request waits
                failed.append(req)
        for req in failed:  # its KV stays in the cache; it is admitted again when there is room
            self.retract(req)
        return [(r, n) for r, n in plan if r not in failed] if failed else plan

    def _draft(self, plan: list[tuple[Req, int]], budget: int) -> dict[Req, list[int]]:
        """The drafts of the planned decodes, with the blocks they write: taken from the free
        blocks only (a draft never evicts a cached prefix or retracts a request), a draft cut
        to the slots its request holds where the pool has too few."""
        assert self.drafter is not None
        if any(req.num_computed < len(req.prompt_ids) for req, _ in plan):
            # A step that computes a prompt takes no drafts: they would take its token budget
            # from the prompt, and the cost rule knows decode steps only (measured: drafts
            # beside new turns' prompts made multi-turn chat 2-5% slower).
            return {}
        decodes = [req for req, n in plan if n == 1]
        if not decodes:
            return {}
        bs = self.block_size
        drafts = {}
        closed = not self.waiting  # nothing to admit when a request ends sooner
        for req, draft in self.drafter.plan(decodes, budget, closed).items():
            need = blocks_for(req.num_computed + 1 + len(draft), bs) - len(req.blocks)
            if need > 0:
                if need <= self.pool.num_free:
                    req.blocks += self.pool.alloc(need)
                else:
                    draft = draft[: len(req.blocks) * bs - req.num_computed - 1]
            if draft:
                drafts[req] = draft
        return drafts

    def _unpin_stale_blocks(self, req: Req) -> bool:
        """Free the cached blocks that only ``req``'s locked path pins; whether any were.

        Where a path's nodes end inside a block, each request that went on from there wrote
        into its own copy of that block: an ancestor's copy stays in the tree beside the copy
        the path goes on with, pinned by the lock although ``req`` never reads it. Alone in
        the pool, ``req`` unlocks its path, everything evictable goes (those copies with it;
        blocks ``req`` holds stay) and its computed KV goes back into the cache, locked."""
        if req.handle is None or not req.num_computed or _has_released(req):
            return False
        free = self.pool.num_free
        self.cache.unlock(req.handle)
        req.handle = None
        self.cache.evict(self.pool.num_blocks)
        self._cache_progress(req)
        return self.pool.num_free > free

    def _short_of_blocks(self, plan: list[tuple[Req, int]]) -> list[tuple[Req, int]]:
        """``(request, blocks it still needs)`` for the planned requests that need any."""
        bs = self.block_size
        short = []
        for req, n in plan:
            k = -(-(req.num_computed + n) // bs) - len(req.blocks)
            if k > 0:
                short.append((req, k))
        return short

    def _retract_victim(self) -> Req:
        """The running request that loses least: fewest generated tokens, then newest. Beams
        come last: losing one makes its whole search start over (runtime/beam_search.py)."""
        return min(self.running, key=lambda r: (r.beam is not None, r.num_output, -r.arrival))

    def _reserve_blocks(self) -> int:
        """Blocks the running requests are expected to need for their remaining tokens."""
        # Under a sliding window a request's growth releases as many blocks as it takes once
        # the window is full: it needs at most a window's worth more.
        cap = math.inf if self.sliding_window is None else self.sliding_window
        tokens = sum(
            min(cap, max(0, r.output_limit - r.num_output) * self.new_token_ratio)
            for r in self.running
        )
        return math.ceil(tokens / self.block_size)

    def _release(self, req: Req, cache_kv: bool) -> None:
        released = _has_released(req)
        # A request that released blocks has lost its sequence's start (releases begin at
        # block 0), so nothing of it can be inserted: what its prompt put in the cache while
        # whole stays there, and a retracted one recomputes from that.
        if cache_kv and req.num_computed and not released:
            self.cache.insert(req.tokens[: req.num_computed], req.blocks, req.cache_salt)
        if req.handle is not None:
            self.cache.unlock(req.handle)
        self.pool.decref([b for b in req.blocks if b != RELEASED] if released else req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.handle = None
        req.boundary_scores = None

    def _cache_progress(self, req: Req) -> None:
        """Put the computed part of ``req`` into the cache and lock it instead of the old path."""
        key = req.tokens[: req.num_computed]
        self.cache.insert(key, req.blocks, req.cache_salt)
        handle = self.cache.handle_of(key, req.cache_salt)
        self.cache.lock(handle)
        if req.handle is not None:
            self.cache.unlock(req.handle)
        req.handle = handle

    def _release_dead_blocks(self, req: Req, window: int) -> None:
        """Drop ``req``'s references to the blocks wholly before its next query's window.

        Their table entries become ``RELEASED`` (indices stay aligned with positions). At the
        first release the request also unlocks its cache path and stops caching its progress:
        the path's blocks are then ordinary cached prefixes, evictable, and the request keeps
        only the root's handle (locking it protects nothing).
        """
        blocks = req.blocks
        i = min(len(blocks), dead_blocks(req.num_computed, window, self.block_size))
        dropped = []
        while i > 0 and blocks[i - 1] != RELEASED:  # the newly dead ones, back to the last
            i -= 1
            dropped.append(blocks[i])
            blocks[i] = RELEASED
        if not dropped:
            return
        if i == 0:  # the first release
            if req.handle is not None:
                self.cache.unlock(req.handle)
            req.handle = self.cache.handle_of([], req.cache_salt)
        self.pool.decref(dropped)

    # ---- admission -----------------------------------------------------------------------
    def _admit(self, plan: list[tuple[Req, int]], budget: int, out: Schedule) -> None:
        inflight = [r for r in self.running if r.is_prefilling]
        bs = self.block_size
        for req in self._ordered_waiting():
            if budget <= 0 or len(self.running) >= self.max_running_requests:
                break
            if req.tokens[-1] < 0:  # retracted with a token still being sampled: next step
                continue
            key = req.tokens[: req.reuse_limit()]
            load = self._load_ahead(req, key, budget) if self.running else "admit"
            if load == "wait":
                continue  # its prefix is being copied in beside this step's forward: next step
            if load == "full":
                break  # as for any request that does not fit: running ones free blocks first
            cached = self.cache.peek_prefix_len(key, req.cache_salt)
            if self._shares_uncached_prefix(req, cached, inflight):
                continue  # a prompt being computed holds its next tokens: hit them next step
            match, start, n, partial, need = self._match_for_admission(req, key, budget)
            available = self.pool.num_free + self.cache.evictable_size()
            if need > available and not self.running:
                # Nothing running will free a block, so the matched prefix itself is in the way:
                # the copies of blocks its nodes end inside, or of its own partly shared last
                # block. Start from an empty cache, or the request would wait forever.
                self.cache.unlock(match.handle)
                self.cache.evict(self.pool.num_blocks)
                match, start, n, partial, need = self._match_for_admission(req, key, budget)
                available = self.pool.num_free + self.cache.evictable_size()
                if need > available and blocks_for(len(req.tokens), bs) > self.pool.num_blocks:
                    # Retracted after its sequence outgrew the pool: it ends, as it would have
                    # running alone.
                    self.cache.unlock(match.handle)
                    self.finish(req, FinishReason.LENGTH)
                    out.finished.append(req)
                    continue
            if (self.running and need + self._reserve_blocks() > available) or need > available:
                self.cache.unlock(match.handle)
                break
            if need > self.pool.num_free:
                self.cache.evict(need - self.pool.num_free)
            if need > self.pool.num_free:  # evictable blocks still shared elsewhere
                self.cache.unlock(match.handle)
                break
            try:
                blocks = self._take_blocks(match.blocks, partial, blocks_for(start + n, bs))
            except OutOfBlocksError:  # the pool failed us after all: it holds nothing new
                self.cache.unlock(match.handle)
                break
            req.blocks, req.num_computed, req.handle = blocks, start, match.handle
            self.waiting.remove(req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            if not req.admitted:
                req.admitted = True
                req.cached_tokens = min(start, req.prompt_len)
                self.counters.prompt_tokens += req.prompt_len
                self.counters.prompt_tokens_reused += req.cached_tokens
            if n == 0:  # a prefill-only prompt, all cached
                self.finish(req, FinishReason.LENGTH)
                out.finished.append(req)
                continue
            plan.append((req, n))
            budget -= n
            if req.is_prefilling:
                inflight.append(req)

    def _load_ahead(self, req: Req, key: list[int], budget: int) -> str:
        """How admission treats ``req``'s tiered prefix, while other requests run:
        ``"admit"`` (nothing of it in the tier), ``"wait"`` (a background load of it is
        copying, or was started now with the room admission would use: plain cached prefixes,
        then retained paths, less running requests' growth; the copy runs beside this step's
        forward instead of inside admission, where the whole batch would wait for it) or
        ``"full"`` (no room for it and the chunk it would compute next: loading it now would
        only evict what running requests will need, and be evicted again before it is used)."""
        cache = self.cache
        if cache.copier is None or not cache.tiered_tokens:
            return "admit"
        load = cache.tier_load(key, req.cache_salt)
        if load.pending:
            return "wait"
        if not load.tiered:
            return "admit"
        room = max(0, cache.evictable_size() - self._reserve_blocks())
        chunk = self._chunk_len(req, budget, load.length)
        if load.tiered + blocks_for(chunk, self.block_size) + 1 > self.pool.num_free + room:
            return "full"
        # A request that is here outranks a predicted return: spare no retained path.
        if cache.prefetch_prefix(key, req.cache_salt, req.program, room):
            return "wait"
        return "full"

    def _match_for_admission(
        self, req: Req, key: list[int], budget: int
    ) -> tuple[MatchResult, int, int, int, int]:
        """``req``'s cached prefix, locked: ``(match, start, n, partial, need)``, with ``n``
        tokens to compute from ``start``, ``partial`` slots of its last block shared (copied on
        write) and ``need`` blocks to take from the pool."""
        bs = self.block_size
        match = self.cache.match_prefix(key, req.cache_salt)
        self.counters.tier_loaded_tokens += match.loaded
        self.cache.lock(match.handle)
        start = match.length
        n = self._chunk_len(req, budget, start)
        partial = start % bs if n else 0
        need = blocks_for(start + n, bs) - len(match.blocks) + bool(partial)
        return match, start, n, partial, need

    def _take_blocks(self, cached: list[int], partial: int, total: int) -> list[int]:
        """A new request's block table: a reference to each ``cached`` block (the last copied
        on write when only its first ``partial`` slots are the request's), then fresh blocks up
        to ``total``. All or nothing: on ``OutOfBlocksError`` it holds no new reference."""
        fresh = self.pool.alloc(total - len(cached))
        self.pool.incref(cached)
        blocks = list(cached)
        if partial:
            try:
                blocks[-1] = self.pool.copy_on_write(blocks[-1], partial)
            except OutOfBlocksError:
                self.pool.decref(cached + fresh)
                raise
        return blocks + fresh

    def _chunk_len(self, req: Req, budget: int, start: int | None = None) -> int:
        start = req.num_computed if start is None else start
        n = min(len(req.tokens) - start, budget)
        if req.wants_prompt_logprobs:
            n = min(n, MAX_LOGPROB_CHUNK)
        if self.sliding_window is not None:
            # Chunks of at most a window: with the window before it, a chunk then needs at most
            # two windows of blocks however long the prompt, which the engine checks fit.
            n = min(n, self.sliding_window)
        return n

    def _shares_uncached_prefix(self, req: Req, cached: int, inflight: list[Req]) -> bool:
        need = cached + self.defer_min_shared_tokens
        return any(
            other.cache_salt == req.cache_salt  # only requests of one salt share a prefix
            and len(other.tokens) >= need
            and common_prefix_len(req.tokens[:need], other.tokens[:need]) >= need
            for other in inflight
        )

    def _ordered_waiting(self) -> list[Req]:
        waiting = self.waiting
        if self.policy is SchedulePolicy.FCFS or len(waiting) > MAX_PREFIX_ORDERED:
            return sorted(waiting, key=lambda r: r.arrival)
        if self.policy is SchedulePolicy.PROGRAM:
            return self._least_served_first(waiting)
        if self.policy is SchedulePolicy.LPM:
            cached = {
                id(r): self.cache.peek_prefix_len(r.tokens[: r.reuse_limit()], r.cache_salt)
                for r in waiting
            }
            return sorted(waiting, key=lambda r: (-cached[id(r)], r.arrival))
        return dfs_weight_order(waiting)

    def _least_served_first(self, waiting: list[Req]) -> list[Req]:
        """Requests that waited STARVATION_S first (oldest first), then by their program's
        attained service (tokens computed for it so far), then longest cached prefix."""
        now = self.clock()
        service = self.service

        def order(r: Req) -> tuple[bool, float, int, float]:
            starved = now - r.arrival > STARVATION_S
            if starved:
                return (False, 0.0, 0, r.arrival)
            cached = self.cache.peek_prefix_len(r.tokens[: r.reuse_limit()], r.cache_salt)
            return (True, service.get(r.program, 0), -cached, r.arrival)

        return sorted(waiting, key=order)

    def _serve(self, req: Req, tokens: int) -> None:
        """Count ``tokens`` computed for ``req``'s program (its attained service)."""
        service = self.service
        service[req.program] = service.pop(req.program, 0) + tokens  # most recent last
        if len(service) > MAX_PROGRAMS_SERVED:  # forget the programs not seen for longest
            for key in list(service)[: len(service) // 2]:
                del service[key]

    # ---- invariants ----------------------------------------------------------------------
    def external_refs(self) -> Counter[int]:
        """Pool references held by running requests (everything outside the cache)."""
        refs: Counter[int] = Counter()
        for req in self.running:
            refs.update(req.blocks)
        refs.pop(RELEASED, None)  # released entries hold no reference
        return refs

    def check_integrity(self) -> None:
        """The pool, the cache and the requests agree; raises ``IntegrityError`` otherwise."""
        for req in self.running:
            if req.status is not ReqStatus.RUNNING:
                raise IntegrityError(f"request {req.rid} in the running list is {req.status}")
            if len(req.blocks) < blocks_for(req.num_computed, self.block_size):
                raise IntegrityError(f"request {req.rid}: blocks do not cover its computed KV")
            if req.handle is None or not req.handle.valid:
                raise IntegrityError(f"request {req.rid} holds no valid locked cache path")
        for req in self.waiting:
            if req.blocks or req.handle is not None:
                raise IntegrityError(f"waiting request {req.rid} still holds blocks or a lock")
        self.cache.check_integrity(self.external_refs())
        # Background loads hold their paths locked until committed (tier_prefetch.py).
        if not self.running and self.cache.protected_size() and not self.cache.loads_in_flight():
            raise IntegrityError("cache paths stay locked with no request running")

    def reset_counters(self) -> None:
        """Zero the cumulative counters (steps, prompt tokens, retractions, evictions)."""
        self.counters = SchedulerCounters()
        self._evicted_base = self.cache.evicted_blocks_total

    def stats(self) -> dict[str, float | int]:
        """The queues and the pool now, and the counters since start or the last reset."""
        c = self.counters
        return {
            "running_requests": len(self.running),
            "waiting_requests": len(self.waiting),
            "blocks_total": self.pool.num_blocks,
            "blocks_free": self.pool.num_free,
            "blocks_used": self.pool.num_used,
            "blocks_evictable": self.cache.evictable_size(),
            "cached_tokens": self.cache.cached_tokens,
            "prompt_tokens": c.prompt_tokens,
            "prompt_tokens_reused": c.prompt_tokens_reused,
            "prompt_tokens_computed": c.prompt_tokens_computed,
            "recomputed_tokens": c.recomputed_tokens,
            "tier_loaded_tokens": c.tier_loaded_tokens,
            "swapped_out_blocks": c.swapped_out_blocks,
            "cache_hit_rate": c.prompt_tokens_reused / c.prompt_tokens if c.prompt_tokens else 0.0,
            "retractions": c.retractions,
            "evicted_blocks": self.cache.evicted_blocks_total - self._evicted_base,
            "steps": c.steps,
        }


def _has_released(req: Req) -> bool:
    """Whether ``req`` released blocks before its window (releases start at block 0)."""
    return bool(req.blocks) and req.blocks[0] == RELEASED


def dfs_weight_order(reqs: Sequence[Req]) -> list[Req]:
    """Depth-first over the trie of the requests' tokens, the subtree with most requests first.

    Requests that share a prefix come out next to each other, so the one admitted first computes
    it and the others follow while it is cached. Requests of different cache salts never share
    a prefix: each salt is its own trie, the salt with most requests first.
    """
    by_salt: dict[str, list[Req]] = {}
    for req in reqs:
        by_salt.setdefault(req.cache_salt, []).append(req)
    if len(by_salt) == 1:
        return _dfs_weight_order(reqs)
    groups = sorted(by_salt.values(), key=lambda g: (-len(g), min(r.arrival for r in g)))
    return [req for group in groups for req in _dfs_weight_order(group)]


def _dfs_weight_order(reqs: Sequence[Req]) -> list[Req]:
    """``dfs_weight_order`` for requests of one salt. Works on the lexicographically sorted
    token lists, where every subtree is a contiguous run."""
    ordered = sorted(reqs, key=lambda r: (r.tokens, r.arrival))
    result: list[Req] = []
    stack: list[tuple[int, int, int]] = [(0, len(ordered), 0)]  # [lo, hi) share `depth` tokens
    while stack:
        lo, hi, depth = stack.pop()
        if hi - lo == 1:
            result.append(ordered[lo])
            continue
        depth = max(depth, common_prefix_len(ordered[lo].tokens, ordered[hi - 1].tokens))
        groups: list[tuple[int, int]] = []
        i = lo
        while i < hi:  # the requests that end here, then one run per next token
            tokens = ordered[i].tokens
            key = tokens[depth] if depth < len(tokens) else None
            j = i + 1
            while j < hi:
                other = ordered[j].tokens
                if (other[depth] if depth < len(other) else None) != key:
                    break
                j += 1
            groups.append((i, j))
            i = j
        if len(groups) == 1:  # all identical up to their ends: arrival order
            result.extend(sorted(ordered[lo:hi], key=lambda r: r.arrival))
            continue
        groups.sort(key=lambda g: g[1] - g[0])  # popped last = largest first
        stack.extend((a, b, depth + 1) for a, b in groups)
    return result
