"""The routing policies (no Ray): prefix affinity, load balance, routing keys, failures,
retained programs' affinity and the weight of a block by where a replica holds it."""

from __future__ import annotations

import pytest

from radixlang.cluster.router import NoReplicaError, Router
from radixlang.runtime.kv_events import DEVICE, HOST, STORED, KvEvent, block_hashes

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


# ---- retained programs: session affinity --------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def retained_router(clock: Clock | None = None, **kw) -> Router:
    """Two replicas; the program "agent" (retaining its paths for 60 s) and the chat "chat"
    both placed on replica 0."""
    router = Router(2, BS, balance_abs=4, balance_rel=1.5, clock=clock or Clock(), **kw)
    router.loads[:] = [0, 5]
    assert router.choose(DOC, routing_key="agent", retain_s=60).replica == 0
    assert router.choose(list(range(500, 540)), routing_key="chat").replica == 0
    assert router.retained_replica("agent") == 0 and router.retained_replica("chat") is None
    return router


def test_a_retained_key_stays_on_its_replica_under_load_that_moves_a_plain_key():
    router = retained_router()
    router.loads[:] = [12, 1]  # 11 more and 12x: past balance_abs (4), within 4 x 4
    chat = router.choose(list(range(500, 540)), routing_key="chat")
    assert (chat.replica, chat.reason) == (1, "load"), "the plain key moves to the idle replica"
    agent = router.choose([*DOC, 1, 2, 3, 4], routing_key="agent", retain_s=60)
    assert (agent.replica, agent.reason, agent.matched_tokens) == (0, "retained", 40)
    # Past the retained limit (4 x balance_abs = 16 more) it moves too, and its retention
    # with it (the request asked to retain its path there).
    router.loads[:] = [20, 1]
    moved = router.choose([*DOC, 1, 2, 3, 4], routing_key="agent", retain_s=60)
    assert moved.replica == 1 and moved.reason != "retained"
    assert router.retained_replica("agent") == 1
    assert router.decisions["retained"] == 1


def test_the_retained_limit_can_be_set():
    router = retained_router(retained_balance_abs=100)
    router.loads[:] = [60, 1]
    assert router.choose(DOC, routing_key="agent").reason == "retained"
    router.loads[:] = [102, 1]
    assert router.choose(DOC, routing_key="agent").replica == 1


def test_a_retained_key_moves_when_its_replica_is_down_or_refuses():
    router = retained_router()
    route = router.choose(DOC, routing_key="agent", exclude=frozenset({0}))
    assert route.replica == 1 and route.reason != "retained"
    assert router.retained_replica("agent") is None, "moved on without retaining: dropped"

    router = retained_router()
    router.set_healthy(0, False)
    assert router.retained_replica("agent") is None, "its paths went with the replica"
    route = router.choose(DOC, routing_key="agent", retain_s=60)
    assert route.replica == 1 and route.reason == "load"
    assert router.retained_replica("agent") == 1
    router.set_healthy(0, True)
    router.loads[:] = [0, 12]
    assert router.choose(DOC, routing_key="agent").reason == "retained"


def test_release_clears_the_affinity():
    router = retained_router()
    assert router.release_retained("agent") and not router.release_retained("agent")
    assert router.retained_replica("agent") is None
    router.loads[:] = [12, 1]
    route = router.choose(DOC, routing_key="agent")
    assert route.replica == 1, "a released key is a plain key: overloaded, it moves"


def test_a_retention_lapses_at_its_deadline_and_a_finish_extends_it():
    clock = Clock()
    router = retained_router(clock)  # retained until 160
    router.loads[:] = [12, 1]
    clock.now = 150.0
    router.extend_retention("agent", 1, 60)  # another replica's finish: not where it is kept
    router.extend_retention("agent", 0, 5)  # ends before the deadline it has: no change
    assert router.choose(DOC, routing_key="agent").reason == "retained"
    clock.now = 159.0
    router.extend_retention("agent", 0, 60)  # the request ended: retained from now
    clock.now = 200.0
    assert router.choose(DOC, routing_key="agent").reason == "retained"
    clock.now = 218.5
    assert router.retained_replica("agent") == 0
    clock.now = 219.0
    assert router.retained_replica("agent") is None, "lapsed at 159 + 60"
    route = router.choose(DOC, routing_key="agent")
    assert route.replica == 1 and route.reason != "retained"


def test_retentions_are_bounded_like_keys():
    clock = Clock()
    router = Router(2, BS, clock=clock, max_keys=3)
    for i in range(3):
        router.choose([i], routing_key=f"k{i}", retain_s=10)
    clock.now += 20  # all lapsed
    router.choose([9], routing_key="fresh", retain_s=10)
    assert len(router._retained) == 1 and router.retained_replica("fresh") is not None


# ---- tier residency: a device block outweighs a host-tier one -----------------------------
def store_on(router: Router, replica: int, tokens: list[int], medium: str) -> None:
    event = KvEvent(1, STORED, tuple(block_hashes(tokens, BS)), medium=medium)
    router.indexes[replica].apply(event)


def test_a_device_prefix_beats_a_host_tier_one_which_beats_none():
    router = Router(3, BS)
    store_on(router, 0, DOC, HOST)
    store_on(router, 1, DOC, DEVICE)
    route = router.choose([*DOC, 5])
    assert (route.replica, route.reason, route.matched_tokens) == (1, "prefix", 40)

    router = Router(3, BS)
    router.loads[:] = [1, 0, 0]  # the host-tier holder is even the busier one
    store_on(router, 0, DOC, HOST)
    route = router.choose([*DOC, 5])
    assert (route.replica, route.reason, route.matched_tokens) == (0, "prefix", 40)


def test_a_match_weighs_its_blocks_by_medium_but_reports_its_whole_length():
    # Ten blocks in the host tier (5.0) outweigh four on the device (4.0), not six (6.0).
    for device_blocks, winner in ((4, 0), (6, 1)):
        router = Router(2, BS)
        store_on(router, 0, DOC, HOST)
        store_on(router, 1, DOC[: device_blocks * BS], DEVICE)
        route = router.choose(DOC)
        assert route.replica == winner
        assert route.matched_tokens == (40 if winner == 0 else device_blocks * BS)
    # A prefix half on the device, half in the tier (the tier's end of a path).
    router = Router(2, BS)
    store_on(router, 0, DOC, HOST)
    store_on(router, 0, DOC[:20], DEVICE)
    assert router.indexes[0].score(block_hashes(DOC, BS)) == (10, 7.5)
