"""The router's prefix index against a reference trie of token prefixes (no Ray, no engine)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from radixlang.cluster.prefix_index import PrefixIndex
from radixlang.runtime.kv_events import (
    CLEARED,
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
