"""``runtime/engine_view.py``: the tree a viewer sees (the largest subtrees, closed under
parents, with what was left out counted), who holds each block, the eviction log, and
``Engine.view()`` on a running engine."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_sim import SlotStore, SlotTier, release, serve

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.engine_view import BLOCK_STATES, block_owners, tree_view
from radixlang.runtime.radix_cache import RadixCache

BS = 4


def make_cache(num_blocks: int = 256, tier_blocks: int = 0) -> tuple[RadixCache, SlotStore]:
    store = SlotStore(num_blocks, BS)
    pool = BlockPool(num_blocks, BS, copy_hook=store.copy)
    tier = SlotTier(store, tier_blocks) if tier_blocks else None
    return RadixCache(pool, tier), store


def insert(cache: RadixCache, store: SlotStore, tokens: list[int], salt: str = "") -> None:
    release(cache, serve(cache, store, tokens, salt))


sequences = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=14), min_size=1,
                     max_size=24)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(seqs=sequences, max_nodes=st.integers(1, 12))
def test_the_view_is_the_largest_subtrees_closed_under_parents(seqs, max_nodes):
    cache, store = make_cache()
    for tokens in seqs:
        insert(cache, store, tokens)
    view = tree_view(cache, max_nodes)
    rows = {r["id"]: r for r in view["nodes"]}
    shown = [r for r in view["nodes"] if r["parent"] is not None]
    assert view["num_nodes"] == cache.num_nodes
    assert view["shown_nodes"] == len(shown) == min(max_nodes, cache.num_nodes)
    # Parents first, every shown node's parent shown, and no shown subtree smaller than a
    # left-out one.
    seen: set[int] = set()
    for r in view["nodes"]:
        assert r["parent"] is None or r["parent"] in seen
        seen.add(r["id"])
    all_sizes = sorted(_subtree_sizes(cache).values(), reverse=True)
    assert sorted((r["subtree_tokens"] for r in shown), reverse=True) == all_sizes[: len(shown)]
    # What was left out adds up: every hidden node is counted once, under a shown parent.
    hidden_nodes = sum(h["nodes"] for h in view["hidden"])
    assert hidden_nodes == cache.num_nodes - len(shown)
    assert all(h["parent"] in rows for h in view["hidden"])
    root = next(r for r in view["nodes"] if r["parent"] is None)
    assert root["subtree_tokens"] == cache.cached_tokens == view["cached_tokens"]


def _subtree_sizes(cache: RadixCache) -> dict[int, int]:
    sizes: dict[int, int] = {}

    def size(node) -> int:  # type: ignore[no-untyped-def]
        total = len(node.tokens) + sum(size(c) for c in node.children.values())
        sizes[node.id] = total
        return total

    for _, root in cache.roots():
        for child in root.children.values():
            size(child)
    return sizes


def test_salted_trees_hang_under_their_own_roots():
    cache, store = make_cache()
    insert(cache, store, [1, 2, 3, 4, 5])
    insert(cache, store, [1, 2, 3, 9], salt="tenant-a")
    view = tree_view(cache, 50)
    roots = [r for r in view["nodes"] if r["parent"] is None]
    assert [r["salt"] for r in roots] == ["", "tenant-a"]
    salted = [r for r in view["nodes"] if r["salt"] == "tenant-a" and r["parent"] is not None]
    assert salted and salted[0]["parent"] == roots[1]["id"]
    assert salted[0]["head_ids"] == [1, 2, 3, 9]


def test_block_owners_agree_with_the_pool_and_name_each_holder():
    cache, store = make_cache(64)
    insert(cache, store, list(range(10)))
    insert(cache, store, [*range(6), 40, 41, 42])
    running = serve(cache, store, [*range(10), 50, 51, 52, 53, 54])  # holds a locked path
    pool = cache.pool
    newest = pool.alloc(2)  # tokens the request computed since: not in the tree yet
    request = _AsRequest("r1", running.blocks + newest)
    states, owners, names = block_owners(pool, cache, [request])
    for b in range(pool.num_blocks):
        assert (states[b] == 0) == (pool.refcount(b) == 0), b
        assert (owners[b] == -1) == (states[b] == 0)
    by_state = {BLOCK_STATES[s] for s in states}
    assert by_state == {"free", "cached", "locked", "request"}
    # The request's own new blocks (past the cached path) are named after it.
    assert [BLOCK_STATES[states[b]] for b in newest] == ["request", "request"]
    assert all(names[owners[b]] == "request r1" for b in newest)
    assert all(BLOCK_STATES[states[b]] == "locked" for b in running.blocks)
    assert all(names[owners[b]].startswith("node ") for b in range(pool.num_blocks)
               if BLOCK_STATES[states[b]] in ("cached", "locked"))  # fmt: skip
    pool.decref(newest)
    release(cache, running)


class _AsRequest:
    """The two fields of a running request that ``block_owners`` reads."""

    def __init__(self, rid: str, blocks: list[int]) -> None:
        self.rid, self.blocks = rid, blocks


def test_evictions_are_logged_with_where_the_kv_went():
    cache, store = make_cache(16)
    insert(cache, store, [1, 2, 3, 4, 5, 6, 7, 8])
    insert(cache, store, [1, 2, 3, 4, 9, 9, 9, 9])
    freed = cache.evict(1)
    assert freed
    (entry,) = cache.evictions
    assert entry.start == 4 and entry.end == 8 and entry.blocks == 1 and not entry.to_tier
    assert entry.head_tokens == (5, 6, 7, 8)  # the older leaf went first

    tiered, tstore = make_cache(16, tier_blocks=8)
    insert(tiered, tstore, [1, 2, 3, 4, 5, 6, 7, 8])
    tiered.evict(1)
    assert tiered.evictions[-1].to_tier
    view = tree_view(tiered, 10)
    assert any(r["tier_blocks"] and not r["blocks"] for r in view["nodes"])
    assert view["evictions"][-1].node_id == tiered.evictions[-1].node_id


def test_engine_view_reads_a_running_engine_between_steps(chat_model_dir):
    from radixlang.runtime.engine import Engine

    engine = Engine(str(chat_model_dir), dtype="float32", num_blocks=160, block_size=4)
    try:
        handle = engine.submit("Count to a thousand:", {"max_new_tokens": 300, "ignore_eos": True})
        seen: list[dict] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set() and len(seen) < 200:
                seen.append(engine.view(max_nodes=5))

        watcher = threading.Thread(target=watch)
        watcher.start()
        result = handle.result()
        done.set()
        watcher.join()
        assert result.completion_tokens == 300
        running = [v for v in seen if v["requests"]]
        assert running, "the request was never seen running"
        row = running[-1]["requests"][0]
        assert row["rid"] == result.request_id and row["state"] in ("prefill", "decode")
        assert row["prompt_tokens"] == result.prompt_tokens
        # Whole steps only: the counts in one view agree with each other.
        for v in running:
            held = sum(1 for s in v["blocks"]["states"] if BLOCK_STATES[s] != "free")
            assert held == v["stats"]["blocks_used"]
        idle = engine.view()
        assert idle["requests"] == [] and idle["stats"]["running_requests"] == 0
    finally:
        engine.shutdown(free_cache=True)
