"""What one replica has cached, as the router believes it: the chain hashes of its cached
blocks (``runtime/kv_events.py``) and where each one lives (its medium: ``device``, ``host``
tier or ``disk``), kept from the replica's KV events, plus the prefixes the router has just
sent there and the replica has not stored yet (pending, for a while).

Matching a prompt is counting how many of its leading block hashes the set holds: a hash names
its whole prefix, so the first one missing ends the match. This is a radix tree over blocks,
flattened into one set.

Weighing a match (:meth:`PrefixIndex.score`, what routing compares): each matched block counts
what it spares the replica against computing it. A block on the device counts 1 (nothing to
do), in the host tier 0.5 (a copy back to the device instead of a prefill), on disk 0.25 (a
read and a copy); a pending block counts 1, since the request sent there leaves it on the
device. The weight of a match is the sum over its leading run of held blocks: a replica
holding a prefix on the device outweighs one holding the same prefix in the host tier, which
outweighs one holding none; a longer prefix in the tier can outweigh a shorter one on the
device. The match's length (:meth:`PrefixIndex.match`) is still the whole run, whatever the
media.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from radixlang.runtime.kv_events import CLEARED, DEVICE, DISK, HOST, REMOVED, STORED, KvEvent

# How long a prefix the router sent to a replica counts as cached there without the replica's
# own event: long enough for a queued prefill, short enough that a request that never ran
# (aborted, refused) stops attracting its prefix's traffic soon.
PENDING_SECONDS = 30.0
# What a matched block is worth to routing, by where it lives (the module's docstring).
MEDIUM_WEIGHTS = {DEVICE: 1.0, HOST: 0.5, DISK: 0.25}


class PrefixIndex:
    def __init__(
        self, pending_seconds: float = PENDING_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pending_seconds = pending_seconds
        self._clock = clock
        self._stored: dict[int, str] = {}  # hash -> medium
        self._pending: dict[int, float] = {}  # hash -> when it stops counting

    def __len__(self) -> int:
        """Blocks the replica has announced as cached (on any medium)."""
        return len(self._stored)

    def medium(self, block_hash: int) -> str | None:
        """Where the replica holds the block (None: not announced as stored)."""
        return self._stored.get(block_hash)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` the replica holds (stored, or pending and fresh)."""
        return self.score(hashes)[0]

    def score(self, hashes: Sequence[int]) -> tuple[int, float]:
        """How many leading ``hashes`` the replica holds, and what they weigh (the module's
        docstring: device and pending blocks 1, host-tier 0.5, disk 0.25)."""
        now = self._clock()
        n, weight = 0, 0.0
        for h in hashes:
            until = self._pending.get(h)
            if until is not None and until >= now:
                weight += 1.0
            else:
                medium = self._stored.get(h)
                if medium is None:
                    break
                weight += MEDIUM_WEIGHTS[medium]
            n += 1
        return n, weight

    def add_pending(self, hashes: Iterable[int]) -> None:
        """The router sent a prompt with these blocks there: count them as on the device
        until the replica announces them (or ``pending_seconds`` pass)."""
        until = self._clock() + self.pending_seconds
        for h in hashes:
            if self._stored.get(h) != DEVICE:
                self._pending[h] = until
        if len(self._pending) > 4 * len(self._stored) + 4096:  # drop expired ones, amortised
            now = self._clock()
            self._pending = {h: t for h, t in self._pending.items() if t >= now}

    def apply(self, event: KvEvent | dict[str, Any]) -> None:
        """Follow one KV event of the replica (a :class:`KvEvent` or its ``to_dict()``; a
        stored event without ``medium`` is on the device)."""
        if isinstance(event, KvEvent):
            kind, hashes, medium = event.kind, event.hashes, event.medium
        else:
            kind, hashes, medium = event["kind"], event["hashes"], event.get("medium", DEVICE)
        if kind == STORED:
            if medium not in MEDIUM_WEIGHTS:
                raise ValueError(f"unknown KV event medium {medium!r}")
            for h in hashes:
                self._stored[h] = medium
                self._pending.pop(h, None)
        elif kind == REMOVED:
            for h in hashes:
                self._stored.pop(h, None)
        elif kind == CLEARED:
            self._stored.clear()
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")

    def reset(self, stored: Iterable[int] | Mapping[int, str] = ()) -> None:
        """Forget everything (the replica restarted, or its events were missed), keeping only
        ``stored``: a fresh snapshot of what it holds (hash -> medium; bare hashes: on the
        device)."""
        if isinstance(stored, Mapping):
            self._stored = dict(stored)
        else:
            self._stored = dict.fromkeys(stored, DEVICE)
        self._pending.clear()
