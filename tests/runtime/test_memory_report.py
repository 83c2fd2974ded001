"""The memory report: exact block, slot and sharing counts on hand-built pools and trees, a
running request driven step by step through the engine, the figure and the host tier."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tiny_models import make_tiny_model

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.engine import Engine
from radixlang.runtime.memory_report import MemoryReport, collect_memory_report
from radixlang.runtime.radix_cache import RadixCache

BS = 4


def two_sequences_sharing_six_tokens() -> tuple[BlockPool, RadixCache]:
    """A = 0..9 (blocks a0 a1 a2), then B = A[:6] + 3 tokens: B reuses a0, copies a1 on write
    (its first 2 slots, the shared positions 4 and 5) and allocates one block more.

    Tree: [0,6) holds a0 a1; its children [6,10) hold a1 a2 and [6,9) hold c1 b2."""
    pool = BlockPool(16, BS)
    cache = RadixCache(pool)
    a = list(range(10))
    blocks = pool.alloc(3)
    cache.insert(a, blocks)
    pool.decref(blocks)
    b = [*a[:6], 20, 21, 22]
    match = cache.match_prefix(b)
    assert match.length == 6
    pool.incref(match.blocks)
    blocks = list(match.blocks)
    blocks[-1] = pool.copy_on_write(blocks[-1], 6 % BS)
    blocks += pool.alloc(1)
    cache.insert(b, blocks)
    pool.decref(blocks)
    cache.check_integrity(external_refs={})
    return pool, cache


def test_a_tree_of_two_sequences_sharing_a_prefix():
    pool, cache = two_sequences_sharing_six_tokens()
    r = collect_memory_report(pool, cache, [])
    assert (r.blocks_total, r.blocks_used, r.blocks_free) == (16, 5, 11)
    assert (r.blocks_tree_only, r.blocks_requests_only, r.blocks_both) == (5, 0, 0)
    assert r.blocks_unaccounted == 0
    assert r.blocks_shared == 1  # a1: the split node [0,6) and its child [6,10)
    assert r.blocks_evictable == 5
    # Live slots per block: a0 4, a1 4 (positions 4..7 via [6,10)), a2 2, c1 4 (the copy of
    # positions 4, 5 plus 6, 7), b2 1.
    assert r.slots_allocated == 20
    assert r.tokens_live == 15
    assert r.fragmentation == pytest.approx(0.25)
    assert r.allocated_per_live == pytest.approx(20 / 15)
    # Logical: the two leaves' paths, 10 + 9 tokens.
    assert r.logical_tokens == 19
    assert r.sharing == pytest.approx(19 / 15)
    assert (r.tree_nodes, r.tree_leaves, r.running_requests) == (3, 2, 0)
    assert r.tier is None and r.bytes_per_block == 0 and r.metadata_fraction is None
    assert r.metadata_bytes > 0


def test_a_running_request_with_blocks_for_tokens_not_yet_computed():
    pool = BlockPool(16, BS)
    cache = RadixCache(pool)
    a = list(range(10))
    blocks = pool.alloc(3)
    cache.insert(a, blocks)
    pool.decref(blocks)
    # A request reuses the first 8 cached tokens and holds two fresh blocks for 6 tokens to come.
    match = cache.match_prefix([*a[:8], 50, 51, 52, 53, 54, 55])
    assert match.length == 8
    cache.lock(match.handle)
    pool.incref(match.blocks)
    req = SimpleNamespace(blocks=list(match.blocks) + pool.alloc(2), num_computed=8)
    cache.check_integrity(external_refs={b: 1 for b in req.blocks})

    r = collect_memory_report(pool, cache, [req])
    assert (r.blocks_used, r.blocks_tree_only, r.blocks_requests_only, r.blocks_both) == (
        5,
        1,  # a2, the cached tail [8,10)
        2,  # the fresh blocks: allocated, nothing written yet
        2,  # a0, a1: cached and reused
    )
    assert r.blocks_shared == 2
    assert r.blocks_evictable == 1  # [0,8) is locked; [8,10) is not
    assert r.slots_allocated == 20
    assert r.tokens_live == 4 + 4 + 2  # the fresh blocks are allocated, not live
    assert r.fragmentation == pytest.approx(0.5)
    assert r.logical_tokens == 8 + 10  # the request's computed tokens + the leaf's path
    assert r.sharing == pytest.approx(1.8)
    assert r.running_requests == 1

    req.num_computed = 13  # 5 of the 6 new tokens written: the first fresh block full, 1 slot
    r = collect_memory_report(pool, cache, [req])
    assert r.tokens_live == 10 + 4 + 1
    assert r.logical_tokens == 13 + 10


def test_host_tier_nodes_hold_no_device_blocks_and_the_tier_stats_are_included():
    pool, cache = two_sequences_sharing_six_tokens()
    split = cache.root.children[0]  # [0,6)
    (leaf_b,) = [n for n in split.children.values() if n.end == 9]
    (leaf_a,) = [n for n in split.children.values() if n.end == 10]

    def to_host(node):  # what the tier does to a node it takes: its device blocks go
        pool.decref(node.blocks)
        node.blocks = []

    to_host(leaf_b)
    tier_stats = {"blocks_total": 64, "blocks_used": 2, "bytes_total": 1 << 20, "bytes_used": 1024}
    cache.tier = SimpleNamespace(stats=lambda: dict(tier_stats, nodes=1))
    r = collect_memory_report(pool, cache, [])
    assert (r.blocks_used, r.blocks_tree_only, r.blocks_shared) == (3, 3, 1)
    assert r.tokens_live == 4 + 4 + 2
    # B's device part [0,6) lies inside A's path: the one device leaf is A's, 10 tokens.
    assert (r.logical_tokens, r.tree_leaves, r.tree_nodes, r.tree_host_nodes) == (10, 1, 3, 1)
    assert r.tier == dict(tier_stats, nodes=1)
    text = r.render_text()
    assert "tier      2/64 blocks, 1.0 KiB/1.0 MiB, 1 nodes" in text
    assert "1 tree leaves, 3 nodes, 1 on the host tier)" in text
    d = json.loads(json.dumps(r.to_dict()))
    assert d["tier"]["blocks_used"] == 2 and d["tree"]["host_nodes"] == 1
    assert MemoryReport.from_dict(d) == r

    to_host(leaf_a)  # now [0,6) is the device leaf: a0 full, a1 its 2 slots
    r = collect_memory_report(pool, cache, [])
    assert (r.blocks_used, r.blocks_shared, r.tokens_live) == (2, 0, 6)
    assert (r.logical_tokens, r.tree_leaves, r.tree_host_nodes) == (6, 1, 2)


def test_text_dict_round_trip_and_png(tmp_path):
    pool, cache = two_sequences_sharing_six_tokens()
    r = collect_memory_report(pool, cache, [])
    d = json.loads(json.dumps(r.to_dict()))  # JSON-ready: no inf, no NaN, no objects
    assert d["blocks"] == {
        "total": 16,
        "free": 11,
        "used": 5,
        "tree_only": 5,
        "requests_only": 0,
        "both": 0,
        "unaccounted": 0,
        "shared": 1,
        "evictable": 5,
    }
    assert d["slots"]["live"] == 15 and d["sharing"]["logical_tokens"] == 19
    assert MemoryReport.from_dict(d) == r
    text = r.render_text()
    assert "used 5/16" in text and "15 live of 20 allocated" in text and "tier      off" in text
    path = r.save_png(tmp_path / "memory.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 5000
    with_tier = MemoryReport.from_dict({**d, "tier": {"blocks_total": 8, "blocks_used": 3}})
    taller = with_tier.save_png(tmp_path / "tier.png").read_bytes()
    assert taller.startswith(b"\x89PNG") and taller != data


def test_empty_pool():
    pool = BlockPool(8, BS)
    r = collect_memory_report(pool, RadixCache(pool), [])
    assert (r.blocks_used, r.tokens_live, r.logical_tokens, r.tree_nodes) == (0, 0, 0, 0)
    assert r.fragmentation == 0.0 and r.sharing is None and r.allocated_per_live is None
    assert "nothing live" in r.render_text()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


def test_engine_report_step_by_step(folder):
    eng = Engine(folder, num_blocks=64, block_size=BS, background=False, dtype="float32")
    prompt = list(range(3, 13))  # 10 tokens: blocks 0 and 1 full, block 2 half
    handle = eng.submit(prompt, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    # 2 layers x 2 KV heads x 16 dims x 4 slots x 4 bytes, K and V.
    per_block = 2 * 2 * 2 * 16 * BS * 4

    assert eng.step()  # the prompt's prefill: its KV goes into the tree, locked
    r = eng.memory_report()
    assert (r.bytes_per_block, r.kv_dtype, r.kv_bytes) == (per_block, "float32", 64 * per_block)
    assert r.metadata_fraction == pytest.approx(r.metadata_bytes / (64 * per_block))
    assert (r.blocks_used, r.blocks_both, r.blocks_shared, r.blocks_evictable) == (3, 3, 3, 0)
    assert r.blocks_tree_only == r.blocks_requests_only == 0
    assert (r.slots_allocated, r.tokens_live) == (12, 10)
    # The cached prompt is the running request's own (its path is locked): counted once.
    assert r.logical_tokens == 10 and r.running_requests == 1
    assert r.sharing == pytest.approx(1.0)

    assert eng.step()  # a decode: position 10, into block 2; decodes are not inserted
    r = eng.memory_report()
    assert (r.blocks_used, r.tokens_live, r.logical_tokens) == (3, 11, 11)

    while eng.step():
        pass
    assert len(handle.result().output_ids) == 4
    # Finished: 13 tokens computed (the last output is never fed back), all in the tree; the
    # new leaf [10,13) shares block 2 with [0,10) and holds a fourth block.
    r = eng.memory_report()
    assert (r.running_requests, r.blocks_requests_only, r.blocks_both) == (0, 0, 0)
    assert (r.blocks_used, r.blocks_tree_only, r.blocks_shared) == (4, 4, 1)
    assert (r.slots_allocated, r.tokens_live, r.logical_tokens) == (16, 13, 13)
    assert r.sharing == pytest.approx(1.0)
    assert r.fragmentation == pytest.approx(3 / 16)
    eng.shutdown(free_cache=True)
