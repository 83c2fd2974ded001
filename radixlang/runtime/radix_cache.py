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
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from radixlang.runtime.block_pool import BlockPool, IntegrityError


class StaleHandleError(RuntimeError):
    """A handle points at a node that eviction or a flush has removed."""


class CacheInUseError(RuntimeError):
    """The operation needs an idle cache, but some path is still locked."""


class _Node:
    __slots__ = (
        "blocks",
        "children",
        "evicted",
        "hits",
        "id",
        "last_access",
        "lock_ref",
        "own_blocks",
        "parent",
        "start",
        "tokens",
    )

    def __init__(
        self, node_id: int, tokens: list[int], start: int, blocks: list[int], parent: _Node | None
    ) -> None:
        self.id = node_id
        self.tokens = tokens
        self.start = start
        self.blocks = blocks
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0
        self.own_blocks = 0  # blocks not also held by the parent (counted for sizes)
        self.evicted = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class CacheHandle:
    """Names the cached path a match ended on; lock it to keep that path from eviction."""

    __slots__ = ("_node",)

    def __init__(self, node: _Node) -> None:
        self._node = node

    @property
    def length(self) -> int:
        """Number of tokens on the path from the root to this handle's node."""
        return self._node.end

    @property
    def valid(self) -> bool:
        return not self._node.evicted

    def __repr__(self) -> str:
        state = "valid" if self.valid else "evicted"
        return f"CacheHandle(length={self.length}, {state})"


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix of a query.

    ``blocks`` hold positions ``[0, length)``; when ``length`` is not a multiple of the block
    size the last block is partial and shared: copy it on write before appending to it.
    """

    length: int
    blocks: list[int]
    handle: CacheHandle


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


def _as_token_list(tokens: Sequence[int]) -> list[int]:
    tolist = getattr(tokens, "tolist", None)  # torch tensors and numpy arrays
    return tolist() if tolist is not None else list(tokens)


class RadixCache:
    """Token-id radix tree over a :class:`BlockPool`, with LRU eviction of unlocked leaves."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._next_id = 0
        self.root = self._new_node([], 0, [], None)
        self._clock = 0
        self._evictable_blocks = 0
        self._protected_blocks = 0
        self._num_nodes = 0  # excluding the root
        self._cached_tokens = 0
        # Eviction candidates (unlocked non-root leaves) -> the stamp of their live heap entry.
        self._candidates: dict[_Node, int] = {}
        self._heap: list[tuple[int, int, _Node]] = []
        # Statistics for reports.
        self.match_queries = 0
        self.match_query_tokens = 0
        self.match_hit_tokens = 0
        self.evicted_blocks_total = 0

    # ---- queries -------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``tokens``, to the token.

        A match that ends inside a node splits it, so the handle names exactly the matched path.
        Touches the path for LRU and counts a hit on each node of it.
        """
        key = _as_token_list(tokens)
        self._clock += 1
        path, _ = self._walk(key, split=True)
        for node in path:
            node.last_access = self._clock
            node.hits += 1
        end_node = path[-1] if path else self.root
        self._refresh_candidate(end_node)
        length = end_node.end
        self.match_queries += 1
        self.match_query_tokens += len(key)
        self.match_hit_tokens += length
        return MatchResult(length, self._block_table(path), CacheHandle(end_node))

    def peek_prefix_len(self, tokens: Sequence[int]) -> int:
        """Length of the longest cached prefix, without splitting or touching anything."""
        return self._walk(_as_token_list(tokens), split=False)[1]

    def handle_of(self, tokens: Sequence[int]) -> CacheHandle:
        """A handle on the node that ends exactly after ``tokens``, which must all be cached.

        For a writer that has just inserted its progress and wants to lock what it inserted;
        unlike :meth:`match_prefix` it counts no query in the hit statistics.
        """
        key = _as_token_list(tokens)
        path, length = self._walk(key, split=True)
        if length != len(key):
            raise KeyError(f"only {length} of the {len(key)} tokens are cached")
        return CacheHandle(path[-1] if path else self.root)

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
        """Tokens stored in the tree (each node's own tokens once)."""
        return self._cached_tokens

    def stats(self) -> dict[str, float | int]:
        queried = self.match_query_tokens
        return {
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

    # ---- updates -------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Add a sequence whose KV lives in ``blocks``; returns how many tokens were cached.

        ``blocks`` is the sequence's block table (at least ``ceil(len(tokens)/block_size)``
        blocks; extra trailing blocks are ignored). The tree references the blocks it adopts for
        the uncached suffix; the caller keeps its own references and drops them when done, which
        frees its duplicates of the already cached prefix.
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
        path, _ = self._walk(key, split=True)
        for node in path:
            node.last_access = self._clock
        parent = path[-1] if path else self.root
        cached = parent.end
        if cached < len(key):
            first, last = cached // bs, (len(key) - 1) // bs
            leaf_blocks = blocks[first : last + 1]
            self.pool.incref(leaf_blocks)
            leaf = self._new_node(key[cached:], cached, leaf_blocks, parent)
            leaf.last_access = self._clock
            parent.children[key[cached]] = leaf
            leaf.own_blocks = self._count_own_blocks(leaf)
            self._evictable_blocks += leaf.own_blocks
            self._num_nodes += 1
            self._cached_tokens += len(leaf.tokens)
            self._refresh_candidate(leaf)
        self._refresh_candidate(parent)  # touched, or no longer a leaf
        return cached

    def lock(self, handle: CacheHandle) -> None:
        """Protect the path from the root to ``handle`` from eviction (counted; nestable)."""
        node = self._live_node(handle)
        while node is not self.root:
            node.lock_ref += 1
            if node.lock_ref == 1:
                self._evictable_blocks -= node.own_blocks
                self._protected_blocks += node.own_blocks
                self._refresh_candidate(node)
            node = node.parent

    def unlock(self, handle: CacheHandle) -> None:
        """Undo one :meth:`lock` of the same handle."""
        node = self._live_node(handle)
        if node is not self.root and node.lock_ref == 0:
            raise RuntimeError(f"unlock of {handle!r}, which is not locked")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_blocks -= node.own_blocks
                self._evictable_blocks += node.own_blocks
                self._refresh_candidate(node)
            node = node.parent

    def evict(self, num_blocks: int) -> list[int]:
        """Evict least-recently-used unlocked leaves until ``num_blocks`` blocks are freed.

        Returns the block ids that became free (already back in the pool). Fewer are returned
        when nothing more is evictable; more when the last leaf held more than needed.
        """
        freed: list[int] = []
        while len(freed) < num_blocks and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if self._candidates.get(node) != stamp:
                continue  # a stale entry: the node was touched, locked, extended or removed
            freed.extend(self._remove_leaf(node))
        self.evicted_blocks_total += len(freed)
        return freed

    def flush(self) -> list[int]:
        """Drop every cached prefix; refused while any path is locked. Returns freed blocks."""
        if any(child.lock_ref for child in self.root.children.values()):
            raise CacheInUseError("cannot flush the radix cache while requests hold locked paths")
        freed: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.evicted = True
            freed.extend(self.pool.decref(node.blocks))
        self.root.children.clear()
        self._candidates.clear()
        self._heap.clear()
        self._evictable_blocks = self._protected_blocks = 0
        self._num_nodes = self._cached_tokens = 0
        self.evicted_blocks_total += len(freed)
        return freed

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self, external_refs: Mapping[int, int] | None = None) -> None:
        """Raise :class:`IntegrityError` unless the tree, its counters and the pool agree.

        ``external_refs`` (block -> references held outside the tree, e.g. by running requests)
        makes the pool check exact: every refcount must equal tree holders plus external ones.
        """
        bs = self.block_size
        holders: dict[int, list[tuple[_Node, int]]] = {}
        evictable = protected = nodes = tokens = 0
        candidates: dict[_Node, int] = {}
        stack = [self.root]
        while stack:
            node = stack.pop()
            children_locks = 0
            for first_token, child in node.children.items():
                _expect(child.parent is node, f"node {child.id}: wrong parent")
                _expect(bool(child.tokens), f"node {child.id}: empty key")
                _expect(child.tokens[0] == first_token, f"node {child.id}: keyed by wrong token")
                _expect(child.start == node.end, f"node {child.id}: starts at {child.start}")
                _expect(not child.evicted, f"node {child.id}: evicted but still in the tree")
                children_locks += child.lock_ref
                stack.append(child)
            if node is self.root:
                continue
            nodes += 1
            tokens += len(node.tokens)
            first, last = node.start // bs, (node.end - 1) // bs
            _expect(
                len(node.blocks) == last - first + 1,
                f"node {node.id}: {len(node.blocks)} blocks for indices {first}..{last}",
            )
            _expect(node.lock_ref >= children_locks, f"node {node.id}: lock below its children")
            own = self._count_own_blocks(node)
            _expect(own == node.own_blocks, f"node {node.id}: own blocks {node.own_blocks}!={own}")
            if node.lock_ref:
                protected += own
            else:
                evictable += own
                if not node.children:
                    candidates[node] = node.last_access
            for j, b in enumerate(node.blocks):
                holders.setdefault(b, []).append((node, first + j))
        _expect(nodes == self._num_nodes, f"node count {self._num_nodes} != {nodes}")
        _expect(tokens == self._cached_tokens, f"token count {self._cached_tokens} != {tokens}")
        _expect(evictable == self._evictable_blocks, "evictable size counter is off")
        _expect(protected == self._protected_blocks, "protected size counter is off")
        _expect(candidates == self._candidates, "eviction candidates differ from the tree")
        live = {(stamp, node.id) for stamp, _, node in self._heap}
        for node, stamp in candidates.items():
            _expect((stamp, node.id) in live, f"leaf {node.id} has no live heap entry")
        for b, hs in holders.items():
            if len(hs) > 1:  # one block, several nodes: an ancestor chain at one index
                _expect(len({i for _, i in hs}) == 1, f"block {b} held at two block indices")
                chain = sorted((n for n, _ in hs), key=lambda n: n.start)
                for up, down in pairwise(chain):
                    _expect(_is_ancestor(up, down), f"block {b} shared by nodes on two branches")
        tree_refs = Counter({b: len(hs) for b, hs in holders.items()})
        if external_refs is None:
            for b, k in tree_refs.items():
                _expect(self.pool.refcount(b) >= k, f"block {b}: refcount below tree holders")
            self.pool.check_integrity()
        else:
            self.pool.check_integrity(tree_refs + Counter(external_refs))

    # ---- rendering -----------------------------------------------------------------------
    def describe(self, max_nodes: int | None = None) -> dict[str, Any]:
        """The tree as nested plain dicts (JSON-ready), for viewers such as the REPL's /tree.

        Each node: ``id``, ``start``/``end`` (its token positions), ``token_ids`` (its edge),
        ``blocks`` (pool ids), ``own_blocks`` (blocks no ancestor also holds), ``block_refs``
        (each block's pool reference count: tree holders plus running requests), ``hits``
        (matches that passed through it), ``lock_ref`` (running requests whose path includes
        it), ``age`` (cache operations since it was last matched or inserted: its LRU age) and
        ``children`` (by first token). The root (``id`` 0, no tokens) also carries
        ``num_nodes``, ``shown_nodes`` (at most ``max_nodes``, depth-first) and
        ``tree_blocks``, the distinct blocks the tree holds. Read it where nothing mutates the
        cache (the engine thread: ``Engine._call``)."""
        shown = 0
        tree_blocks: set[int] = set()

        def info(node: _Node) -> dict[str, Any]:
            tree_blocks.update(node.blocks)
            return {
                "id": node.id,
                "start": node.start,
                "end": node.end,
                "token_ids": list(node.tokens),
                "blocks": list(node.blocks),
                "own_blocks": node.own_blocks,
                "block_refs": [self.pool.refcount(b) for b in node.blocks],
                "hits": node.hits,
                "lock_ref": node.lock_ref,
                "age": self._clock - node.last_access,
                "children": [],
            }

        root = info(self.root)
        stack = [(child, root) for child in reversed(self._ordered_children(self.root))]
        while stack:
            node, parent_info = stack.pop()
            if max_nodes is not None and shown >= max_nodes:
                tree_blocks.update(node.blocks)  # counted, though not shown
                stack.extend((c, parent_info) for c in node.children.values())
                continue
            shown += 1
            node_info = info(node)
            parent_info["children"].append(node_info)
            stack.extend((c, node_info) for c in reversed(self._ordered_children(node)))
        root.update(num_nodes=self._num_nodes, shown_nodes=shown, tree_blocks=len(tree_blocks))
        return root

    def render(
        self,
        decode: Callable[[list[int]], str] | None = None,
        max_nodes: int = 200,
        max_chars: int = 32,
    ) -> str:
        """The tree as text: one line per node with its span, blocks, hits and lock count."""
        s = self.stats()
        lines = [
            f"radix cache: {s['nodes']} nodes, {s['cached_tokens']} tokens, "
            f"{s['evictable_blocks']} evictable + {s['protected_blocks']} protected blocks, "
            f"pool {s['pool_free_blocks']}/{s['pool_total_blocks']} free, "
            f"hit rate {s['hit_rate']:.1%}"
        ]
        shown = 0
        stack: list[tuple[_Node, str, bool]] = [
            (c, "", i == len(self.root.children) - 1)
            for i, c in enumerate(self._ordered_children(self.root))
        ][::-1]
        while stack and shown < max_nodes:
            node, indent, is_last = stack.pop()
            shown += 1
            label = decode(node.tokens) if decode else " ".join(map(str, node.tokens))
            if len(label) > max_chars:
                label = label[: max_chars - 1] + "…"
            lock = f" lock={node.lock_ref}" if node.lock_ref else ""
            lines.append(
                f"{indent}{'└─' if is_last else '├─'} [{node.start}:{node.end}) {label!r} "
                f"blocks={len(node.blocks)} hits={node.hits}{lock}"
            )
            kids = self._ordered_children(node)
            child_indent = indent + ("   " if is_last else "│  ")
            stack.extend(
                (c, child_indent, i == len(kids) - 1) for i, c in reversed(list(enumerate(kids)))
            )
        if shown < self._num_nodes:
            lines.append(f"… {self._num_nodes - shown} more nodes")
        return "\n".join(lines)

    # ---- internals -----------------------------------------------------------------------
    def _new_node(
        self, tokens: list[int], start: int, blocks: list[int], parent: _Node | None
    ) -> _Node:
        node = _Node(self._next_id, tokens, start, blocks, parent)
        self._next_id += 1
        return node

    def _walk(self, key: list[int], split: bool) -> tuple[list[_Node], int]:
        """The fully matched nodes along ``key`` (root excluded) and the matched length.

        With ``split``, a match that ends inside a node cuts it there, so the path ends exactly
        at the matched length; without, the length may reach into the node after the path.
        """
        path: list[_Node] = []
        node, pos = self.root, 0
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

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after ``k`` tokens; returns the new upper part.

        The existing node object stays the lower part, so handles on it keep naming the same
        path; the new parent inherits its locks, access time and hits.
        """
        bs = self.block_size
        cut = node.start + k
        parent = node.parent
        assert parent is not None
        upper_blocks = node.blocks[: (cut - 1) // bs - node.start // bs + 1]
        upper = self._new_node(node.tokens[:k], node.start, upper_blocks, parent)
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hits = node.hits
        parent.children[upper.tokens[0]] = upper
        node.blocks = node.blocks[cut // bs - node.start // bs :]
        if cut % bs:
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

    def _count_own_blocks(self, node: _Node) -> int:
        """Blocks of ``node`` that no ancestor also holds: what evicting it would free.

        Only a node that starts inside a block can share one, its first, with the ancestors
        whose last block has the same index. Usually that is the parent (a split, or a writer
        extending its own insert), but it can be a higher one: a writer that extends its own
        earlier insert after another request inserted the same next tokens in a block of its
        own puts its block under that request's node, whose block at the index differs.
        """
        bs = self.block_size
        if node.start % bs == 0:
            return len(node.blocks)
        first = node.start // bs
        up = node.parent
        while up is not None and up is not self.root and (up.end - 1) // bs == first:
            if up.blocks[-1] == node.blocks[0]:
                return len(node.blocks) - 1
            up = up.parent
        return len(node.blocks)

    def _block_table(self, path: list[_Node]) -> list[int]:
        table: list[int] = []
        for node in path:  # a deeper node's block wins at the index it shares with its parent
            del table[node.start // self.block_size :]
            table.extend(node.blocks)
        return table

    def _remove_leaf(self, node: _Node) -> list[int]:
        parent = node.parent
        assert parent is not None and not node.children and node.lock_ref == 0
        del parent.children[node.tokens[0]]
        self._candidates.pop(node, None)
        node.evicted = True
        self._evictable_blocks -= node.own_blocks
        self._num_nodes -= 1
        self._cached_tokens -= len(node.tokens)
        freed = self.pool.decref(node.blocks)
        self._refresh_candidate(parent)
        return freed

    def _refresh_candidate(self, node: _Node) -> None:
        """Keep ``node``'s membership in the eviction heap in step with its state."""
        if node is self.root or node.evicted or node.children or node.lock_ref:
            self._candidates.pop(node, None)
            return
        if self._candidates.get(node) == node.last_access:
            return
        self._candidates[node] = node.last_access
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 2 * len(self._candidates) + 64:  # drop stale entries, amortised
            self._heap[:] = [(s, n.id, n) for n, s in self._candidates.items()]
            heapq.heapify(self._heap)

    def _live_node(self, handle: CacheHandle) -> _Node:
        node = handle._node
        if node.evicted:
            raise StaleHandleError(f"{handle!r} names a path that is no longer cached")
        return node

    @staticmethod
    def _ordered_children(node: _Node) -> list[_Node]:
        return sorted(node.children.values(), key=lambda c: c.tokens[0])


def _is_ancestor(up: _Node, down: _Node) -> bool:
    node = down.parent
    while node is not None:
        if node is up:
            return True
        node = node.parent
    return False


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise IntegrityError(message)
