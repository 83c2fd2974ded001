from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kv_sim import SlotStore, SlotTier, release, serve

from radixlang.runtime.block_pool import BlockPool, IntegrityError, OutOfBlocksError
from radixlang.runtime.radix_cache import (
    CacheInUseError,
    RadixCache,
    StaleHandleError,
    common_prefix_len,
)

BS = 4


def make_cache(num_blocks: int = 32, block_size: int = BS) -> tuple[RadixCache, SlotStore]:
    store = SlotStore(num_blocks, block_size)
    pool = BlockPool(num_blocks, block_size, copy_hook=store.copy)
    return RadixCache(pool), store


def held_refs(*served) -> Counter:
    return Counter(b for s in served for b in s.blocks)


def insert_fresh(cache: RadixCache, store: SlotStore, tokens: list[int]) -> list[int]:
    """Insert a sequence computed from scratch and drop the writer's references."""
    blocks = cache.pool.alloc(cache.pool.blocks_for_tokens(len(tokens)))
    store.write(tokens, blocks, 0)
    cache.insert(tokens, blocks)
    cache.pool.decref(blocks)
    return blocks


def test_empty_key():
    cache, _ = make_cache()
    m = cache.match_prefix([])
    assert (m.length, m.blocks, m.handle.length) == (0, [], 0)
    assert cache.insert([], []) == 0
    cache.lock(m.handle)
    cache.unlock(m.handle)
    assert cache.num_nodes == 0
    cache.check_integrity({})


def test_miss_on_empty_cache_and_on_unknown_first_token():
    cache, store = make_cache()
    assert cache.match_prefix([1, 2, 3]).length == 0
    insert_fresh(cache, store, [1, 2, 3])
    assert cache.match_prefix([9, 2, 3]).length == 0


def test_full_match_returns_the_inserted_blocks():
    cache, store = make_cache()
    tokens = list(range(10))
    blocks = insert_fresh(cache, store, tokens)
    m = cache.match_prefix(tokens)
    assert m.length == 10 and m.blocks == blocks
    assert store.read_ok(tokens, m.blocks, 10)
    # A longer query matches the whole cached sequence and no more.
    assert cache.match_prefix([*tokens, 77, 78]).length == 10
    cache.check_integrity({})


def test_match_ending_inside_a_node_splits_it():
    cache, store = make_cache()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    blocks = insert_fresh(cache, store, tokens)
    assert cache.num_nodes == 1
    m = cache.match_prefix([1, 2, 3, 4, 5, 9])
    assert m.length == 5 and m.handle.length == 5
    assert cache.num_nodes == 2
    assert m.blocks == blocks  # the second block is partial: 1 of 4 slots belongs to the match
    # The cut falls inside block 1, so both halves hold it.
    assert cache.pool.refcount(blocks[1]) == 2
    assert cache.match_prefix(tokens).length == 8
    assert cache.cached_tokens == 8
    cache.check_integrity({})


def test_split_on_a_block_boundary_shares_no_block():
    cache, store = make_cache()
    blocks = insert_fresh(cache, store, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match_prefix([1, 2, 3, 4, 0]).length == 4
    assert cache.num_nodes == 2
    assert [cache.pool.refcount(b) for b in blocks] == [1, 1]
    cache.check_integrity({})


def test_match_ending_inside_a_block_copies_only_valid_slots_on_write():
    cache, store = make_cache()
    first = serve(cache, store, [1, 2, 3, 4, 5, 6, 7])
    first_blocks = list(first.blocks)
    release(cache, first)
    # Shares 5 tokens: block 0 whole, block 1 partly (one slot).
    second = serve(cache, store, [1, 2, 3, 4, 5, 9, 9, 9, 9])
    assert second.cached == 5
    assert second.blocks[0] == first_blocks[0]
    assert second.blocks[1] != first_blocks[1]
    assert store.copies == [(first_blocks[1], second.blocks[1], 1)]
    release(cache, second)
    for seq in ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 9, 9, 9, 9]):
        m = cache.match_prefix(seq)
        assert m.length == len(seq)
        assert store.read_ok(seq, m.blocks, m.length), "copy-on-write corrupted a cached block"
    cache.check_integrity({})


