"""Tier residency in routing, from a real engine: a tiny engine with a host tier announces its
blocks' medium as they move (evicted into the tier: ``host``; loaded back: ``device``), a
router's index follows, and routing prefers a replica holding a prompt's prefix on the device
over one holding it in the host tier, and that one over a replica holding none."""

from __future__ import annotations

import random

import pytest

from radixlang.cluster.prefix_index import PrefixIndex
from radixlang.cluster.router import Router
from radixlang.runtime.kv_events import DEVICE, HOST, STORED, KvEvent, block_hashes

BS = 4
ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(chat_model_dir):
    from radixlang.runtime.engine import Engine

    # 24 blocks of 4 tokens: two 40-token prompts fit, a third evicts the oldest into the tier.
    e = Engine(
        str(chat_model_dir),
        dtype="float32",
        num_blocks=24,
        block_size=BS,
        host_tier_memory="2MiB",
        max_running_requests=1,
        kv_events=True,
        background=False,
    )
    yield e
    e.shutdown(free_cache=True)


class Follower:
    """A router's view of the engine, kept from its KV events (as a replica set's poller)."""

    def __init__(self, engine, index: PrefixIndex) -> None:
        self.engine, self.index, self.seq = engine, index, 0

    def catch_up(self) -> None:
        events, gap = self.engine.kv_events_since(self.seq)
        assert not gap
        for event in events:
            self.index.apply(event.to_dict() if event.seq % 2 else event)  # both forms
            self.seq = event.seq


def test_medium_events_reach_the_index_and_routing_weighs_them(engine):
    rng = random.Random(0)
    a, b, c = ([rng.randrange(10, 1000) for _ in range(40)] for _ in range(3))
    router = Router(3, BS)
    view = Follower(engine, router.indexes[0])
    a_hashes = block_hashes(a, BS)

    engine.generate([a], [ONE_TOKEN])
    view.catch_up()
    assert [view.index.medium(h) for h in a_hashes] == [DEVICE] * 10

    # Two more prompts: the pool cannot hold all three, and A, the oldest, goes to the tier.
    engine.generate([b], [ONE_TOKEN])
    engine.generate([c], [ONE_TOKEN])
    assert engine.stats()["tier_written_blocks_total"] > 0
    view.catch_up()
    assert [view.index.medium(h) for h in a_hashes] == [HOST] * 10
    assert view.index.score(a_hashes) == (10, 5.0)
    engine.check_integrity()

    # Routing: replica 0 holds A in its tier, replica 2 nothing: 0 wins, the whole prefix
    # reported. With replica 1 holding A on its device, 1 wins.
    route = router.choose([*a, 7])
    assert (route.replica, route.reason, route.matched_tokens) == (0, "prefix", 40)
    router = Router(3, BS)
    view = Follower(engine, router.indexes[0])  # afresh: the first router has A pending on 0
    view.catch_up()
    router.indexes[1].apply(KvEvent(1, STORED, tuple(a_hashes), medium=DEVICE))
    route = router.choose([*a, 7])
    assert (route.replica, route.reason, route.matched_tokens) == (1, "prefix", 40)

    # A's next request loads it back: announced on the device again.
    engine.generate([[*a, 7, 8]], [ONE_TOKEN])
    assert engine.stats()["tier_loaded_tokens"] >= 40
    view.catch_up()
    assert [view.index.medium(h) for h in a_hashes] == [DEVICE] * 10
    # The view holds exactly what the cache does, each block on its medium.
    media = {h: m for _, hashes, m in engine.kv_block_media()[1] for h in hashes}
    assert {h: view.index.medium(h) for h in media} == media and len(view.index) == len(media)
    assert HOST in media.values(), "B or C went to the tier to make room for A"
