"""Which replica a request goes to.

``cache_aware`` (the default): the replica holding the longest cached prefix of the prompt
(its :class:`PrefixIndex`), unless that replica is busier than the least loaded one by more
than ``balance_abs`` requests *and* by more than ``balance_rel`` times; then, or when no
replica holds any of the prompt, the least loaded one. A request with a routing key (the
program, chat or fork group it belongs to) goes where its key's earlier requests went, unless
that replica is down or past the same load limit. ``round_robin``: each healthy replica in
turn, for comparison.

The load of a replica is its requests in flight, counted by the caller (``started`` /
``finished``). Plain Python, no Ray: the replica set calls it under its own lock.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from radixlang.cluster.prefix_index import PrefixIndex
from radixlang.runtime.kv_events import block_hashes

POLICIES = ("cache_aware", "round_robin")
# Routing keys remembered (the least recently used are forgotten past this).
MAX_KEYS = 65536
# A replica counts as overloaded past this many requests in flight more than the least loaded
# (and this many times its load). With 16 clients forking at once a 4-request imbalance is
# routine; SGLang's router uses 32.
BALANCE_ABS = 16
BALANCE_REL = 1.5


class NoReplicaError(RuntimeError):
    """No replica is up to take the request."""


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # "prefix", "key", "load" or "round_robin"
    matched_tokens: int  # the prompt's tokens the router believes cached there


class Router:
    def __init__(
        self,
        num_replicas: int,
        block_size: int,
        policy: str = "cache_aware",
        balance_abs: int = BALANCE_ABS,
        balance_rel: float = BALANCE_REL,
        max_keys: int = MAX_KEYS,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.policy = policy
        self.block_size = block_size
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.indexes = [PrefixIndex() for _ in range(num_replicas)]
        self.loads = [0] * num_replicas
        self.healthy = [True] * num_replicas
        self._keys: collections.OrderedDict[str, int] = collections.OrderedDict()
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
    ) -> Route:
        """Pick a replica for a prompt (None: its tokens are unknown; route by load) and note
        its prompt there as pending. Raises :class:`NoReplicaError` when none is up."""
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
        self.decisions[route.reason] += 1
        return route

    def started(self, replica: int) -> None:
        self.loads[replica] += 1

    def finished(self, replica: int) -> None:
        self.loads[replica] = max(0, self.loads[replica] - 1)

    def set_healthy(self, replica: int, healthy: bool) -> None:
        """Take a replica out of rotation or back; either way its index is dropped (a replica
        that comes back is a fresh engine, and announces what it holds anew)."""
        self.healthy[replica] = healthy
        self.indexes[replica].reset()
        if not healthy:
            self.loads[replica] = 0
            for key in [k for k, r in self._keys.items() if r == replica]:
                del self._keys[key]

    # ---- policies --------------------------------------------------------------------------
    def _round_robin(self, up: list[int]) -> Route:
        replica = up[self._turn % len(up)]
        self._turn += 1
        return Route(replica, "round_robin", 0)

    def _overloaded(self, replica: int, up: list[int]) -> bool:
        least = min(self.loads[r] for r in up)
        load = self.loads[replica]
        return load - least > self.balance_abs and load > self.balance_rel * least

    def _least_loaded(self, up: list[int]) -> int:
        # Ties: the replica holding fewer blocks (more room), then the next in turn.
        self._turn += 1
        n = len(up)
        order = [up[(self._turn + i) % n] for i in range(n)]
        return min(order, key=lambda r: (self.loads[r], len(self.indexes[r])))

    def _cache_aware(self, up: list[int], hashes: list[int], routing_key: str | None) -> Route:
        matches = {r: self.indexes[r].match(hashes) for r in up}
        if routing_key is not None:
            keyed = self._keys.get(routing_key)
            if keyed in matches and not self._overloaded(keyed, up):
                return Route(keyed, "key", matches[keyed] * self.block_size)
        best = max(up, key=lambda r: (matches[r], -self.loads[r]))
        if matches[best] and not self._overloaded(best, up):
            return Route(best, "prefix", matches[best] * self.block_size)
        replica = self._least_loaded(up)
        return Route(replica, "load", matches[replica] * self.block_size)