def test_copy_on_write_leaves_the_cached_original_intact():
    cache, store = make_cache()
    insert_fresh(cache, store, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    shared = m.blocks[-1]
    before = list(store.slots[shared])
    cache.pool.incref(m.blocks)
    mine = cache.pool.copy_on_write(shared, m.length % BS)
    assert mine != shared
    store.slots[mine][2] = "appended"
    assert store.slots[shared] == before
    cache.pool.decref([*m.blocks[:-1], mine])
    cache.check_integrity({})


def test_inserting_an_already_cached_sequence_adopts_nothing():
    cache, store = make_cache()
    tokens = list(range(9))
    insert_fresh(cache, store, tokens)
    used = cache.pool.num_used
    dup = cache.pool.alloc(3)
    store.write(tokens, dup, 0)
    assert cache.insert(tokens, dup) == 9
    assert cache.num_nodes == 1
    assert cache.pool.decref(dup) == dup  # the caller's duplicates are freed on release
    assert cache.pool.num_used == used
    cache.check_integrity({})


def test_inserting_a_prefix_of_a_cached_sequence_splits_without_new_blocks():
    cache, store = make_cache()
    insert_fresh(cache, store, list(range(9)))
    dup = cache.pool.alloc(2)
    assert cache.insert(list(range(6)), dup) == 6
    assert cache.num_nodes == 2
    cache.pool.decref(dup)
    cache.check_integrity({})


def test_insert_extending_a_leaf_from_inside_its_last_block():
    cache, store = make_cache()
    first = serve(cache, store, [1, 2, 3, 4, 5, 6])
    # The same writer keeps going in its own last block (the tree only trusts slots 0-1 of it).
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    first.blocks += cache.pool.alloc(1)
    store.write(tokens, first.blocks, 6)
    assert cache.insert(tokens, first.blocks) == 6
    # The new leaf shares block 1 with its parent: it is counted once.
    assert cache.evictable_size() + cache.protected_size() == 3
    cache.check_integrity(held_refs(first))
    release(cache, first)
    m = cache.match_prefix(tokens)
    assert m.length == 10 and store.read_ok(tokens, m.blocks, 10)
    cache.check_integrity({})


def test_writer_extending_its_insert_under_another_writers_identical_tokens():
    # Seen with constrained decoding, where many requests emit the same tokens: writer A caches
    # [1..6] and keeps writing in its own block 1; writer B, which copied that block on write,
    # inserts the same next token (7) and a different one (8) under A's node. A then inserts
    # [1..6, 7, 9]: its new leaf (from position 7) holds A's block 1, which A's first node
    # holds too, while the node between them (B's, from 6) holds B's copy at that index.
    cache, store = make_cache()
    a = serve(cache, store, [1, 2, 3, 4, 5, 6])
    b = serve(cache, store, [1, 2, 3, 4, 5, 6, 7, 8])
    assert b.blocks[1] != a.blocks[1]
    a_tokens = [1, 2, 3, 4, 5, 6, 7, 9]
    store.write(a_tokens, a.blocks, 6)
    assert cache.insert(a_tokens, a.blocks) == 7
    # A's block 1 is held by two nodes on one ancestor chain: it is counted once.
    cache.check_integrity(held_refs(a, b))
    total = cache.evictable_size() + cache.protected_size()
    assert total == len({*a.blocks, *b.blocks})
    release(cache, a)
    release(cache, b)
    for tokens in (a_tokens, b.tokens):
        m = cache.match_prefix(tokens)
        assert m.length == 8 and store.read_ok(tokens, m.blocks, 8)
    cache.check_integrity({})
    assert cache.evict(100) and cache.pool.num_free == cache.pool.num_blocks


def test_insert_needs_a_block_per_block_of_tokens():
    cache, _ = make_cache()
    with pytest.raises(ValueError, match="need 3 blocks"):
        cache.insert(list(range(9)), [0, 1])


def test_insert_accepts_tensors_and_tuples():
    cache, store = make_cache()
    insert_fresh(cache, store, [5, 6, 7])
    blocks = cache.pool.alloc(1)
    assert cache.insert(torch.tensor([5, 6, 7, 8]), blocks) == 3
    cache.pool.decref(blocks)
    assert cache.match_prefix((5, 6, 7, 8)).length == 4
    assert cache.match_prefix(torch.tensor([5, 6])).length == 2


def test_lock_protects_the_whole_path_across_a_split():
    cache, store = make_cache()
    a = serve(cache, store, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # locked while it runs
    cache.pool.decref(a.blocks)  # only the lock protects the path now
    a.blocks = []
    locked_size = cache.protected_size()
    assert locked_size == 3 and cache.evictable_size() == 0
    # Another sequence diverges in the middle of the locked node: the node splits, and both
    # halves stay locked.
    b = serve(cache, store, [1, 2, 3, 4, 5, 6, 0, 0])
    release(cache, b)
    assert cache.num_nodes == 3
    assert cache.protected_size() == locked_size
    freed = cache.evict(100)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]).length == 10
    assert cache.peek_prefix_len([1, 2, 3, 4, 5, 6, 0, 0]) == 6
    assert all(cache.pool.refcount(f) == 0 for f in freed)
    cache.check_integrity({})
    cache.unlock(a.handle)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    cache.evict(100)
    assert cache.num_nodes == 0 and cache.pool.num_free == cache.pool.num_blocks


