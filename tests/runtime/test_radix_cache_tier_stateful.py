"""Random programs of cache operations on a radix cache with a host tier.

Eviction moves KV into the tier instead of dropping it, matches load it back, inserts adopt
tiered nodes, ``swap_out`` moves a finished request's path at once, and a full tier drops its
least recently used leaves. The simulated KV (each slot holds the prefix it belongs to) checks
that every block a match returns, loaded or not, holds exactly that prefix's KV, and that no load
or eviction overwrote blocks a request holds. After every step both pools' reference counts are
checked exactly (``check_integrity``). With a tier large enough never to drop anything, nothing
inserted is ever lost: every inserted prefix stays matchable.
"""

from __future__ import annotations

import os
import time
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_sim import DeferredCopier, KvEventMirror, Served, SlotStore, SlotTier, release, serve

from radixlang.runtime.block_pool import BlockPool, OutOfBlocksError
from radixlang.runtime.radix_cache import CacheInUseError, RadixCache

token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=14)
# Cache salts: prefixes inserted under one never match under another.
salts = st.sampled_from(["", "", "s"])


class TierMachine(RuleBasedStateMachine):
    block_size = 4
    num_blocks = 16
    tier_blocks = 400  # never full: nothing is dropped

    def __init__(self) -> None:
        super().__init__()
        self.store = SlotStore(self.num_blocks, self.block_size)
        self.pool = BlockPool(self.num_blocks, self.block_size, copy_hook=self.store.copy)
        self.tier = SlotTier(self.store, self.tier_blocks)
        self.cache = RadixCache(self.pool, self.tier)
        # Background loads whose copies run only when a rule says so (or a match waits).
        self.copier = DeferredCopier()
        self.cache.copier = self.copier
        self.requests: list[Served] = []
        self.inserted: set[tuple[str, tuple[int, ...]]] = {("", ()), ("s", ())}
        # 50 steps insert at most 50 * 14 tokens: 400 blocks never fill, so nothing is dropped.
        self.lossless = self.tier_blocks >= 400
        self.mirror = KvEventMirror(self.cache)

    def expected(self, tokens: list[int], salt: str) -> int:
        n = 0
        while n < len(tokens) and (salt, tuple(tokens[: n + 1])) in self.inserted:
            n += 1
        return n

    def checked_match(self, tokens: list[int], salt: str):
        free_before = self.pool.num_free
        m = self.cache.match_prefix(tokens, salt)
        assert m.handle.length == m.length
        assert len(m.blocks) == self.pool.blocks_for_tokens(m.length)
        assert m.length <= self.expected(tokens, salt), "matched tokens never inserted"
        assert self.store.read_ok(tokens, m.blocks, m.length), "match returned wrong KV"
        assert 0 <= m.loaded <= m.length
        if self.lossless and free_before >= self.pool.blocks_for_tokens(len(tokens)) + 1:
            assert m.length == self.expected(tokens, salt), "an inserted prefix was lost"
        return m

    @rule(tokens=token_lists, keep=st.booleans(), salt=salts)
    def run_request(self, tokens: list[int], keep: bool, salt: str) -> None:
        need = self.pool.blocks_for_tokens(len(tokens)) + 1
        if need > self.pool.num_free:
            self.cache.evict(need - self.pool.num_free)
        try:
            served = serve(self.cache, self.store, tokens, salt)
        except OutOfBlocksError:
            return
        assert self.store.read_ok(tokens, served.blocks, len(tokens))
        self.inserted.update((salt, tuple(tokens[:i])) for i in range(len(tokens) + 1))
        if keep:
            self.requests.append(served)
        else:
            release(self.cache, served)

    @rule(tokens=token_lists, salt=salts)
    def match(self, tokens: list[int], salt: str) -> None:
        self.checked_match(tokens, salt)

    @rule(tokens=token_lists, salt=salts)
    def peek(self, tokens: list[int], salt: str) -> None:
        n = self.cache.peek_prefix_len(tokens, salt)
        assert n <= self.expected(tokens, salt)
        if self.lossless:
            assert n == self.expected(tokens, salt), "an inserted prefix was lost"

    @rule(tokens=token_lists, lock=st.booleans(), salt=salts)
    def hold_prefix(self, tokens: list[int], lock: bool, salt: str) -> None:
        m = self.checked_match(tokens, salt)
        self.pool.incref(m.blocks)
        if lock:
            self.cache.lock(m.handle)
        held = m.handle if lock else None
        self.requests.append(Served(tokens[: m.length], list(m.blocks), m.length, held, salt))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 1000))
    def finish(self, i: int) -> None:
        release(self.cache, self.requests.pop(i % len(self.requests)))

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 1000))
    def preempt(self, i: int) -> None:
        """A request is released and its path swapped out to the tier at once."""
        served = self.requests.pop(i % len(self.requests))
        tokens = served.tokens
        release(self.cache, served)
        free_before = self.pool.num_free
        freed = self.cache.swap_out(tokens, served.salt)
        assert self.pool.num_free == free_before + len(freed)
        assert all(self.pool.refcount(b) == 0 for b in freed)

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 1000), key=st.sampled_from(["a", "b"]))
    def retain(self, i: int, key: str) -> None:
        """A paused program's path: demoted to the tier, not dropped, when it must go."""
        served = self.requests[i % len(self.requests)]
        if served.handle is not None:
            self.cache.retain(served.handle, key, 1000.0)

    @rule(key=st.sampled_from(["a", "b"]))
    def release_key(self, key: str) -> None:
        self.cache.release(key)

    @rule()
    def deadlines_pass(self) -> None:
        self.cache.expire_retentions(time.monotonic() + 2000)

    @rule(tokens=token_lists, salt=salts, room=st.integers(0, 8))
    def prefetch(self, tokens: list[int], salt: str, room: int) -> None:
        """A request arrives: its tiered prefix starts loading in the background."""
        started = self.cache.prefetch_prefix(tokens, salt, room=room)
        assert started == 0 or self.cache.loads_in_flight()

    @rule(key=st.sampled_from(["a", "b"]), room=st.integers(0, 8))
    def prefetch_retained(self, key: str, room: int) -> None:
        """A paused program's return nears: its retained tiered paths start loading."""
        self.cache.prefetch_retained(key, room)

    @rule(wait=st.booleans())
    def copies_finish(self, wait: bool) -> None:
        """The copy thread catches up; the engine's next step commits what finished."""
        self.copier.run_all()
        self.cache.settle_loads(wait=wait)
        assert self.cache.loads_in_flight() == 0

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        free_before = self.pool.num_free
        freed = self.cache.evict(n)
        assert len(set(freed)) == len(freed)
        assert self.pool.num_free == free_before + len(freed)

    @rule()
    def flush(self) -> None:
        try:
            self.cache.flush()
        except CacheInUseError:
            assert any(r.handle is not None and r.handle.length for r in self.requests)
            return
        assert self.cache.tiered_tokens == 0 and self.tier.pool.num_free == self.tier_blocks
        self.inserted = {("", ()), ("s", ())}

    @invariant()
    def integrity(self) -> None:
        self.cache.check_integrity(Counter(b for r in self.requests for b in r.blocks))

    @invariant()
    def nothing_dropped(self) -> None:
        if self.lossless:
            assert self.cache.tier_dropped_tokens_total == 0

    @invariant()
    def held_kv_intact(self) -> None:
        for r in self.requests:
            assert self.store.read_ok(r.tokens, r.blocks, len(r.tokens)), "held KV overwritten"

    @invariant()
    def kv_events_mirror_the_tree(self) -> None:
        self.mirror.check(self.inserted)

    def teardown(self) -> None:
        while self.requests:
            release(self.cache, self.requests.pop())
        self.cache.check_integrity({})
        self.cache.flush()
        assert self.pool.num_free == self.pool.num_blocks
        assert self.tier.pool.num_free == self.tier.pool.num_blocks


class SmallTierMachine(TierMachine):
    """A tier of a few blocks: demotions push older tiered leaves out, or cannot fit at all."""

    tier_blocks = 5


class OddBlockTierMachine(TierMachine):
    block_size = 3
    num_blocks = 20
    tier_blocks = 12


def steps(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=50, deadline=None)


TestTier = TierMachine.TestCase
# RADIXLANG_HYPOTHESIS_SCALE=20 runs twenty times as many examples (for a deep local run).
SCALE = int(os.environ.get("RADIXLANG_HYPOTHESIS_SCALE", "1"))
TestTier.settings = steps(80 * SCALE)
TestSmallTier = SmallTierMachine.TestCase
TestSmallTier.settings = steps(50 * SCALE)
TestOddBlockTier = OddBlockTierMachine.TestCase
TestOddBlockTier.settings = steps(50 * SCALE)
