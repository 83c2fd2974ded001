"""Which replica a request goes to.

``cache_aware`` (the default) tries, in order:

1. ``retained``: a request whose routing key holds *retained* paths on a replica goes there,
   unless that replica is down or overloaded by a much larger margin than for the rules below
   (``retained_balance_abs`` requests over the least loaded, 4 x ``balance_abs`` unless set,
   *and* ``balance_rel`` times its load): moving a program paused at a tool call would compute
   its whole context again elsewhere. A key holds retained paths on the replica that its last
   request asking ``retain_s > 0`` went to, until the latest deadline of those requests (their
   routing or their finish, plus ``retain_s``), until the key is released
   (:meth:`Router.release_retained`: the program ended), until the replica goes down, or until
   a request of the key without ``retain_s`` goes elsewhere.
2. ``key``: a request with a routing key (the program, chat or fork group it belongs to) goes
   where its key's earlier requests went, unless that replica is down or overloaded: busier
   than the least loaded one by more than ``balance_abs`` requests *and* by more than
   ``balance_rel`` times.
3. ``prefix``: the replica whose cached prefix of the prompt weighs most, unless overloaded. A
   matched block weighs by where the replica holds it: on the device 1, in the host tier 0.5,
   on disk 0.25 (``prefix_index.py``), so of two replicas holding a prefix the one holding it
   on the device wins, and a replica holding it in its host tier beats one holding none. Ties:
   the less loaded.
4. ``load``: the least loaded replica (also when no replica holds any of the prompt).

``round_robin``: each healthy replica in turn, for comparison (keys and retentions are noted
but do not route).

The load of a replica is its requests in flight, counted by the caller (``started`` /
``finished``). Plain Python, no Ray: the replica set calls it under its own lock.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixlang.cluster.prefix_index import PrefixIndex
from radixlang.runtime.kv_events import block_hashes

POLICIES = ("cache_aware", "round_robin")
# Every Route.reason, for counters and metrics.
REASONS = ("retained", "key", "prefix", "load", "round_robin")
# Routing keys remembered (the least recently used are forgotten past this), and as many
# retentions.
MAX_KEYS = 65536
# A replica counts as overloaded past this many requests in flight more than the least loaded
# (and this many times its load). With 16 clients forking at once a 4-request imbalance is
# routine; SGLang's router uses 32.
BALANCE_ABS = 16
BALANCE_REL = 1.5
# A retained key leaves its replica only past this many times ``balance_abs`` (unless
# ``retained_balance_abs`` is given).
RETAINED_BALANCE_FACTOR = 4


class NoReplicaError(RuntimeError):
    """No replica is up to take the request."""


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # one of REASONS
    matched_tokens: int  # the prompt's tokens the router believes cached there (any medium)


class Router:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        policy: str = "cache_aware",
        balance_abs: int = BALANCE_ABS,
        balance_rel: float = BALANCE_REL,
        max_keys: int = MAX_KEYS,
        retained_balance_abs: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.policy = policy
        self.block_size = block_size
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        # None: RETAINED_BALANCE_FACTOR x balance_abs, whatever balance_abs is at the time.
        self.retained_balance_abs = retained_balance_abs
        self._clock = clock
        self.indexes = [PrefixIndex(clock=clock) for _ in range(num_replicas)]
        self.loads = [0] * num_replicas
        self.healthy = [True] * num_replicas
        self._keys: collections.OrderedDict[str, int] = collections.OrderedDict()
        # Keys holding retained paths: key -> (replica, deadline on the clock).
        self._retained: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        self._max_keys = max_keys
        self._turn = 0
        self.decisions: collections.Counter[str] = collections.Counter()

    @property
    def num_replicas(self) -> int:
        return len(self.loads)

    def choose(
        self,
        prompt_ids: Sequence[int] | None,
        salt: str = "",
        routing_key: str | None = None,
        exclude: frozenset[int] = frozenset(),
        retain_s: float = 0.0,
    ) -> Route:
        """Pick a replica for a prompt (None: its tokens are unknown; route by load) and note
        its prompt there as pending; a request with a key and ``retain_s > 0`` (its path is to
        be retained when it ends) makes the key retained on that replica. Raises
        :class:`NoReplicaError` when none is up."""
        up = [r for r in range(self.num_replicas) if self.healthy[r] and r not in exclude]
        if not up:
            raise NoReplicaError("no replica is up")
        if self.policy == "round_robin":
            route = self._round_robin(up)
        else:
            hashes = block_hashes(prompt_ids, self.block_size, salt) if prompt_ids else []
            route = self._cache_aware(up, hashes, routing_key)
            self.indexes[route.replica].add_pending(hashes)
        if routing_key is not None:
            self._keys[routing_key] = route.replica
            self._keys.move_to_end(routing_key)
            if len(self._keys) > self._max_keys:
                self._keys.popitem(last=False)
            if retain_s > 0:
                self._retain(routing_key, route.replica, self._clock() + retain_s)
            elif self.retained_replica(routing_key) not in (None, route.replica):
                # The key moved on without retaining: its context now grows elsewhere.
                del self._retained[routing_key]
        self.decisions[route.reason] += 1
        return route

    def started(self, replica: int) -> None:
        self.loads[replica] += 1

    def finished(self, replica: int) -> None:
        self.loads[replica] = max(0, self.loads[replica] - 1)

    def extend_retention(self, routing_key: str, replica: int, retain_s: float) -> None:
        """A request of ``routing_key`` that asked ``retain_s`` ended on ``replica`` (its path
        retained from now): the key's retention there lasts ``retain_s`` from now at least.
        Ignored where the key's retention has moved to another replica meanwhile."""
        if retain_s > 0 and self.retained_replica(routing_key) in (None, replica):
            self._retain(routing_key, replica, self._clock() + retain_s)

    def release_retained(self, routing_key: str) -> bool:
        """The key's program ended (its retentions released): it routes as a plain key from
        now on. Returns whether it held a retention."""
        return self._retained.pop(routing_key, None) is not None

    def retained_replica(self, routing_key: str) -> int | None:
        """The replica where ``routing_key`` holds retained paths (None: nowhere, or lapsed)."""
        entry = self._retained.get(routing_key)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._retained[routing_key]
            return None
        return entry[0]

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """Take a replica out of rotation or back; either way its index is dropped (a replica
        that comes back is a fresh engine, and announces what it holds anew), and so are the
        retentions on it (gone with its cache)."""
        self.healthy[replica] = healthy
        self.indexes[replica].reset()
        for key in [k for k, (r, _) in self._retained.items() if r == replica]:
            del self._retained[key]
        if not healthy:
            self.loads[replica] = 0
            for key in [k for k, r in self._keys.items() if r == replica]:
                del self._keys[key]

    # ---- retention -------------------------------------------------------------------------
    def _retain(self, routing_key: str, replica: int, deadline: float) -> None:
        entry = self._retained.get(routing_key)
        if entry is not None and entry[0] == replica:
            deadline = max(deadline, entry[1])
        self._retained[routing_key] = (replica, deadline)
        self._retained.move_to_end(routing_key)
        if len(self._retained) > self._max_keys:
            now = self._clock()
            for key in [k for k, (_, until) in self._retained.items() if until <= now]:
                del self._retained[key]
            while len(self._retained) > self._max_keys:
                self._retained.popitem(last=False)

    # ---- policies --------------------------------------------------------------------------
    def _round_robin(self, up: list[int]) -> Route:
        replica = up[self._turn % len(up)]
        self._turn += 1
        return Route(replica, "round_robin", 0)

    def _overloaded(self, replica: int, up: list[int], margin: int | None = None) -> bool:
        least = min(self.loads[r] for r in up)
        load = self.loads[replica]
        margin = self.balance_abs if margin is None else margin
        return load - least > margin and load > self.balance_rel * least

    def _retained_margin(self) -> int:
        if self.retained_balance_abs is not None:
            return self.retained_balance_abs
        return RETAINED_BALANCE_FACTOR * self.balance_abs

    def _least_loaded(self, up: list[int]) -> int:
        # Ties: the replica holding fewer blocks (more room), then the next in turn.
        self._turn += 1
        n = len(up)
        order = [up[(self._turn + i) % n] for i in range(n)]
        return min(order, key=lambda r: (self.loads[r], len(self.indexes[r])))

    def _cache_aware(self, up: list[int], hashes: list[int], routing_key: str | None) -> Route:
        scores = {r: self.indexes[r].score(hashes) for r in up}
        if routing_key is not None:
            retained = self.retained_replica(routing_key)
            if retained in scores and not self._overloaded(retained, up, self._retained_margin()):
                return Route(retained, "retained", scores[retained][0] * self.block_size)
            keyed = self._keys.get(routing_key)
            if keyed in scores and not self._overloaded(keyed, up):
                return Route(keyed, "key", scores[keyed][0] * self.block_size)
        best = max(up, key=lambda r: (scores[r][1], -self.loads[r]))
        if scores[best][0] and not self._overloaded(best, up):
            return Route(best, "prefix", scores[best][0] * self.block_size)
        replica = self._least_loaded(up)
        return Route(replica, "load", scores[replica][0] * self.block_size)