def test_locks_nest_and_unlock_without_lock_is_refused():
    cache, store = make_cache()
    insert_fresh(cache, store, [1, 2, 3])
    h = cache.match_prefix([1, 2, 3]).handle
    cache.lock(h)
    cache.lock(h)
    cache.unlock(h)
    assert cache.evict(10) == []
    cache.unlock(h)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(h)
    assert len(cache.evict(10)) == 1


def test_eviction_order_is_least_recently_used():
    cache, store = make_cache()
    a = insert_fresh(cache, store, [1, 1, 1])
    b = insert_fresh(cache, store, [2, 2, 2])
    c = insert_fresh(cache, store, [3, 3, 3])
    cache.match_prefix([1, 1])  # touches a's head (splitting a); its tail [1] stays old
    cache.match_prefix([3, 3, 3])
    # Oldest first: a's tail frees nothing (its block is shared with a's head), so eviction goes
    # on to b, which frees one block.
    assert cache.evict(1) == b
    assert cache.peek_prefix_len([1, 1, 1]) == 2
    assert cache.peek_prefix_len([2]) == 0
    assert cache.peek_prefix_len([3, 3, 3]) == 3
    assert cache.evict(1) == a  # a's head, a leaf now, is older than c
    assert cache.evict(1) == c
    assert cache.evict(1) == []
    cache.check_integrity({})


def test_eviction_makes_an_emptied_parent_a_candidate():
    cache, store = make_cache()
    insert_fresh(cache, store, [1, 2, 3, 4, 5, 6, 7, 8])
    insert_fresh(cache, store, [1, 2, 3, 4, 9, 9, 9, 9])
    assert cache.num_nodes == 3
    freed = cache.evict(3)  # both leaves (one block each), then their parent
    assert len(freed) == 3 and cache.num_nodes == 0
    cache.check_integrity({})


def test_eviction_never_touches_a_locked_path():
    cache, store = make_cache()
    a = serve(cache, store, [1, 2, 3, 4, 5])
    insert_fresh(cache, store, [1, 2, 3, 4, 5, 6, 7])
    insert_fresh(cache, store, [8, 8, 8, 8, 8])
    freed = cache.evict(1000)
    assert cache.peek_prefix_len([1, 2, 3, 4, 5]) == 5
    assert cache.peek_prefix_len([1, 2, 3, 4, 5, 6, 7]) == 5
    assert cache.peek_prefix_len([8]) == 0
    assert set(freed).isdisjoint(a.blocks)
    cache.check_integrity(held_refs(a))
    release(cache, a)
    cache.check_integrity({})


def test_evicting_a_node_whose_blocks_a_request_holds_frees_nothing():
    cache, store = make_cache()
    insert_fresh(cache, store, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 4, 5])
    cache.pool.incref(m.blocks)  # e.g. a fork sharing the blocks without locking the path
    assert cache.evict(1) == []
    assert cache.num_nodes == 0
    assert store.read_ok([1, 2, 3, 4, 5], m.blocks, 5)
    assert cache.pool.decref(m.blocks) == m.blocks


def test_sizes_count_shared_blocks_once():
    cache, store = make_cache()
    a = serve(cache, store, [1, 2, 3, 4, 5, 6])
    b = serve(cache, store, [1, 2, 3, 4, 5, 7])  # copies block 1 on write
    assert cache.num_nodes == 3
    # [1..5] holds 2 blocks. Both leaves hold a block at index 1: a's is the parent's own block
    # (a wrote both), b's is its copy. Three distinct blocks in all.
    assert len({*a.blocks, *b.blocks}) == 3
    assert cache.protected_size() == 3
    release(cache, a)
    release(cache, b)
    assert cache.protected_size() == 0 and cache.evictable_size() == 3
    assert len(cache.evict(100)) == 3
    assert cache.evictable_size() == 0


