"""The router's prefix index against a reference trie of token prefixes (no Ray, no engine)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlang.cluster.prefix_index import PrefixIndex
from radixlang.runtime.kv_events import (
    CLEARED,
    DEVICE,
    DISK,
    HOST,
    REMOVED,
    STORED,
    KvEvent,
    KvEventLog,
    block_hashes,
    chain_hash,
    salt_seed,
)

BS = 4
sequences = st.lists(st.integers(0, 3), min_size=0, max_size=20)


def stored(tokens, salt="", seq=1) -> KvEvent:
    return KvEvent(seq, STORED, tuple(block_hashes(tokens, BS, salt)))


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), sequences, st.sampled_from(["", "t"])), max_size=12),
    queries=st.lists(st.tuples(sequences, st.sampled_from(["", "t"])), min_size=1, max_size=8),
)
def test_match_is_the_longest_stored_prefix_to_the_block(ops, queries):
    """Store or remove whole sequences' blocks; a query matches as many blocks as the longest
    prefix it shares with a stored sequence of its salt (the reference: a set of prefixes)."""
    index = PrefixIndex()
    prefixes: set[tuple[str, tuple[int, ...]]] = set()
    for store, tokens, salt in ops:
        full = len(tokens) // BS * BS
        blocks = {(salt, tuple(tokens[:end])) for end in range(BS, full + 1, BS)}
        hashes = block_hashes(tokens, BS, salt)
        if store:
            index.apply(KvEvent(1, STORED, tuple(hashes)))
            prefixes |= blocks
        else:
            index.apply({"kind": REMOVED, "hashes": hashes})  # the JSON form is read too
            prefixes -= blocks
    for tokens, salt in queries:
        expected = 0
        while (salt, tuple(tokens[: (expected + 1) * BS])) in prefixes and (
            expected + 1
        ) * BS <= len(tokens):
            expected += 1
        assert index.match(block_hashes(tokens, BS, salt)) == expected


def test_hashes_chain_over_the_blocks_and_the_salt():
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    h = block_hashes(tokens, BS)
    assert len(h) == 2  # the ninth token is not a full block
    assert h[0] == chain_hash(0, tokens[:4]) and h[1] == chain_hash(h[0], tokens[4:8])
    assert block_hashes(tokens, BS, first=1) == h[1:]
    assert block_hashes(tokens, BS, first=1, previous=h[0]) == h[1:]
    assert block_hashes(tokens, BS, "t")[0] == chain_hash(salt_seed("t"), tokens[:4]) != h[0]
    assert (
        block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)[1]
        != block_hashes([0, 2, 3, 4, 5, 6, 7, 8], BS)[1]
    )


def test_pending_prefixes_count_until_they_expire_or_are_stored():
    now = [0.0]
    index = PrefixIndex(pending_seconds=10, clock=lambda: now[0])
    hashes = block_hashes(list(range(12)), BS)
    index.add_pending(hashes[:2])
    assert index.match(hashes) == 2 and len(index) == 0
    now[0] = 11.0
    assert index.match(hashes) == 0, "a pending prefix the replica never stored expires"
    index.add_pending(hashes)
    index.apply(stored(list(range(8))))
    now[0] = 30.0
    assert index.match(hashes) == 2, "stored blocks do not expire"


def test_cleared_and_reset_forget_everything():
    index = PrefixIndex()
    index.apply(stored(list(range(8))))
    index.apply(KvEvent(2, CLEARED))
    assert index.match(block_hashes(list(range(8)), BS)) == 0
    index.reset(block_hashes(list(range(8)), BS))
    assert index.match(block_hashes(list(range(8)), BS)) == 2


def test_event_log_numbers_events_and_reports_a_gap():
    log = KvEventLog(capacity=3)
    for i in range(5):
        log.append(STORED, [i])
    events, gap = log.since(0)
    assert gap and [e.seq for e in events] == [3, 4, 5]
    events, gap = log.since(3)
    assert not gap and [e.hashes for e in events] == [(3,), (4,)]
    assert log.since(5) == ([], False) and log.last_seq == 5


def test_each_block_keeps_the_medium_of_its_latest_stored_event():
    index = PrefixIndex()
    tokens = list(range(16))
    hashes = block_hashes(tokens, BS)
    index.apply(stored(tokens))
    assert [index.medium(h) for h in hashes] == [DEVICE] * 4
    assert index.score(hashes) == (4, 4.0)
    # The last two blocks go to the host tier (JSON form, as GET /kv_events serves it) ...
    index.apply({"kind": STORED, "hashes": hashes[2:], "medium": HOST})
    assert index.score(hashes) == (4, 3.0) and index.match(hashes) == 4 and len(index) == 4
    # ... the last to disk, and the third back to the device.
    index.apply(KvEvent(3, STORED, (hashes[3],), medium=DISK))
    index.apply(KvEvent(4, STORED, (hashes[2],), medium=DEVICE))
    assert [index.medium(h) for h in hashes] == [DEVICE, DEVICE, DEVICE, DISK]
    assert index.score(hashes) == (4, 3.25)
    # A stored event without a medium (an older engine's) is on the device.
    index.apply({"kind": STORED, "hashes": hashes[3:]})
    assert index.score(hashes) == (4, 4.0)
    index.apply({"kind": REMOVED, "hashes": hashes[1:]})
    assert index.score(hashes) == (1, 1.0) and index.medium(hashes[1]) is None
    with pytest.raises(ValueError, match="medium"):
        index.apply({"kind": STORED, "hashes": hashes, "medium": "tape"})


def test_a_prefix_sent_to_a_replica_counts_as_on_its_device_until_announced():
    now = [0.0]
    index = PrefixIndex(pending_seconds=10, clock=lambda: now[0])
    hashes = block_hashes(list(range(12)), BS)
    index.apply(KvEvent(1, STORED, tuple(hashes), medium=HOST))
    index.add_pending(hashes[:2])  # the request sent there loads them back
    assert index.score(hashes) == (3, 2.5)
    index.apply(KvEvent(2, STORED, tuple(hashes[:1]), medium=DEVICE))
    now[0] = 11.0  # the second never came back: in the tier, as announced last
    assert index.score(hashes) == (3, 2.0)


def test_reset_takes_each_blocks_medium():
    index = PrefixIndex()
    hashes = block_hashes(list(range(8)), BS)
    index.reset({hashes[0]: DEVICE, hashes[1]: HOST})
    assert index.score(hashes) == (2, 1.5)
    index.reset(hashes)  # bare hashes: on the device
    assert index.score(hashes) == (2, 2.0)


def test_events_say_their_medium_in_json_for_stored_events_only():
    assert KvEvent(1, STORED, (5,), None, 0, HOST).to_dict() == {
        "seq": 1, "kind": "stored", "hashes": [5], "parent": None, "salt_seed": 0,
        "medium": "host"}  # fmt: skip
    assert "medium" not in KvEvent(2, REMOVED, (5,)).to_dict()
    log = KvEventLog()
    log.append(STORED, [1], medium=HOST)
    log.append(STORED, [2])
    assert [e.medium for e in log.since(0)[0]] == [HOST, DEVICE]
