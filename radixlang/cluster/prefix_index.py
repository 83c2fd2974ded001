"""What one replica has cached, as the router believes it: the chain hashes of its cached
blocks (``runtime/kv_events.py``), kept from the replica's KV events, plus the prefixes the
router has just sent there and the replica has not stored yet (pending, for a while).

Matching a prompt is counting how many of its leading block hashes the set holds: a hash names
its whole prefix, so the first one missing ends the match. This is a radix tree over blocks,
flattened into one set.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from radixlang.runtime.kv_events import CLEARED, REMOVED, STORED, KvEvent

# How long a prefix the router sent to a replica counts as cached there without the replica's
# own event: long enough for a queued prefill, short enough that a request that never ran
# (aborted, refused) stops attracting its prefix's traffic soon.
PENDING_SECONDS = 30.0


class PrefixIndex:
    def __init__(
        self, pending_seconds: float = PENDING_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pending_seconds = pending_seconds
        self._clock = clock
        self._stored: set[int] = set()
        self._pending: dict[int, float] = {}  # hash -> when it stops counting

    def __len__(self) -> int:
        """Blocks the replica has announced as cached."""
        return len(self._stored)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` the replica holds (stored, or pending and fresh)."""
        now = self._clock()
        n = 0
        for h in hashes:
            if h not in self._stored:
                until = self._pending.get(h)
                if until is None or until < now:
                    break
            n += 1
        return n

    def add_pending(self, hashes: Iterable[int]) -> None:
        """The router sent a prompt with these blocks there: count them until the replica
        stores them (or ``pending_seconds`` pass)."""
        until = self._clock() + self.pending_seconds
        for h in hashes:
            if h not in self._stored:
                self._pending[h] = until
        if len(self._pending) > 4 * len(self._stored) + 4096:  # drop expired ones, amortised
            now = self._clock()
            self._pending = {h: t for h, t in self._pending.items() if t >= now}

    def apply(self, event: KvEvent | dict[str, Any]) -> None:
        """Follow one KV event of the replica (a :class:`KvEvent` or its ``to_dict()``)."""
        kind = event.kind if isinstance(event, KvEvent) else event["kind"]
        hashes = event.hashes if isinstance(event, KvEvent) else event["hashes"]
        if kind == STORED:
            self._stored.update(hashes)
            for h in hashes:
                self._pending.pop(h, None)
        elif kind == REMOVED:
            self._stored.difference_update(hashes)
        elif kind == CLEARED:
            self._stored.clear()
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")

    def reset(self, stored: Iterable[int] = ()) -> None:
        """Forget everything (the replica restarted, or its events were missed), keeping only
        ``stored``: a fresh snapshot of what it holds."""
        self._stored = set(stored)
        self._pending.clear()