def test_pool_exhaustion_then_eviction_frees_room():
    cache, store = make_cache(num_blocks=4)
    a = serve(cache, store, list(range(12)))  # 3 of 4 blocks, locked
    with pytest.raises(OutOfBlocksError):
        serve(cache, store, [50] * 8)
    cache.check_integrity(held_refs(a))  # the failed request left nothing behind
    release(cache, a)
    assert cache.pool.num_free == 1 and cache.evictable_size() == 3
    freed = cache.evict(2 - cache.pool.num_free)
    assert len(freed) == 3
    b = serve(cache, store, [50] * 8)
    release(cache, b)
    cache.check_integrity({})


def test_flush_is_refused_while_locked_and_frees_everything_when_idle():
    cache, store = make_cache()
    a = serve(cache, store, [1, 2, 3, 4, 5, 6])
    insert_fresh(cache, store, [7, 7, 7, 7, 7])
    with pytest.raises(CacheInUseError):
        cache.flush()
    release(cache, a)
    held = {b for b in range(cache.pool.num_blocks) if cache.pool.refcount(b)}
    assert len(held) == 4
    assert sorted(cache.flush()) == sorted(held)
    assert cache.num_nodes == 0
    assert cache.pool.num_free == cache.pool.num_blocks
    assert cache.match_prefix([1, 2]).length == 0
    cache.check_integrity({})


def test_handles_of_evicted_paths_are_stale():
    cache, store = make_cache()
    insert_fresh(cache, store, [1, 2, 3])
    h = cache.match_prefix([1, 2, 3]).handle
    assert h.valid
    cache.evict(1)
    assert not h.valid
    with pytest.raises(StaleHandleError):
        cache.lock(h)


def test_peek_neither_splits_nor_touches():
    cache, store = make_cache()
    insert_fresh(cache, store, [1, 2, 3, 4, 5])
    insert_fresh(cache, store, [2, 2])
    assert cache.peek_prefix_len([1, 2, 3, 9]) == 3
    assert cache.num_nodes == 2
    cache.evict(1)  # [1..5] is older and peek did not refresh it
    assert cache.peek_prefix_len([1]) == 0 and cache.peek_prefix_len([2, 2]) == 2


def test_heap_of_candidates_stays_bounded_under_repeated_touches():
    cache, store = make_cache()
    insert_fresh(cache, store, [1, 2, 3])
    for _ in range(5000):
        cache.match_prefix([1, 2, 3])
    assert len(cache._heap) <= 2 * 1 + 64 + 1
    cache.check_integrity({})


def test_check_integrity_catches_a_corrupt_counter_and_a_corrupt_refcount():
    cache, store = make_cache()
    insert_fresh(cache, store, [1, 2, 3, 4, 5])
    cache._evictable_blocks += 1
    with pytest.raises(IntegrityError, match="evictable"):
        cache.check_integrity()
    cache._evictable_blocks -= 1
    cache.check_integrity({})
    node = next(iter(cache.root.children.values()))
    with pytest.raises(IntegrityError, match="refcount 1 but 2"):
        cache.check_integrity({node.blocks[0]: 1})


def test_stats_and_render_show_hits_and_locks():
    cache, store = make_cache()
    a = serve(cache, store, [1, 2, 3, 4, 5, 6])
    insert_fresh(cache, store, [1, 2, 3, 9])
    cache.match_prefix([1, 2, 3, 9])
    text = cache.render(decode=lambda toks: "".join(chr(96 + t) for t in toks))
    lines = text.splitlines()
    assert lines[0].startswith("radix cache: 3 nodes, 7 tokens")
    assert "[0:3) 'abc'" in text and "lock=1" in text
    assert "[3:4) 'i'" in text and "hits=1" in text
    stats = cache.stats()
    assert stats["nodes"] == 3 and stats["cached_tokens"] == 7
    # serve() matched twice (a miss, then its own 6 tokens after inserting), then 4 of 4.
    assert stats["match_queries"] == 3
    assert stats["match_hit_tokens"] == 0 + 6 + 4
    assert stats["hit_rate"] == pytest.approx(10 / 16)
    release(cache, a)
    assert "… 1 more nodes" in cache.render(max_nodes=2)


@given(
    key=st.lists(st.integers(0, 2), max_size=40),
    node=st.lists(st.integers(0, 2), min_size=1, max_size=40),
    pos=st.integers(0, 40),
)
def test_common_prefix_len_agrees_with_a_plain_loop(key, node, pos):
    pos = min(pos, len(key))
    expected = 0
    rest = key[pos:]
    while expected < min(len(rest), len(node)) and rest[expected] == node[expected]:
        expected += 1
    assert common_prefix_len(key, node, pos) == expected


