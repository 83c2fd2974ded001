"""The routing policies (no Ray): prefix affinity, load balance, routing keys, failures."""

from __future__ import annotations

import pytest

from radixlang.cluster.router import NoReplicaError, Router
from radixlang.runtime.kv_events import STORED, KvEvent, block_hashes

BS = 4
DOC = list(range(100, 140))  # ten blocks


def store(router: Router, replica: int, tokens: list[int]) -> None:
    router.indexes[replica].apply(KvEvent(1, STORED, tuple(block_hashes(tokens, BS))))


def test_the_replica_with_the_longest_cached_prefix_wins():
    router = Router(3, BS)
    store(router, 1, DOC[:8])
    store(router, 2, DOC[:24])
    route = router.choose([*DOC, 1, 2])
    assert (route.replica, route.reason, route.matched_tokens) == (2, "prefix", 24)


def test_a_new_prefix_goes_to_the_least_loaded_and_its_followers_join_it():
    router = Router(2, BS)
    router.loads[:] = [3, 0]
    first = router.choose(DOC)
    assert (first.replica, first.reason) == (1, "load")
    router.started(first.replica)
    # Before the replica stores it, the prompt just routed counts as pending there.
    second = router.choose([*DOC, 7, 7, 7, 7])
    assert (second.replica, second.reason, second.matched_tokens) == (1, "prefix", 40)


def test_an_overloaded_replica_loses_its_prefix_traffic():
    def routed(loads: list[int]):
        router = Router(2, BS, balance_abs=4, balance_rel=1.5)
        store(router, 0, DOC)
        router.loads[:] = loads
        return router.choose(DOC)

    assert (routed([6, 1]).replica, routed([6, 1]).reason) == (1, "load")  # 5 more and 6x
    assert routed([5, 1]).replica == 0  # only 4 more: within balance_abs
    assert routed([12, 9]).replica == 0  # 3 more is within it, and 12 < 1.5 x 9


def test_a_routing_key_keeps_a_program_together():
    router = Router(2, BS)
    router.loads[:] = [0, 2]
    a = router.choose([1, 2, 3], routing_key="chat-1")
    router.started(a.replica)
    router.loads[1 - a.replica] = 0
    b = router.choose([9, 9, 9, 9, 9], routing_key="chat-1")  # nothing in common but the key
    assert b.replica == a.replica and b.reason == "key"


def test_round_robin_takes_turns_and_ignores_prefixes():
    router = Router(2, BS, policy="round_robin")
    store(router, 0, DOC)
    assert [router.choose(DOC).replica for _ in range(4)] == [0, 1, 0, 1]


def test_a_replica_down_leaves_the_rotation_and_its_view():
    router = Router(2, BS)
    store(router, 0, DOC)
    router.choose(DOC, routing_key="k")
    router.set_healthy(0, False)
    route = router.choose(DOC, routing_key="k")
    assert route.replica == 1
    router.set_healthy(0, True)
    assert router.indexes[0].match(block_hashes(DOC, BS)) == 0, "a restarted replica is empty"
    router.set_healthy(1, False)
    router.set_healthy(0, False)
    with pytest.raises(NoReplicaError):
        router.choose(DOC)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="routing policy"):
        Router(2, BS, policy="random")
    with pytest.raises(ValueError, match="num_replicas"):
        Router(0, BS)
