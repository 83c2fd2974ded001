"""A radix tree over token ids whose nodes hold the KV blocks of their tokens.

Layout. A node covers the absolute token positions ``[start, end)`` of every sequence that
passes through it, and holds one block id for each block index its positions touch
(``start // block_size`` to ``(end - 1) // block_size``). Where a node starts inside a block,
that first block is also held by an ancestor (the same id, when one writer filled both:
usually the parent, sometimes higher up) or is a copy the child's writer made (copy-on-write).
The rule that makes reads correct: the block a node holds at index ``i`` has valid KV for every
position of block ``i`` up to the node's end, including positions of its ancestors. The block
table of a path therefore takes, for each index, the block of the deepest node that touches
it.

Ownership. The tree holds one pool reference per (node, block). ``insert`` adds the tree's own
references and never takes the caller's: the caller drops its references when it is done, and
whatever the tree did not adopt (a duplicate of a prefix already cached) is freed then. Blocks
returned by ``match_prefix`` are not referenced for the caller; a caller that keeps them increfs
them, and locks the handle so that eviction leaves the path alone.

Eviction. Unlocked leaves are kept in a heap keyed by last access (a logical clock), with lazy
deletion: an entry is live while its stamp equals the node's current one. Evicting a leaf costs
O(log leaves); its parent becomes a candidate when it turns into an unlocked leaf.

The host tier (optional, :class:`TierStore`). With one, eviction does not drop a node: its KV
is copied into the tier's blocks (same layout rule, by block index, in the tier's own pool) and
its device blocks are freed; the node stays in the tree as a *tiered* node. A tiered node's
descendants are all tiered, so a device leaf is a device node with no device child. A match that
runs into tiered nodes loads them back into fresh device blocks (evicting others if it must)
instead of leaving them to be recomputed; an insert whose path crosses tiered nodes gives them
the inserting writer's blocks. The tier has its own LRU over tiered leaves: when it is full the
oldest are dropped for good. Those moves are ``radix_tier.py``'s (a mixin of this class).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from radixlang.runtime import radix_inspect
from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.kv_events import (
    CLEARED,
    REMOVED,
    KvEventLog,
    announce_moved_blocks,
    name_node_blocks,
    salt_seed,
    tree_block_hashes,
    tree_block_media,
)
from radixlang.runtime.radix_node import (
    CacheHandle,
    RadixNode,
    StaleHandleError,
    retained_stamp,
    tier_stamp,
)
from radixlang.runtime.radix_retention import RetentionMoves
from radixlang.runtime.radix_tier import TierMoves, TierStore
from radixlang.runtime.tier_prefetch import PrefetchMoves


class CacheInUseError(RuntimeError):
    """The operation needs an idle cache, but some path is still locked."""


@dataclass(frozen=True)
class Eviction:
    """A node that left the device (dropped, or moved to the host tier): for viewers."""

    time: float  # Unix seconds
    node_id: int
    parent_id: int
    start: int
    end: int
    head_tokens: tuple[int, ...]  # the first tokens of its edge (enough to show it)
    blocks: int  # device blocks it held
    to_tier: bool


EVICTION_LOG_SIZE = 64
_EVICTION_HEAD_TOKENS = 48


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a query.

    ``blocks`` hold positions ``[0, length)``; when ``length`` is not a multiple of the block
    size the last block is partial and shared: copy it on write before appending to it.
    """

    length: int
    blocks: list[int]
    handle: CacheHandle
    loaded: int = 0  # of ``length``, tokens this match loaded back from the host tier


@dataclass(frozen=True)
class TierLoad:
    """What a match of a query would take from the tier (``RadixCache.tier_load``)."""

    length: int  # the cached prefix's length (tiered nodes count: a match loads them)
    tiered: int  # tier blocks the match would load (0: the prefix is resident)
    pending: int  # of their loads, blocks still in background loads not yet committed