# ---- cache salts: one tree per salt --------------------------------------------------------
def insert_salted(cache: RadixCache, store: SlotStore, tokens: list[int], salt: str) -> None:
    blocks = cache.pool.alloc(cache.pool.blocks_for_tokens(len(tokens)))
    store.write(tokens, blocks, 0)
    cache.insert(tokens, blocks, salt)
    cache.pool.decref(blocks)


def test_prefixes_never_match_across_salts():
    cache, store = make_cache()
    tokens = list(range(10))
    insert_salted(cache, store, tokens, "a")
    assert cache.peek_prefix_len(tokens, "b") == 0
    assert cache.match_prefix(tokens, "b").length == 0
    assert cache.match_prefix(tokens).length == 0  # nor under the default salt
    assert cache.peek_prefix_len(tokens) == 0
    with pytest.raises(KeyError):
        cache.handle_of(tokens, "b")
    assert cache.swap_out(tokens, "b") == []
    insert_fresh(cache, store, tokens)  # the default salt's copy: its own blocks
    assert cache.match_prefix(tokens, "zzz").length == 0
    assert set(cache.match_prefix(tokens).blocks).isdisjoint(cache.match_prefix(tokens, "a").blocks)
    assert cache.num_nodes == 2 and cache.cached_tokens == 20
    cache.check_integrity({})


def test_a_salt_reuses_its_own_prefixes_fully():
    cache, store = make_cache()
    tokens = list(range(10))
    insert_salted(cache, store, tokens, "a")
    m = cache.match_prefix(tokens, "a")
    assert m.length == 10 and store.read_ok(tokens, m.blocks, 10)
    assert cache.match_prefix([*tokens[:6], 99], "a").length == 6  # splits within the salt
    assert cache.handle_of(tokens[:6], "a").length == 6
    served = serve(cache, store, [*tokens, 42])  # default salt: computes all of it
    assert served.cached == 0
    release(cache, served)
    cache.check_integrity({})


def test_salted_locks_evictions_and_flush():
    cache, store = make_cache(num_blocks=8)
    insert_salted(cache, store, [1, 2, 3, 4, 5, 6, 7, 8], "a")  # 2 blocks
    insert_salted(cache, store, [1, 2, 3, 4, 5, 6, 7, 8], "b")  # 2 more
    insert_fresh(cache, store, [1, 2, 3, 4])  # 1 block, default salt
    assert cache.salts == ["", "a", "b"]
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8], "b")  # "b" is now the most recent
    cache.lock(m.handle)
    assert cache.protected_size() == 2 and cache.evictable_size() == 3
    with pytest.raises(CacheInUseError):
        cache.flush()
    # LRU runs over every salt's leaves: "a" (older), then the default one; never locked "b".
    assert len(cache.evict(8)) == 3
    assert cache.match_prefix([1, 2, 3, 4], "a").length == 0
    assert cache.salts == ["", "b"]  # an emptied salt's root is dropped
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8], "b").length == 8
    cache.check_integrity({})
    assert "salt 'b'" in cache.render()
    described = cache.describe()
    assert [r["salt"] for r in described["salted_roots"]] == ["b"]
    assert described["num_nodes"] == 1 and described["salted_roots"][0]["children"]
    assert [cache.salt_of(n) for n in cache.nodes_parents_first()] == ["b"]
    cache.unlock(m.handle)
    cache.flush()
    assert cache.salts == [""] and cache.num_nodes == 0
    assert cache.pool.num_free == cache.pool.num_blocks
    cache.check_integrity({})


def test_salted_trees_with_a_tier():
    store = SlotStore(8, BS)
    pool = BlockPool(8, BS, copy_hook=store.copy)
    cache = RadixCache(pool, SlotTier(store, 16))
    tokens = list(range(8))
    insert_salted(cache, store, tokens, "a")
    assert len(cache.swap_out(tokens, "a")) == 2 and cache.tiered_tokens == 8
    assert cache.peek_prefix_len(tokens) == 0 and cache.match_prefix(tokens).length == 0
    m = cache.match_prefix(tokens, "a")
    assert (m.length, m.loaded) == (8, 8) and store.read_ok(tokens, m.blocks, 8)
    cache.check_integrity({})
