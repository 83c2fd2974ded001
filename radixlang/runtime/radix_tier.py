"""The radix cache's host tier: what eviction does with a node when there is a tier, and
how a match or an insert brings tiered nodes back to the device.

Demoting copies a device leaf's KV into the tier's blocks (the same layout rule, by block
index, in the tier's own pool) and frees its device blocks; the node stays in the tree,
*tiered*. Loading copies a tiered path's blocks into fresh device blocks (evicting others for
room); an insert whose path crosses tiered nodes gives them the writer's blocks instead. The
tier has its own LRU over tiered leaves, and drops the oldest for good when it is full.

``TierMoves`` is a mixin of ``RadixCache``: its methods keep the cache's counters and
eviction heaps as the tree's own operations do.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Protocol

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.radix_node import CacheHandle, RadixNode


class TierStore(Protocol):
    """Where evicted KV goes: a pool of host blocks and the copies between the two pools.

    Blocks are copied whole: a host block holds what its device block held, slot for slot.
    """

    pool: BlockPool

    def write(self, device_blocks: Sequence[int], host_blocks: Sequence[int]) -> None:
        """Copy device blocks into host blocks (pairwise)."""

    def read(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Copy host blocks into device blocks (pairwise)."""


class TierMoves:
    """The host tier's half of ``RadixCache`` (see the module's docstring)."""

    tier: TierStore | None
    pool: BlockPool
    block_size: int
    _drop_retentions: Callable[[RadixNode], None]
    tier_loaded_blocks_total: int
    tier_sync_loaded_blocks_total: int

    def _demote(self, node: RadixNode) -> list[int]:
        """Evict a device leaf into the tier (or drop it, with its tiered subtree, when the tier
        cannot take it); returns the device blocks that became free."""
        tier = self.tier
        assert tier is not None and node.lock_ref == 0 and not node.tiered
        need = len(node.blocks)
        if tier.pool.num_free < need:
            self._evict_tier(need - tier.pool.num_free)
        if tier.pool.num_free < need:  # larger than the whole tier
            for child in list(node.children.values()):
                self._drop_tiered_subtree(child)
            return self._remove_leaf(node)
        host = tier.pool.alloc(need)
        tier.write(node.blocks, host)
        self._candidates.pop(node, None)
        self._evictable_blocks -= node.own_blocks
        node.own_blocks = 0
        self._cached_tokens -= len(node.tokens)
        self._tiered_tokens += len(node.tokens)
        freed = self.pool.decref(node.blocks)
        node.blocks, node.host_blocks = [], host
        self._announce_move(node)
        self.tier_written_blocks_total += need
        self._refresh_candidate(node)
        assert node.parent is not None
        self._refresh_candidate(node.parent)
        return freed

    def _load(self, path: list[RadixNode]) -> tuple[list[RadixNode], int]:
        """Load the tiered end of ``path`` back into device blocks, as many of its nodes as the
        pool can take (evicting others for room); returns the device path and tokens loaded."""
        tier = self.tier
        assert tier is not None
        split = next(i for i, node in enumerate(path) if node.tiered)
        tiered = path[split:]
        # Hold the whole path: eviction for room must touch neither its device part nor, in the
        # tier, its tiered part.
        hold = CacheHandle(path[-1])
        self.lock(hold)
        try:
            wanted = list(dict.fromkeys(b for node in tiered for b in node.host_blocks))
            if len(wanted) > self.pool.num_free:
                self.evict(len(wanted) - self.pool.num_free)
            fit, seen = 0, set()  # the longest run of nodes whose blocks fit
            for node in tiered:
                fresh = {b for b in node.host_blocks if b not in seen}
                if len(seen) + len(fresh) > self.pool.num_free:
                    break
                seen |= fresh
                fit += 1
            loading = tiered[:fit]
            host = [b for b in wanted if b in seen]
            device = self.pool.alloc(len(host))
            tier.read(host, device)
            self.tier_loaded_blocks_total += len(host)
            self.tier_sync_loaded_blocks_total += len(host)
            to_device = dict(zip(host, device, strict=True))
            loaded = 0
            for node in loading:
                blocks = [to_device[b] for b in node.host_blocks]
                parent = node.parent
                assert parent is not None
                if node.start % self.block_size and parent.blocks[-1:] == blocks[:1]:
                    # A cut block shared with the parent in the tier is shared on the device too.
                    self.pool.incref(blocks[:1])
                self._to_device(node, blocks)
                loaded += len(node.tokens)
        finally:
            self.unlock(hold)
        self.tier_loaded_tokens_total += loaded
        return path[: split + fit], loaded

    def _adopt(self, node: RadixNode, blocks: Sequence[int]) -> None:
        """A tiered node on an inserting writer's path takes the writer's blocks (the same KV)."""
        first, last = node.start // self.block_size, (node.end - 1) // self.block_size
        device = list(blocks[first : last + 1])
        self.pool.incref(device)
        self._to_device(node, device)

    def _to_device(self, node: RadixNode, blocks: list[int]) -> None:
        """Make a tiered node a device node holding ``blocks`` (one reference each, already
        taken); its tier blocks are released. Its parent must be a device node."""
        tier = self.tier
        assert tier is not None and node.tiered
        self._tier_candidates.pop(node, None)
        tier.pool.decref(node.host_blocks)
        node.host_blocks, node.blocks = [], blocks
        self._announce_move(node)
        node.own_blocks = self._count_own_blocks(node)
        if node.lock_ref:
            self._protected_blocks += node.own_blocks
        else:
            self._evictable_blocks += node.own_blocks
        self._cached_tokens += len(node.tokens)
        self._tiered_tokens -= len(node.tokens)
        self._refresh_candidate(node)
        assert node.parent is not None
        self._refresh_candidate(node.parent)

    def _evict_tier(self, num_blocks: int) -> int:
        """Drop the tier's least recently used leaves until ``num_blocks`` of its blocks are
        free; returns how many were freed."""
        assert self.tier is not None
        freed = 0
        while freed < num_blocks and self._tier_heap:
            stamp, _, node = heapq.heappop(self._tier_heap)
            if self._tier_candidates.get(node) != stamp:
                continue
            freed += self._drop_tiered_leaf(node)
        return freed

    def _drop_tiered_leaf(self, node: RadixNode) -> int:
        assert self.tier is not None and node.tiered and not node.children and not node.lock_ref
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[0]]
        if parent.parent is None:
            self._drop_root_if_empty(parent)
        self._tier_candidates.pop(node, None)
        node.evicted = True
        if node.retained_until:  # a retained path the tier could not keep
            self._drop_retentions(node)
        self._num_nodes -= 1
        self._tiered_tokens -= len(node.tokens)
        self.tier_dropped_tokens_total += len(node.tokens)
        freed = len(self.tier.pool.decref(node.host_blocks))
        self._announce_removal(node)
        self._refresh_candidate(parent)
        return freed

    def _drop_tiered_subtree(self, node: RadixNode) -> None:
        for child in list(node.children.values()):
            self._drop_tiered_subtree(child)
        self._drop_tiered_leaf(node)
