"""RadixCache.describe(): the tree as nested dicts, what the REPL's /tree draws."""

from __future__ import annotations

import json

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.radix_cache import RadixCache

BS = 4


def insert(cache: RadixCache, tokens: list[int]) -> list[int]:
    blocks = cache.pool.alloc(cache.pool.blocks_for_tokens(len(tokens)))
    cache.insert(tokens, blocks)
    cache.pool.decref(blocks)  # the tree keeps its own references
    return blocks


def nodes(info: dict) -> list[dict]:
    out, stack = [], list(info["children"])
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node["children"])
    return out


def test_a_shared_prefix_is_one_node_with_its_branches_below():
    cache = RadixCache(BlockPool(32, BS))
    prefix = list(range(10))
    insert(cache, [*prefix, 100, 101, 102])
    insert(cache, [*prefix, 200, 201])
    insert(cache, [*prefix, 300])
    info = cache.describe()
    assert info["token_ids"] == [] and info["num_nodes"] == 4 and info["shown_nodes"] == 4
    (shared,) = info["children"]
    assert shared["token_ids"] == prefix
    assert (shared["start"], shared["end"]) == (0, 10)
    assert [c["token_ids"] for c in shared["children"]] == [[100, 101, 102], [200, 201], [300]]
    for child in shared["children"]:
        assert child["start"] == 10 and child["children"] == []
        # positions 10.. fall in block 2, which each writer filled on its own
        assert len(child["blocks"]) == 2 - (child["end"] <= 12)
    json.dumps(info)  # plain data: a server route could send it as it is


def test_figures_follow_matches_locks_and_references():
    cache = RadixCache(BlockPool(32, BS))
    insert(cache, [1, 2, 3, 4, 5, 6])
    insert(cache, [1, 2, 3, 4, 9, 9])
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    cache.lock(match.handle)
    cache.pool.incref(match.blocks)  # a running request holding what it reuses
    info = cache.describe()
    (shared,) = info["children"]
    five, nine = shared["children"]
    assert five["token_ids"] == [5, 6] and nine["token_ids"] == [9, 9]
    assert shared["hits"] == 1 and five["hits"] == 1 and nine["hits"] == 0
    assert shared["lock_ref"] == 1 and five["lock_ref"] == 1 and nine["lock_ref"] == 0
    assert five["age"] == 0 and nine["age"] > 0  # the match just touched [1..6]
    # the request's reference comes on top of the tree's own
    assert five["block_refs"] == [cache.pool.refcount(b) for b in five["blocks"]]
    assert max(five["block_refs"]) >= 2 and nine["block_refs"] == [1]
    cache.unlock(match.handle)
    cache.pool.decref(match.blocks)
    cache.check_integrity({})


def test_max_nodes_cuts_the_listing_not_the_block_count():
    cache = RadixCache(BlockPool(64, BS))
    for first in range(5):
        insert(cache, [first * 10 + i for i in range(8)])
    whole = cache.describe()
    assert whole["tree_blocks"] == 10 == cache.pool.num_used
    cut = cache.describe(max_nodes=2)
    assert cut["shown_nodes"] == 2 and len(nodes(cut)) == 2
    assert cut["num_nodes"] == 5 and cut["tree_blocks"] == 10
    assert cache.describe(max_nodes=0)["children"] == []
