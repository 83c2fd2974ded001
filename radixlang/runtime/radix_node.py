"""A node of the radix cache's tree, and the handle that names the path a match ended on.

See ``radix_cache.py`` for the layout a node's ``blocks`` follow and who owns them.
"""

from __future__ import annotations


class StaleHandleError(RuntimeError):
    """A handle points at a node that eviction or a flush has removed."""


class RadixNode:
    """Tokens ``[start, end)`` of every sequence through it, with their KV blocks."""

    __slots__ = (
        "blocks",
        "children",
        "evicted",
        "expected_return",
        "hashes",
        "hits",
        "host_blocks",
        "id",
        "last_access",
        "lock_ref",
        "own_blocks",
        "parent",
        "prefetched",
        "retained_until",
        "start",
        "tokens",
    )

    def __init__(
        self,
        node_id: int,
        tokens: list[int],
        start: int,
        blocks: list[int],
        parent: RadixNode | None,
    ) -> None:
        self.id = node_id
        self.tokens = tokens
        self.start = start
        self.blocks = blocks
        self.parent = parent
        self.children: dict[int, RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hits = 0
        self.own_blocks = 0  # blocks not also held by the parent (counted for sizes)
        self.evicted = False
        # Nonzero while a program retains this path (radix_retention.py): its latest deadline.
        self.retained_until = 0.0
        # While retained: when its program is predicted to call again (eviction order).
        self.expected_return = 0.0
        # Tiered: the KV is in these host-tier blocks (by block index, like ``blocks``) and
        # ``blocks`` is empty.
        self.host_blocks: list[int] = []
        # Device blocks a background load brought in that no match has used yet (counted as
        # loaded ahead of their request when one does: tier_prefetch.py).
        self.prefetched = 0
        # With KV events on: the chain hashes of the full blocks whose last token is in this
        # node, i.e. block indices [start // block_size, end // block_size).
        self.hashes: list[int] = []

    @property
    def tiered(self) -> bool:
        return bool(self.host_blocks)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def retained_stamp(node: RadixNode) -> float:
    """A retained device leaf's eviction order: the furthest predicted return goes first."""
    return -node.expected_return


def tier_stamp(node: RadixNode) -> tuple[int, float]:
    """A tiered leaf's: plain ones least recently used first, then retained ones, furthest
    predicted return first."""
    if node.retained_until:
        return (1, -node.expected_return)
    return (0, float(node.last_access))


class CacheHandle:
    """Names the cached path a match ended on; lock it to keep that path from eviction."""

    __slots__ = ("_node",)

    def __init__(self, node: RadixNode) -> None:
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
