"""A stand-in for KV storage in cache tests: slots hold values instead of tensors.

The value written at position p of a sequence is the tuple of its first p + 1 tokens, which is
what a real KV entry depends on; a read that returns anything else found stale or foreign data.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.radix_cache import CacheHandle, RadixCache


class SlotStore:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[list[object]] = [[None] * block_size for _ in range(num_blocks)]
        self.copies: list[tuple[int, int, int]] = []

    def copy(self, src: int, dst: int, num_slots: int) -> None:
        self.copies.append((src, dst, num_slots))
        self.slots[dst][:num_slots] = self.slots[src][:num_slots]

    def write(self, tokens: Sequence[int], blocks: Sequence[int], start: int) -> None:
        bs = self.block_size
        for p in range(start, len(tokens)):
            self.slots[blocks[p // bs]][p % bs] = tuple(tokens[: p + 1])

    def read_ok(self, tokens: Sequence[int], blocks: Sequence[int], length: int) -> bool:
        bs = self.block_size
        return all(
            self.slots[blocks[p // bs]][p % bs] == tuple(tokens[: p + 1]) for p in range(length)
        )


@dataclass
class Served:
    """A simulated request: the block table it holds references to, and its locked handle."""

    tokens: list[int]
    blocks: list[int]
    cached: int
    handle: CacheHandle | None
    salt: str = ""


def serve(cache: RadixCache, store: SlotStore, tokens: Sequence[int], salt: str = "") -> Served:
    """Reuse the cached prefix, copy its partial block on write, compute the rest, insert.

    Returns with the request still holding its blocks and its whole path locked; call release().
    Raises OutOfBlocksError (holding nothing) when the pool cannot fit the uncached suffix.
    """
    pool: BlockPool = cache.pool
    tokens = list(tokens)
    m = cache.match_prefix(tokens, salt)
    cache.lock(m.handle)
    pool.incref(m.blocks)
    blocks = list(m.blocks)
    try:
        if m.length % pool.block_size:
            blocks[-1] = pool.copy_on_write(blocks[-1], m.length % pool.block_size)
        blocks += pool.alloc(pool.blocks_for_tokens(len(tokens)) - len(blocks))
    except BaseException:
        pool.decref(blocks)
        cache.unlock(m.handle)
        raise
    store.write(tokens, blocks, m.length)
    cache.insert(tokens, blocks, salt)
    # Like a request that keeps running after its prefill is cached: lock the whole path now.
    full = cache.match_prefix(tokens, salt)
    cache.lock(full.handle)
    cache.unlock(m.handle)
    return Served(tokens, blocks, m.length, full.handle, salt)


def release(cache: RadixCache, served: Served) -> None:
    if served.handle is not None:
        cache.unlock(served.handle)
        served.handle = None
    cache.pool.decref(served.blocks)
    served.blocks = []


class SlotTier:
    """A host tier for :class:`SlotStore`: its own pool of blocks, copied whole both ways."""

    def __init__(self, store: SlotStore, num_blocks: int) -> None:
        self.store = store
        self.pool = BlockPool(num_blocks, store.block_size)
        self.slots: list[list[object]] = [[None] * store.block_size for _ in range(num_blocks)]
        self.writes = 0
        self.reads = 0

    def write(self, device_blocks: Sequence[int], host_blocks: Sequence[int]) -> None:
        assert len(device_blocks) == len(host_blocks)
        for d, h in zip(device_blocks, host_blocks, strict=True):
            assert self.pool.refcount(h) > 0, "write into a free tier block"
            self.slots[h] = list(self.store.slots[d])
        self.writes += len(host_blocks)

    def read(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        assert len(device_blocks) == len(host_blocks)
        for h, d in zip(host_blocks, device_blocks, strict=True):
            assert self.pool.refcount(h) > 0, "read from a free tier block"
            self.store.slots[d] = list(self.slots[h])
        self.reads += len(host_blocks)


class KvEventMirror:
    """A router's view of a cache, kept from its KV events alone: after each step it must
    match the cache on every prefix (to the block) and hold exactly the cache's blocks, each
    on the medium the cache has it on (device or host tier)."""

    def __init__(self, cache) -> None:
        from radixlang.cluster.prefix_index import PrefixIndex

        self.cache = cache
        self.log = cache.enable_kv_events()
        self.index = PrefixIndex()
        self.seen = 0

    def check(self, queries) -> None:
        """``queries``: (salt, tokens) pairs to compare the view and the cache on."""
        from radixlang.runtime.kv_events import block_hashes

        events, gap = self.log.since(self.seen)
        assert not gap
        for event in events:
            assert event.seq == self.seen + 1, "KV events out of order"
            self.index.apply(event)
            self.seen = event.seq
        snapshot = {h for _, hashes in self.cache.block_hashes() for h in hashes}
        assert set(self.index._stored) == snapshot, "the view holds blocks the cache does not"
        media = {h: m for _, hashes, m in self.cache.block_media() for h in hashes}
        assert self.index._stored == media, "the view has blocks on the wrong medium"
        bs = self.cache.block_size
        for salt, tokens in queries:
            cached = self.cache.peek_prefix_len(list(tokens), salt) // bs
            assert self.index.match(block_hashes(list(tokens), bs, salt)) == cached


class DeferredFuture(concurrent.futures.Future):
    """A copy that runs when a rule says so, or when someone waits for it."""

    def __init__(self, fn) -> None:
        super().__init__()
        self._fn = fn

    def run(self) -> None:
        if not self.done():
            self._fn()
            self.set_result(None)

    def result(self, timeout=None):
        self.run()
        return super().result(timeout)


class DeferredCopier:
    """A ``TierCopier`` whose copies run only when :meth:`run_all` is called (or a commit
    waits for one): the cache must keep both sides of a copy intact until it has run."""

    def __init__(self) -> None:
        self.pending: list[DeferredFuture] = []

    def submit(self, fn) -> DeferredFuture:
        future = DeferredFuture(fn)
        self.pending.append(future)
        return future

    def run_all(self) -> None:
        while self.pending:
            self.pending.pop(0).run()

    def close(self) -> None:
        self.run_all()