def common_prefix_len(key: Sequence[int], tokens: Sequence[int], pos: int = 0) -> int:
    """How many leading ``tokens`` match ``key`` from ``pos`` on (with ``pos`` 0: the length of
    the two sequences' common prefix)."""
    n = len(tokens)
    if key[pos : pos + n] == tokens:  # the common case: all of them match
        return n
    # Binary search on slice equality: O(log n) comparisons, each done in C.
    lo, hi = 0, min(n, len(key) - pos)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if key[pos : pos + mid] == tokens[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _pop_live(candidates: dict[RadixNode, Any], heap: list) -> RadixNode | None:
    """The least recently used live candidate of ``heap``, taken off it (None when empty);
    stale entries (the node was touched, locked, extended or removed) are dropped."""
    while heap:
        stamp, _, node = heapq.heappop(heap)
        if candidates.get(node) == stamp:
            return node
    return None


def _peek_live(candidates: dict[RadixNode, Any], heap: list) -> RadixNode | None:
    """The live candidate :func:`_pop_live` would take next, left on the heap."""
    while heap:
        stamp, _, node = heap[0]
        if candidates.get(node) == stamp:
            return node
        heapq.heappop(heap)
    return None


def _disk_stats(tier: TierStore) -> dict[str, int]:
    """A disk tier's occupancy and traffic (``disk_*``; none for a host tier alone)."""
    if not hasattr(tier, "disk_blocks"):
        return {}
    return {k: v for k, v in tier.stats().items() if k.startswith("disk_")}  # type: ignore[attr-defined]


def _last_access(node: RadixNode) -> int:
    return node.last_access


def _as_token_list(tokens: Sequence[int]) -> list[int]:
    tolist = getattr(tokens, "tolist", None)  # torch tensors and numpy arrays
    return tolist() if tolist is not None else list(tokens)


class RadixCache(TierMoves, RetentionMoves, PrefetchMoves):
    """Token-id radix tree over a :class:`BlockPool`, with LRU eviction of unlocked leaves
    (retained ones last: ``radix_retention.py``)."""

    def __init__(
        self,
        pool: BlockPool,
        tier: TierStore | None = None,
        max_retained_blocks: int | None = None,
    ) -> None:
        if tier is not None and tier.pool.block_size != pool.block_size:
            raise ValueError("the host tier's blocks must be the size of the pool's")
        self.pool = pool
        self.tier = tier
        self.block_size = pool.block_size
        self._next_id = 0
        # One root per cache salt: prefixes cached under different salts never match (tenant
        # isolation). ``root`` is the default salt's ("") and always exists; another salt's root
        # is made by its first insert and dropped when its last child goes.
        self.root = self._new_node([], 0, [], None)
        self._roots: dict[str, RadixNode] = {"": self.root}
        self._root_salts: dict[RadixNode, str] = {self.root: ""}
        self._clock = 0
        self._evictable_blocks = 0
        self._protected_blocks = 0
        self._num_nodes = 0  # excluding the root
        self._cached_tokens = 0
        # Eviction candidates (unlocked non-root leaves) -> the stamp of their live heap entry.
        self._candidates: dict[RadixNode, int] = {}
        self._heap: list[tuple[int, int, RadixNode]] = []
        # The same for the tier: unlocked tiered leaves.
        self._tier_candidates: dict[RadixNode, tuple[int, float]] = {}
        self._tier_heap: list[tuple[tuple[int, float], int, RadixNode]] = []
        self._tiered_tokens = 0
        # Statistics for reports.
        self.match_queries = 0
        self.match_query_tokens = 0
        self.match_hit_tokens = 0
        self.evicted_blocks_total = 0
        self.evictions: deque[Eviction] = deque(maxlen=EVICTION_LOG_SIZE)  # the latest
        self.tier_written_blocks_total = 0  # device blocks copied into the tier
        self.tier_loaded_tokens_total = 0  # tokens loaded back from the tier
        self.tier_dropped_tokens_total = 0  # tiered tokens dropped for good (the tier was full)
        # What is stored and removed, block by block, for routers (``enable_kv_events``).
        self.kv_events: KvEventLog | None = None
        self._init_retention(max_retained_blocks)
        self._init_prefetch()

    def enable_kv_events(self, log: KvEventLog | None = None) -> KvEventLog:
        """Start emitting KV events (``runtime/kv_events.py``) into ``log`` (a new one if not
        given); what is cached already is announced first, parents before children."""
        self.kv_events = log if log is not None else KvEventLog()
        for salt, root in self.roots():
            seed = salt_seed(salt)
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                self._name_blocks(node, seed)
                stack.extend(node.children.values())
        return self.kv_events

    def block_hashes(self) -> list[tuple[int, list[int]]]:
        """Every cached block's hash, as (salt seed, hashes) per node: the whole state a KV
        event consumer rebuilds from after falling behind (empty without KV events)."""
        return [] if self.kv_events is None else tree_block_hashes(self.roots())

    def block_media(self) -> list[tuple[int, list[int], str]]:
        """:meth:`block_hashes` with where each node's blocks are: (salt seed, hashes,
        medium) per node (``kv_events.MEDIA``)."""
        return [] if self.kv_events is None else tree_block_media(self.roots())

    # ---- queries -------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], salt: str = "") -> MatchResult:
        """Longest cached prefix of ``tokens``, to the token.

        A match that ends inside a node splits it, so the handle names exactly the matched path.
        Touches the path for LRU and counts a hit on each node of it. Only prefixes inserted
        under the same ``salt`` match.
        """
        key = _as_token_list(tokens)
        self._clock += 1
        root = self._root(salt)
        path, _ = self._walk(key, split=True, root=root)
        # Tokens of the path that came from the tier: loaded here, or by a background load
        # that this match waited for or found done (tier_prefetch.py).
        loaded = 0
        if path and path[-1].tiered:
            if self._tickets:  # a background load of it may be under way: wait for it
                loaded += self._settle_path(path)
            if path[-1].tiered:
                path, now = self._load(path)
                loaded += now
        if self.tier_prefetched_blocks_total:
            loaded += self._count_ahead(path)
        for node in path:
            node.last_access = self._clock
            node.hits += 1
        end_node = path[-1] if path else root
        self._refresh_candidate(end_node)
        length = end_node.end
        self.match_queries += 1
        self.match_query_tokens += len(key)
        self.match_hit_tokens += length
        return MatchResult(length, self._block_table(path), CacheHandle(end_node), loaded)

    def peek_prefix_len(self, tokens: Sequence[int], salt: str = "") -> int:
        """Length of the longest cached prefix (tiered nodes count: a match loads them),
        without splitting or touching anything."""
        root = self._roots.get(salt)
        if root is None:
            return 0
        return self._walk(_as_token_list(tokens), split=False, root=root)[1]

    def prefetch_prefix(
        self,
        tokens: Sequence[int],
        salt: str = "",
        key: str | None = None,
        room: int = 0,
        needed_at: float | None = None,
    ) -> int:
        """Start loading the tiered part of ``tokens``' cached prefix in the background
        (``tier_prefetch.py``); returns the blocks it will load. Splits and touches nothing:
        a node the prefix ends inside is loaded whole."""
        root = self._roots.get(salt)
        if root is None or self.tier is None or self.copier is None:
            return 0
        path, _ = self._match_path(_as_token_list(tokens), root)
        if not path or not path[-1].tiered:
            return 0
        return self.prefetch(CacheHandle(path[-1]), key, room, needed_at)

    def prefetch_retained(self, key: str, room: int = 0) -> int:
        """Start loading back ``key``'s retained paths that are in the tier (evicting, for
        room, only what is predicted back later than they are); returns the blocks being
        loaded."""
        started = 0
        returns = self._returns.get(key, {})
        for node in list(self._retained.get(key, {})):
            if node.tiered and not node.evicted:
                n = self.prefetch(CacheHandle(node), key, room, returns.get(node))
                room = max(0, room - n)
                started += n
        return started

    def tier_seconds_per_block(self) -> float:
        """The tier's measured read time per block (0 before any read or without a tier)."""
        tier = self.tier
        read = getattr(tier, "blocks_read", 0)
        return getattr(tier, "read_seconds", 0.0) / read if read else 0.0

    def tier_load(self, tokens: Sequence[int], salt: str = "") -> TierLoad:
        """What a match of ``tokens`` would load from the tier, and how much of that background
        loads hold uncommitted (copying still, or done since the step's settling). Splits and
        touches nothing."""
        root = self._roots.get(salt)
        if root is None:
            return TierLoad(0, 0, 0)
        path, length = self._match_path(_as_token_list(tokens), root)
        if not self._tiered_tokens:
            return TierLoad(length, 0, 0)
        host = {b for n in path if n.tiered for b in n.host_blocks}
        loading = self._ticket_of_host
        tickets = {loading[b] for b in host if b in loading}
        return TierLoad(length, len(host), sum(len(t.device) for t in tickets))

    def continuation(
        self, handle: CacheHandle, tokens: Sequence[int], max_tokens: int
    ) -> list[int]:
        """What the cache holds after ``handle``'s path followed by ``tokens``: up to
        ``max_tokens`` tokens, along the most recently used child at each branch; empty when
        ``tokens`` are not all cached there. Reads only: nothing is split or touched (a
        speculative draft, see ``runtime/speculative``)."""
        node = handle._node
        if node.evicted or max_tokens <= 0:
            return []
        key = _as_token_list(tokens)
        pos = 0
        out: list[int] = []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                return []
            k = common_prefix_len(key, child.tokens, pos)
            pos += k
            node = child
            if k < len(child.tokens):
                if pos < len(key):
                    return []  # the path and the tokens part inside this node
                out = child.tokens[k : k + max_tokens]
        while len(out) < max_tokens and node.children:
            node = max(node.children.values(), key=_last_access)
            out += node.tokens[: max_tokens - len(out)]
        return out

    def handle_of(self, tokens: Sequence[int], salt: str = "") -> CacheHandle:
        """A handle on the node that ends exactly after ``tokens``, which must all be cached.

        For a writer that has just inserted its progress and wants to lock what it inserted;
        unlike :meth:`match_prefix` it counts no query in the hit statistics.
        """
        key = _as_token_list(tokens)
        root = self._root(salt)
        path, length = self._walk(key, split=True, root=root)
        if length != len(key):
            raise KeyError(f"only {length} of the {len(key)} tokens are cached")
        return CacheHandle(path[-1] if path else root)

    def evictable_size(self) -> int:
        """Blocks held only by unlocked nodes: what evicting everything would free, at most."""
        return self._evictable_blocks

    def protected_size(self) -> int:
        """Blocks held by locked nodes (on a path some running request uses)."""
        return self._protected_blocks

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV is in the device pool (each node's own tokens once)."""
        return self._cached_tokens

    @property
    def tiered_tokens(self) -> int:
        """Tokens whose KV is in the host tier (each node's own tokens once)."""
        return self._tiered_tokens

    def stats(self) -> dict[str, float | int]:
        queried = self.match_query_tokens
        return (
            {
                "nodes": self._num_nodes,
                "cached_tokens": self._cached_tokens,
                "evictable_blocks": self._evictable_blocks,
                "protected_blocks": self._protected_blocks,
                "pool_free_blocks": self.pool.num_free,
                "pool_total_blocks": self.pool.num_blocks,
                "match_queries": self.match_queries,
                "match_query_tokens": queried,
                "match_hit_tokens": self.match_hit_tokens,
                "hit_rate": self.match_hit_tokens / queried if queried else 0.0,
                "evicted_blocks_total": self.evicted_blocks_total,
            }
            | self.retention_stats()
            | self.tier_stats()
        )

    def tier_stats(self) -> dict[str, int]:
        """The host tier's occupancy and traffic (empty without a tier)."""
        if self.tier is None:
            return {}
        tier_pool = self.tier.pool
        return (
            {
                "tier_tokens": self._tiered_tokens,
                "tier_blocks_used": tier_pool.num_used,
                "tier_blocks_total": tier_pool.num_blocks,
                "tier_written_blocks_total": self.tier_written_blocks_total,
                "tier_loaded_tokens_total": self.tier_loaded_tokens_total,
                "tier_dropped_tokens_total": self.tier_dropped_tokens_total,
            }
            | self.prefetch_stats()
            | _disk_stats(self.tier)
        )

    # ---- updates -------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], blocks: Sequence[int], salt: str = "") -> int:
        """Add a sequence whose KV lives in ``blocks``; returns how many tokens were cached.

        ``blocks`` is the sequence's block table (at least ``ceil(len(tokens)/block_size)``
        blocks; extra trailing blocks are ignored). The tree references the blocks it adopts for
        the uncached suffix; the caller keeps its own references and drops them when done, which
        frees its duplicates of the already cached prefix. The sequence is cached under
        ``salt``: only matches with the same salt find it.
        """
        key = _as_token_list(tokens)
        blocks = list(blocks)
        bs = self.block_size
        need = -(-len(key) // bs)
        if len(blocks) < need:
            raise ValueError(
                f"{len(key)} tokens need {need} blocks of {bs}, but {len(blocks)} were given"
            )
        self._clock += 1
        root = self._root(salt)
        path, _ = self._walk(key, split=True, root=root)
        for node in path:
            node.last_access = self._clock
            if node.tiered:  # the writer holds this KV too: take its blocks, not the tier's
                self._adopt(node, blocks)
        parent = path[-1] if path else root
        cached = parent.end
        if cached < len(key):
            first, last = cached // bs, (len(key) - 1) // bs
            leaf_blocks = blocks[first : last + 1]
            self.pool.incref(leaf_blocks)
            leaf = self._new_node(key[cached:], cached, leaf_blocks, parent)
            leaf.last_access = self._clock
            parent.children[key[cached]] = leaf
            if parent is root and salt not in self._roots:
                self._roots[salt] = root  # the salt's first prefix: its root joins the tree
                self._root_salts[root] = salt
            leaf.own_blocks = self._count_own_blocks(leaf)
            if self.kv_events is not None:
                self._name_blocks(leaf, salt_seed(salt), key)
            self._evictable_blocks += leaf.own_blocks
            self._num_nodes += 1
            self._cached_tokens += len(leaf.tokens)
            self._refresh_candidate(leaf)
        self._refresh_candidate(parent)  # touched, or no longer a leaf
        return cached

    def lock(self, handle: CacheHandle) -> None:
        """Protect the path from the root to ``handle`` from eviction (counted; nestable)."""
        node = self._live_node(handle)
        while node.parent is not None:
            node.lock_ref += 1
            if node.lock_ref == 1:
                self._evictable_blocks -= node.own_blocks
                self._protected_blocks += node.own_blocks
                self._refresh_candidate(node)
            node = node.parent

    def unlock(self, handle: CacheHandle) -> None:
        """Undo one :meth:`lock` of the same handle."""
        node = self._live_node(handle)
        if node.parent is not None and node.lock_ref == 0:
            raise RuntimeError(f"unlock of {handle!r}, which is not locked")
        freed = False
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_blocks -= node.own_blocks
                self._evictable_blocks += node.own_blocks
                self._refresh_candidate(node)
                freed = True
            node = node.parent
        if freed and self._retained_candidates and self.max_retained_blocks is not None:
            # Retained blocks count once unlocked: a path retained while its request ran (or
            # the prefix under it) joins the count now, so hold retention to its share now.
            self._bound_retention()

    def evict(self, num_blocks: int, spare_returning_by: float | None = None) -> list[int]:
        """Evict least-recently-used unlocked leaves until ``num_blocks`` blocks are freed.

        Returns the block ids that became free (already back in the pool). Fewer are returned
        when nothing more is evictable; more when the last leaf held more than needed.
        Retained leaves go only once no other leaf is left (demoted to the tier if there is
        one), furthest predicted return first: a paused program's path outlives others' but
        never blocks an allocation. ``spare_returning_by`` (a prefetch's own predicted return):
        retained leaves predicted back by then are not taken.
        """
        self.expire_retentions()
        self._bound_retention()
        freed: list[int] = []
        while len(freed) < num_blocks:
            node = _pop_live(self._candidates, self._heap)
            if node is None:  # no plain leaf left (evicting a retained one may make one)
                if spare_returning_by is not None:
                    head = _peek_live(self._retained_candidates, self._retained_heap)
                    if head is None or head.expected_return <= spare_returning_by:
                        break  # the rest return sooner than what the room is for
                node = _pop_live(self._retained_candidates, self._retained_heap)
                if node is None:
                    break
                self.retained_evicted_blocks_total += len(node.blocks)
            freed.extend(self._evict_node(node))
        self.evicted_blocks_total += len(freed)
        return freed

    def swap_out(self, tokens: Sequence[int], salt: str = "") -> list[int]:
        """Move the cached path of ``tokens`` to the tier now, leaf first, as far up as its
        nodes are unlocked device leaves; returns the device blocks that became free.

        For a preempted request: its KV leaves the pool at once and comes back when it is
        matched again. Without a tier nothing moves."""
        if self.tier is None:
            return []
        key = _as_token_list(tokens)
        root = self._roots.get(salt)
        if root is None:
            return []
        path, length = self._walk(key, split=True, root=root)
        if not path or length != len(key):
            return []
        freed: list[int] = []
        node = path[-1]
        while node.parent is not None and node in self._candidates:
            parent = node.parent
            assert parent is not None
            freed.extend(self._evict_node(node))
            node = parent
        self.evicted_blocks_total += len(freed)
        return freed

    def flush(self) -> list[int]:
        """Drop every cached prefix; refused while any path is locked. Returns freed blocks."""
        self.settle_loads(wait=True)  # loads in flight hold their paths: finish them first
        roots = list(self._roots.values())
        if any(child.lock_ref for root in roots for child in root.children.values()):
            raise CacheInUseError("cannot flush the radix cache while requests hold locked paths")
        freed: list[int] = []
        stack = [child for root in roots for child in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.evicted = True
            freed.extend(self.pool.decref(node.blocks))
            if node.tiered:
                assert self.tier is not None
                self.tier.pool.decref(node.host_blocks)
        self.root.children.clear()
        self._roots = {"": self.root}
        self._root_salts = {self.root: ""}
        self._candidates.clear()
        self._heap.clear()
        self._retained_candidates.clear()
        self._retained_heap.clear()
        self._retained.clear()
        self._returns.clear()
        self._deadlines.clear()
        self._overdue.clear()
        self._tier_candidates.clear()
        self._tier_heap.clear()
        self._evictable_blocks = self._protected_blocks = 0
        self._num_nodes = self._cached_tokens = self._tiered_tokens = 0
        self.evicted_blocks_total += len(freed)
        if self.kv_events is not None:
            self.kv_events.append(CLEARED)
        return freed

    # ---- inspection (radix_inspect.py) -----------------------------------------------------
    def check_integrity(self, external_refs: Mapping[int, int] | None = None) -> None:
        """Raise :class:`IntegrityError` unless the tree, its counters and the pool agree.

        ``external_refs`` (block -> references held outside the tree, e.g. by running requests)
        makes the pool check exact: every refcount must equal tree holders plus external ones.
        """
        radix_inspect.check_integrity(self, external_refs)

    def nodes_parents_first(self) -> list[RadixNode]:
        """Every node but the root, each after its parent (to save the tree)."""
        out: list[RadixNode] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def describe(self, max_nodes: int | None = None) -> dict[str, Any]:
        """The tree as nested plain dicts (JSON-ready): :func:`radix_inspect.describe`."""
        return radix_inspect.describe(self, max_nodes)

    def render(
        self,
        decode: Callable[[list[int]], str] | None = None,
        max_nodes: int = 200,
        max_chars: int = 32,
    ) -> str:
        """The tree as text, a line a node: :func:`radix_inspect.render`."""
        return radix_inspect.render(self, decode, max_nodes, max_chars)

    def salt_of(self, node: RadixNode) -> str:
        """The cache salt of the tree ``node`` is in (for saving the tree)."""
        while node.parent is not None:
            node = node.parent
        return self._root_salts.get(node, "")

    def roots(self) -> list[tuple[str, RadixNode]]:
        """Each cache salt's tree root, the default salt "" first (for viewers)."""
        return list(self._roots.items())

    @property
    def clock(self) -> int:
        """The logical clock of last accesses: a node's LRU age is ``clock - last_access``."""
        return self._clock

    @property
    def salts(self) -> list[str]:
        """The salts with cached prefixes (the default salt "" always listed first)."""
        return list(self._roots)

    # ---- internals -----------------------------------------------------------------------
    def _root(self, salt: str) -> RadixNode:
        """The root of ``salt``'s tree; for a salt with nothing cached, a fresh root that
        :meth:`insert` registers once it hangs a prefix under it."""
        root = self._roots.get(salt)
        if root is None:
            root = self._new_node([], 0, [], None)
        return root

    def _drop_root_if_empty(self, root: RadixNode) -> None:
        if root is not self.root and not root.children:
            salt = self._root_salts.pop(root, None)
            if salt is not None:
                del self._roots[salt]

    def _new_node(
        self, tokens: list[int], start: int, blocks: list[int], parent: RadixNode | None
    ) -> RadixNode:
        node = RadixNode(self._next_id, tokens, start, blocks, parent)
        self._next_id += 1
        return node

    def _walk(
        self, key: list[int], split: bool, root: RadixNode | None = None
    ) -> tuple[list[RadixNode], int]:
        """The fully matched nodes along ``key`` (root excluded) and the matched length.

        With ``split``, a match that ends inside a node cuts it there, so the path ends exactly
        at the matched length; without, the length may reach into the node after the path.
        """
        path: list[RadixNode] = []
        node, pos = root if root is not None else self.root, 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            k = common_prefix_len(key, child.tokens, pos)
            pos += k
            if k < len(child.tokens):
                if not split:
                    break
                child = self._split(child, k)
            path.append(child)
            node = child
        return path, pos

    def _match_path(self, key: list[int], root: RadixNode) -> tuple[list[RadixNode], int]:
        """``_walk`` without splitting, the node the match ends inside included: what a match
        of ``key`` would hold (and load from the tier) whole."""
        path, length = self._walk(key, split=False, root=root)
        end = path[-1] if path else root
        if length > end.end:
            path.append(end.children[key[end.end]])
        return path, length

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node`` after ``k`` tokens; returns the new upper part.

        The existing node object stays the lower part, so handles on it keep naming the same
        path; the new parent inherits its locks, access time and hits.
        """
        bs = self.block_size
        cut = node.start + k
        parent = node.parent
        assert parent is not None
        upper_end = (cut - 1) // bs - node.start // bs + 1
        lower_start = cut // bs - node.start // bs
        upper = self._new_node(node.tokens[:k], node.start, node.blocks[:upper_end], parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hits = node.hits
        named = cut // bs - node.start // bs  # the blocks whose last token is above the cut
        upper.hashes, node.hashes = node.hashes[:named], node.hashes[named:]
        parent.children[upper.tokens[0]] = upper
        if node.tiered:  # the same cut in the tier's blocks; no device block is involved
            assert self.tier is not None
            upper.host_blocks = node.host_blocks[:upper_end]
            node.host_blocks = node.host_blocks[lower_start:]
            if cut % bs:
                self.tier.pool.incref([node.host_blocks[0]])
        node.blocks = node.blocks[lower_start:]
        if cut % bs and node.blocks:
            self.pool.incref([node.blocks[0]])  # the block the cut falls in: both hold it
        node.tokens = node.tokens[k:]
        node.start = cut
        node.parent = upper
        upper.children[node.tokens[0]] = node
        # Own blocks are conserved: the upper part takes the old share of the parent's block,
        # the lower part shares the cut block with the upper part.
        own_before = node.own_blocks
        upper.own_blocks = self._count_own_blocks(upper)
        node.own_blocks = self._count_own_blocks(node)
        assert upper.own_blocks + node.own_blocks == own_before
        self._num_nodes += 1
        return upper

    def _count_own_blocks(self, node: RadixNode) -> int:
        """Blocks of ``node`` that no ancestor also holds: what evicting it would free.

        Only a node that starts inside a block can share one, its first, with the ancestors
        whose last block has the same index. Usually that is the parent (a split, or a writer
        extending its own insert), but it can be a higher one: a writer that extends its own
        earlier insert after another request inserted the same next tokens in a block of its
        own puts its block under that request's node, whose block at the index differs.
        """
        bs = self.block_size
        if node.start % bs == 0 or not node.blocks:  # (a tiered node holds no device block)
            return len(node.blocks)
        first = node.start // bs
        up = node.parent
        while up is not None and up.parent is not None and (up.end - 1) // bs == first:
            if up.blocks[-1] == node.blocks[0]:
                return len(node.blocks) - 1
            up = up.parent
        return len(node.blocks)

    # ---- KV events ---------------------------------------------------------------------------
    def _name_blocks(self, node: RadixNode, seed: int, key: list[int] | None = None) -> None:
        """Hash ``node``'s blocks and announce them as stored (``kv_events.name_node_blocks``)."""
        assert self.kv_events is not None
        name_node_blocks(self.kv_events, node, seed, self.block_size, key)

    def _announce_removal(self, node: RadixNode) -> None:
        if self.kv_events is not None and node.hashes:
            self.kv_events.append(REMOVED, node.hashes)

    def _announce_move(self, node: RadixNode) -> None:
        """``node``'s KV moved between the device and the tier: its blocks are stored again,
        on their new medium (``kv_events.announce_moved_blocks``)."""
        if self.kv_events is not None and node.hashes:
            seed = salt_seed(self.salt_of(node))
            announce_moved_blocks(self.kv_events, node, seed, self.block_size)

    def _block_table(self, path: list[RadixNode]) -> list[int]:
        table: list[int] = []
        for node in path:  # a deeper node's block wins at the index it shares with its parent
            del table[node.start // self.block_size :]
            table.extend(node.blocks)
        return table

    def _evict_node(self, node: RadixNode) -> list[int]:
        """Evict one unlocked device leaf (to the tier when there is one) and log it."""
        parent = node.parent
        assert parent is not None
        blocks, head = len(node.blocks), tuple(node.tokens[:_EVICTION_HEAD_TOKENS])
        self._forget_prefetch(node)
        freed = self._demote(node) if self.tier is not None else self._remove_leaf(node)
        self.evictions.append(
            Eviction(time.time(), node.id, parent.id, node.start, node.end, head, blocks,
                     to_tier=node.tiered)
        )  # fmt: skip
        return freed

    def _remove_leaf(self, node: RadixNode) -> list[int]:
        """Drop a device node with no children; returns the device blocks that became free."""
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        assert not node.tiered
        del parent.children[node.tokens[0]]
        if parent.parent is None:
            self._drop_root_if_empty(parent)
        self._candidates.pop(node, None)
        self._retained_candidates.pop(node, None)
        node.evicted = True
        if node.retained_until:
            self._drop_retentions(node)
        self._evictable_blocks -= node.own_blocks
        self._num_nodes -= 1
        self._cached_tokens -= len(node.tokens)
        freed = self.pool.decref(node.blocks)
        self._announce_removal(node)
        self._refresh_candidate(parent)
        return freed

    def _refresh_candidate(self, node: RadixNode) -> None:
        """Keep ``node``'s membership in its eviction heap (device or tier) in step with its
        state: a device node with no device child, or a tiered node with no child at all."""
        if node.parent is None or node.evicted or node.lock_ref:
            self._candidates.pop(node, None)
            self._retained_candidates.pop(node, None)
            self._tier_candidates.pop(node, None)
            return
        if node.tiered:
            self._candidates.pop(node, None)
            self._retained_candidates.pop(node, None)
            if node.children:
                self._tier_candidates.pop(node, None)
            else:
                self._push(node, self._tier_candidates, self._tier_heap, tier_stamp(node))
            return
        children = node.children.values()
        if any(not c.tiered for c in children) if self.tier is not None else children:
            self._candidates.pop(node, None)
            self._retained_candidates.pop(node, None)
        elif node.retained_until:
            self._candidates.pop(node, None)
            self._push(node, self._retained_candidates, self._retained_heap, retained_stamp(node))
        else:
            self._retained_candidates.pop(node, None)
            self._push(node, self._candidates, self._heap, node.last_access)

    @staticmethod
    def _push(node: RadixNode, candidates: dict[RadixNode, Any], heap: list, stamp: Any) -> None:
        """Make ``stamp`` ``node``'s live entry in ``heap`` (smallest goes first)."""
        if candidates.get(node) == stamp:
            return
        candidates[node] = stamp
        heapq.heappush(heap, (stamp, node.id, node))
        if len(heap) > 2 * len(candidates) + 64:  # drop stale entries, amortised
            heap[:] = [(s, n.id, n) for n, s in candidates.items()]
            heapq.heapify(heap)

    def _live_node(self, handle: CacheHandle) -> RadixNode:
        node = handle._node
        if node.evicted:
            raise StaleHandleError(f"{handle!r} names a path that is no longer cached")
        return node
