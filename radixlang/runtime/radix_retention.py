"""Retention: the radix cache's half that keeps a paused program's path for its next call.

A program that stops at a tool call comes back in a moment with a longer prompt. Under plain
LRU its path is just another old leaf, evicted under load and computed again when the program
returns. A *retained* leaf is evicted only when no other leaf is left (and, with a host tier,
demoted there rather than dropped, so the program's return loads it instead of computing it).

Bounds, so retention can never starve running requests:

- a retained leaf is still evictable: ``evictable_size`` counts it, and ``evict`` takes it once
  plain leaves run out, so admission sees the same room as without retention;
- a retention ends at its deadline (at most the engine's ``retain_max_s``), when its key is
  released (the program ended), or when newer retentions push the retained blocks past the
  cache's ``max_retained_blocks`` (the oldest deadline goes first).

A retention is (key, node, deadline): the key names the program (its routing key), which may
hold several paths at once (its forks). ``node.retained_until`` is nonzero while any retention
names the node; expiry is applied by :meth:`expire_retentions` (run before every eviction), so
a node's state changes only there and in :meth:`retain`/:meth:`release`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable

from radixlang.runtime.radix_node import CacheHandle, RadixNode

# A key holds at most this many paths (a program's concurrent forks); older ones are dropped.
MAX_PATHS_PER_KEY = 64


class RetentionMoves:
    """Retention for ``RadixCache`` (see the module's docstring)."""

    _refresh_candidate: Callable[[RadixNode], None]
    _live_node: Callable[[CacheHandle], RadixNode]

    def _init_retention(self, max_retained_blocks: int | None) -> None:
        self.max_retained_blocks = max_retained_blocks
        self._retained: dict[str, dict[RadixNode, float]] = {}  # key -> its nodes' deadlines
        # key -> its nodes' predicted return times (the soonest over keys is the node's own).
        self._returns: dict[str, dict[RadixNode, float]] = {}
        self._deadlines: list[tuple[float, int, str, RadixNode]] = []  # expiry heap
        # When a retention's program is overdue: its predicted return is moved to its deadline.
        self._overdue: list[tuple[float, int, str, RadixNode]] = []
        self._seq = itertools.count()
        # Retained device leaves: evicted only after every plain candidate.
        self._retained_candidates: dict[RadixNode, float] = {}
        self._retained_heap: list[tuple[float, int, RadixNode]] = []
        self.retained_total = 0  # retentions made
        self.retained_evicted_blocks_total = 0  # device blocks of retained leaves evicted

    def retain(
        self, handle: CacheHandle, key: str, ttl: float, expected_return: float | None = None
    ) -> None:
        """Keep the path to ``handle`` for ``key``'s next call, up to ``ttl`` seconds;
        ``expected_return`` (``time.monotonic`` seconds, ``return_times.py``): when that call
        is predicted, which orders eviction among retained paths (furthest first). Without
        one, the deadline stands in for it."""
        if ttl <= 0:
            return
        node = self._live_node(handle)
        if node.parent is None:
            return  # the empty path: nothing to keep
        now = time.monotonic()
        self.expire_retentions(now)
        paths = self._retained.setdefault(key, {})
        deadline = now + ttl
        paths.pop(node, None)
        paths[node] = deadline
        returns = self._returns.setdefault(key, {})
        returns.pop(node, None)
        returns[node] = min(deadline, expected_return if expected_return is not None else deadline)
        while len(paths) > MAX_PATHS_PER_KEY:
            self._forget(key, next(iter(paths)))
        was_retained = bool(node.retained_until)
        node.retained_until = max(node.retained_until, deadline)
        soonest = returns[node]
        node.expected_return = min(node.expected_return, soonest) if was_retained else soonest
        heapq.heappush(self._deadlines, (deadline, next(self._seq), key, node))
        if expected_return is not None and now < expected_return < deadline:
            # Overdue at twice its predicted gap: likely ended without a release, its path then
            # ranks as needed last (a soft TTL, well before the deadline).
            overdue = min(deadline, expected_return + (expected_return - now))
            heapq.heappush(self._overdue, (overdue, next(self._seq), key, node))
        self.retained_total += 1
        self._refresh_candidate(node)
        self._bound_retention()

    def release(self, key: str) -> int:
        """End every retention of ``key`` (its program ended); returns how many there were."""
        paths = self._retained.get(key, {})
        count = len(paths)
        for node in list(paths):
            self._forget(key, node)
        return count

    def expire_retentions(self, now: float | None = None) -> None:
        """End the retentions whose deadline has passed."""
        now = time.monotonic() if now is None else now
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, key, node = heapq.heappop(self._deadlines)
            if self._retained.get(key, {}).get(node) == deadline:
                self._forget(key, node)
        while self._overdue and self._overdue[0][0] <= now:
            _, _, key, node = heapq.heappop(self._overdue)
            returns, deadline = self._returns.get(key, {}), self._retained.get(key, {}).get(node)
            if node in returns and deadline is not None and returns[node] < deadline:
                returns[node] = deadline
                node.expected_return = min(r[node] for r in self._returns.values() if node in r)
                if not node.evicted:
                    self._refresh_candidate(node)

    def retained_blocks(self) -> int:
        """Device blocks only retained paths hold: each retained leaf's own blocks and those of
        the unbranched, unlocked ancestors that go with it (a request's prompt node and the
        output node under it)."""
        total = 0
        for node in self._retained_candidates:
            total += node.own_blocks
            up = node.parent
            while (
                up is not None
                and up.parent is not None
                and len(up.children) == 1
                and not (up.lock_ref or up.tiered)
            ):
                total += up.own_blocks
                up = up.parent
        return total

    def retention_stats(self) -> dict[str, int]:
        return {
            "retained_keys": len(self._retained),
            "retained_paths": sum(len(p) for p in self._retained.values()),
            "retained_blocks": self.retained_blocks(),
            "retained_total": self.retained_total,
            "retained_evicted_blocks_total": self.retained_evicted_blocks_total,
        }

    def _forget(self, key: str, node: RadixNode) -> None:
        paths = self._retained.get(key)
        if paths is None or node not in paths:
            return
        del paths[node]
        returns = self._returns.get(key, {})
        returns.pop(node, None)
        if not paths:
            del self._retained[key]
            self._returns.pop(key, None)
        # Another key may still name the node (two programs on one path): keep its deadline.
        others = [p[node] for p in self._retained.values() if node in p]
        node.retained_until = max(others, default=0.0)
        node.expected_return = min(
            (r[node] for r in self._returns.values() if node in r), default=0.0
        )
        if not node.evicted:
            self._refresh_candidate(node)

    def _bound_retention(self) -> None:
        """Past ``max_retained_blocks``, end the retentions nearest their deadline first."""
        bound = self.max_retained_blocks
        if bound is None:
            return
        while self.retained_blocks() > bound and self._retained_candidates:
            _, node = min(
                ((k, n) for k, paths in self._retained.items() for n in paths
                 if n in self._retained_candidates),
                key=lambda kn: self._retained[kn[0]][kn[1]],
            )  # fmt: skip
            self._drop_retentions(node)

    def _drop_retentions(self, node: RadixNode) -> None:
        """End every retention of ``node`` (it is bounded out, or leaves the cache)."""
        for key in [k for k, paths in self._retained.items() if node in paths]:
            self._forget(key, node)
