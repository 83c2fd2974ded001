"""Prefetch: loading a tiered path back to the device *before* the request that needs it is
admitted, on a copy thread, while the engine's forward runs.

Without it a match that reaches tiered nodes copies them back on the engine thread, inside
admission: the step waits for the copy. With it the engine starts the copy as soon as it
knows the path will be needed (a request for it arrived, or its program's tool is about to
return, ``return_times.py``) and admission finds the path resident.

A load in flight is a :class:`LoadTicket`. It holds, outside the tree:

- a lock on the path's end (nothing on the path is evicted or dropped meanwhile);
- one reference to each host-tier block it reads (an insert that adopts a node frees the
  node's tier blocks, but not while the copy still reads them);
- the device blocks it writes (fresh, so no one else reads or writes them).

The tree does not change until the ticket is *committed* on the engine thread, after the copy
has finished: the tiered nodes then still on the path take their device blocks (as the
synchronous load does), the ticket's references are dropped and the lock released. A match
that reaches a path whose ticket is still copying waits for that copy (counted as *late*);
one that finds it committed counts its blocks as *ahead* (``tier_loaded_ahead_blocks_total``).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.radix_node import CacheHandle, RadixNode


class TierCopier:
    """One copy thread: tier reads run there, in submission order."""

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="radixlang-tier-copy"
        )
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> concurrent.futures.Future[None]:
        with self._lock:
            if self._closed:  # shut down: run here (the caller still gets a done future)
                future: concurrent.futures.Future[None] = concurrent.futures.Future()
                fn()
                future.set_result(None)
                return future
            return self._executor.submit(fn)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=True)


@dataclass(eq=False)
class LoadTicket:
    """One background load: ``host[i]`` is copied into ``device[i]``."""

    hold: CacheHandle  # the locked end of the path being loaded
    host: list[int]
    device: list[int]
    future: concurrent.futures.Future[None]
    key: str | None = None  # the program it was prefetched for, if any
    committed: bool = False
    nodes: list[RadixNode] = field(default_factory=list)  # the tiered nodes when it started

    @property
    def done(self) -> bool:
        return self.future.done()


class PrefetchMoves:
    """Background loads for ``RadixCache`` (see the module's docstring)."""

    pool: BlockPool
    block_size: int
    tier: object
    lock: Callable[[CacheHandle], None]
    unlock: Callable[[CacheHandle], None]
    evict: Callable[..., list[int]]
    _to_device: Callable[[RadixNode, list[int]], None]
    tier_loaded_tokens_total: int

    def _init_prefetch(self) -> None:
        self.copier: TierCopier | None = None  # set by the engine: loads run in the background
        self._tickets: list[LoadTicket] = []
        self._ticket_of_host: dict[int, LoadTicket] = {}  # host block -> the ticket reading it
        self.tier_loaded_blocks_total = 0  # device blocks filled from the tier, every way
        self.tier_loaded_ahead_blocks_total = 0  # of those: resident before a match needed them
        self.tier_loaded_late_blocks_total = 0  # prefetched, but a match waited for the copy
        self.tier_prefetched_blocks_total = 0  # copies started ahead of a match
        self.tier_prefetch_unused_blocks_total = 0  # prefetched, then evicted unused
        self.tier_sync_loaded_blocks_total = 0  # loaded inside a match, on the engine thread

    # ---- starting --------------------------------------------------------------------------
    def prefetch(
        self,
        handle: CacheHandle,
        key: str | None = None,
        room: int | None = None,
        needed_at: float | None = None,
    ) -> int:
        """Start loading the tiered end of the path to ``handle`` in the background; returns
        how many blocks it will load (0: nothing tiered, no copier, or no room).

        ``room``: how many device blocks the load may evict for space (default: none beyond
        the free ones; a prefetch must not push out what running requests will need);
        ``needed_at``: when the path is predicted to be used: retained paths predicted back
        by then are not evicted for it."""
        if self.tier is None or self.copier is None or not handle.valid:
            return 0
        path = _path_to(handle._node)
        split = next((i for i, n in enumerate(path) if n.tiered), None)
        if split is None:
            return 0
        tiered = [n for n in path[split:] if not _covered(n, self._ticket_of_host)]
        if len(tiered) < len(path) - split:
            return 0  # part of it is being loaded already
        wanted = list(dict.fromkeys(b for n in tiered for b in n.host_blocks))
        short = len(wanted) - self.pool.num_free
        if short > 0:
            if not room or short > room:
                return 0
            self.evict(short, spare_returning_by=needed_at)
            if len(wanted) > self.pool.num_free:
                return 0
        hold = CacheHandle(path[-1])
        self.lock(hold)
        device = self.pool.alloc(len(wanted))
        self.tier.pool.incref(wanted)  # type: ignore[attr-defined]
        read = self.tier.read  # type: ignore[attr-defined]
        future = self.copier.submit(lambda: read(wanted, device))
        ticket = LoadTicket(hold, wanted, device, future, key, nodes=tiered)
        self._tickets.append(ticket)
        for b in wanted:
            self._ticket_of_host[b] = ticket
        self.tier_prefetched_blocks_total += len(wanted)
        return len(wanted)

    # ---- finishing ---------------------------------------------------------------------------
    def settle_loads(self, wait: bool = False) -> int:
        """Commit the loads whose copy has finished (every load, waiting, with ``wait``);
        returns how many were committed."""
        done = 0
        for ticket in list(self._tickets):
            if wait or ticket.done:
                self._commit(ticket, late=False)
                done += 1
        return done

    def loads_in_flight(self) -> int:
        return len(self._tickets)

    def _settle_path(self, path: Sequence[RadixNode]) -> int:
        """Before a match uses ``path``: commit every load that covers a tiered node of it,
        waiting for copies still running (those blocks arrived late); returns the tokens of
        ``path`` they loaded late (those that arrived ahead, ``_count_ahead`` counts)."""
        tiered = [node for node in path if node.tiered]
        for node in tiered:
            for b in node.host_blocks:
                ticket = self._ticket_of_host.get(b)
                if ticket is not None and not ticket.committed:
                    self._commit(ticket, late=not ticket.done)
        return sum(len(node.tokens) for node in tiered if not node.tiered and not node.prefetched)

    def _commit(self, ticket: LoadTicket, late: bool) -> None:
        ticket.future.result()  # the copy's own error, if any, surfaces here
        ticket.committed = True
        self._tickets.remove(ticket)
        for b in ticket.host:
            if self._ticket_of_host.get(b) is ticket:
                del self._ticket_of_host[b]
        to_device = dict(zip(ticket.host, ticket.device, strict=True))
        loaded = 0
        node = ticket.hold._node
        chain = []
        while node.parent is not None and node.tiered:  # splits may have added nodes
            chain.append(node)
            node = node.parent
        for node in reversed(chain):
            if not all(b in to_device for b in node.host_blocks):
                break  # not what this ticket read (cannot happen while the path is held)
            blocks = [to_device[b] for b in node.host_blocks]
            self.pool.incref(blocks)  # the node's own reference (a cut block: one per holder)
            self._to_device(node, blocks)
            node.prefetched = 0 if late else len(blocks)
            loaded += len(node.tokens)
        self.pool.decref(ticket.device)  # the ticket's own references
        self.tier.pool.decref(ticket.host)  # type: ignore[attr-defined]
        self.unlock(ticket.hold)
        self.tier_loaded_tokens_total += loaded
        self.tier_loaded_blocks_total += len(ticket.device)
        if late:
            self.tier_loaded_late_blocks_total += len(ticket.device)

    def _count_ahead(self, path: Sequence[RadixNode]) -> int:
        """A match uses ``path``: prefetched nodes on it arrived ahead of their request;
        returns their tokens."""
        tokens = 0
        for node in path:
            if node.prefetched:
                self.tier_loaded_ahead_blocks_total += node.prefetched
                node.prefetched = 0
                tokens += len(node.tokens)
        return tokens

    def _forget_prefetch(self, node: RadixNode) -> None:
        """``node`` leaves the device before any match used what was prefetched into it."""
        if node.prefetched:
            self.tier_prefetch_unused_blocks_total += node.prefetched
            node.prefetched = 0

    def ticket_refs(self) -> tuple[dict[int, int], dict[int, int]]:
        """References loads in flight hold: (device blocks, host-tier blocks), for integrity
        checks."""
        device: dict[int, int] = {}
        host: dict[int, int] = {}
        for ticket in self._tickets:
            for b in ticket.device:
                device[b] = device.get(b, 0) + 1
            for b in ticket.host:
                host[b] = host.get(b, 0) + 1
        return device, host

    def prefetch_stats(self) -> dict[str, int | float]:
        used = self.tier_loaded_ahead_blocks_total
        total = used + self.tier_loaded_late_blocks_total + self.tier_sync_loaded_blocks_total
        return {
            "tier_loaded_blocks_total": self.tier_loaded_blocks_total,
            "tier_loaded_ahead_blocks_total": used,
            "tier_loaded_late_blocks_total": self.tier_loaded_late_blocks_total,
            "tier_prefetched_blocks_total": self.tier_prefetched_blocks_total,
            "tier_prefetch_unused_blocks_total": self.tier_prefetch_unused_blocks_total,
            "tier_loads_in_flight": len(self._tickets),
            "tier_loaded_sync_blocks_total": self.tier_sync_loaded_blocks_total,
            "tier_loaded_ahead_share": round(used / total, 4) if total else 0.0,
        }


def _path_to(node: RadixNode) -> list[RadixNode]:
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    path.reverse()
    return path


def _covered(node: RadixNode, loading: dict[int, LoadTicket]) -> bool:
    return any(b in loading for b in node.host_blocks)
