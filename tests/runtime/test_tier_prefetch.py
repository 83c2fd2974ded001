"""Agents at scale: tier loads started before their request is admitted (prefetch), eviction
among retained paths by predicted return, and the disk tier under the host tier.

Cache-level tests use a real KV cache and host tier with distinct values per block, so every
load is checked slot for slot; engine-level ones compare greedy outputs with an engine that
has memory to spare (moving KV between device, host and disk must never change a token).
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from kv_sim import DeferredCopier
from tiny_models import make_tiny_model, stepped_engine

from radixlang.runtime.block_pool import BlockPool
from radixlang.runtime.disk_tier import SpillingTier
from radixlang.runtime.engine import Engine
from radixlang.runtime.host_tier import HostTier
from radixlang.runtime.kv_cache import KVCache, KVShape
from radixlang.runtime.radix_cache import RadixCache
from radixlang.runtime.request import GenerateRequest
from radixlang.runtime.return_times import DEFAULT_GAP_S, ReturnTimes
from radixlang.runtime.tier_prefetch import TierCopier
from radixlang.server import metrics

SHAPE = KVShape(num_layers=2, kv_heads=2, head_dim=4)
BS = 4
VOCAB = 160
GREEDY = {"temperature": 0, "ignore_eos": True}
HOUR = 3600.0


# ---- a cache over a real KV cache, each written block holding its own values ---------------
class Cache:
    def __init__(
        self, num_blocks: int = 16, tier: str | None = "host", tier_blocks: int = 64
    ) -> None:
        self.kv = KVCache(SHAPE, num_blocks, block_size=BS, dtype=torch.float32)
        self.pool = BlockPool(num_blocks, BS)
        if tier is None:
            self.tier = None
        elif tier == "host":
            self.tier = HostTier(self.kv, tier_blocks)
        else:  # a host tier of 2 blocks over a disk tier: nearly everything spills
            self.tier = SpillingTier(self.kv, 2, tier_blocks)
        self.cache = RadixCache(self.pool, self.tier)
        self.written: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def run(self, tokens: list[int]) -> None:
        """A request computes ``tokens`` (its KV: random values) and ends, leaving them cached."""
        need = -(-len(tokens) // BS)
        if need > self.pool.num_free:
            self.cache.evict(need - self.pool.num_free)
        blocks = self.pool.alloc(need)
        for b in blocks:
            self.kv.k[:, b] = torch.randn(self.kv.k[:, b].shape)
            self.kv.v[:, b] = torch.randn(self.kv.v[:, b].shape)
        self.cache.insert(tokens, blocks)
        self.written[tuple(tokens)] = (self.kv.k[:, blocks].clone(), self.kv.v[:, blocks].clone())
        self.pool.decref(blocks)

    def check(self, tokens: list[int]) -> int:
        """Match ``tokens`` and check the blocks hold what was written; returns its tokens
        that came from the tier."""
        m = self.cache.match_prefix(tokens)
        assert m.length == len(tokens)
        k, v = self.written[tuple(tokens)]
        n = len(tokens)
        got_k = self.kv.k[:, m.blocks].reshape(SHAPE.num_layers, -1, 2, 4)[:, :n]
        got_v = self.kv.v[:, m.blocks].reshape(SHAPE.num_layers, -1, 2, 4)[:, :n]
        assert torch.equal(got_k, k.reshape(SHAPE.num_layers, -1, 2, 4)[:, :n])
        assert torch.equal(got_v, v.reshape(SHAPE.num_layers, -1, 2, 4)[:, :n])
        return m.loaded


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_prefetched_path_is_resident_when_its_request_comes_and_holds_its_kv(tier):
    c = Cache(tier=tier)
    c.cache.copier = TierCopier()
    a, b = tokens(0, 22), tokens(1, 48)
    c.run(a)
    c.run(b)
    c.cache.evict(c.pool.num_blocks)  # both to the tier
    assert c.cache.tiered_tokens
    started = c.cache.prefetch_prefix(a, room=0)
    assert started > 0 and c.cache.loads_in_flight() == 1
    c.cache.settle_loads(wait=True)
    c.cache.check_integrity({})
    assert c.check(a) == len(a)  # from the tier, ahead of the match (the counters say so)
    s = c.cache.tier_stats()
    assert s["tier_loaded_ahead_blocks_total"] == s["tier_prefetched_blocks_total"] == started
    assert s["tier_loaded_late_blocks_total"] == s["tier_loaded_sync_blocks_total"] == 0
    assert s["tier_loaded_ahead_share"] == 1.0
    c.cache.copier.close()


def loading(seed: int) -> tuple[Cache, DeferredCopier, list[int], int]:
    """A cache whose 22-token path (6 blocks) was demoted to the tier and whose load has
    started, its copy held until ``run_all``: (cache, copier, tokens, blocks started)."""
    c = Cache()
    copier = DeferredCopier()
    c.cache.copier = copier
    a = tokens(seed, 22)
    c.run(a)
    c.cache.evict(c.pool.num_blocks)
    return c, copier, a, c.cache.prefetch_prefix(a)


def test_a_match_that_comes_before_the_copy_ends_waits_for_it_and_counts_it_late():
    c, copier, a, started = loading(0)
    assert started and copier.pending
    assert c.check(a) == len(a)  # the match committed the load after running its copy
    s = c.cache.tier_stats()
    assert s["tier_loaded_late_blocks_total"] == started
    assert s["tier_loaded_ahead_blocks_total"] == 0
    c.cache.check_integrity({})


def test_tier_load_counts_what_a_match_would_load_and_touches_nothing():
    c = Cache()
    a = tokens(0, 22)  # 6 blocks, the last one partial
    c.run(a)
    assert c.cache.tier_load(a).tiered == 0  # resident
    c.cache.evict(c.pool.num_blocks)
    assert c.cache.tier_load(a).tiered == 6
    assert c.cache.tier_load(a[:5]).tiered == 6  # a match ending inside a node loads it whole
    assert c.cache.tier_load(tokens(1, 8)).tiered == 0  # nothing cached
    assert c.cache.tier_load(a[:5]).pending == 0
    c.cache.copier = DeferredCopier()
    assert c.cache.prefetch_prefix(a[:5]) == 6  # the node it ends inside, whole
    assert c.cache.tier_load(a[:5]).pending == c.cache.tier_load(a).pending == 6
    c.cache.copier.run_all()
    assert c.cache.tier_stats()["tier_loaded_blocks_total"] == 0
    c.cache.check_integrity({})
    assert c.check(a) == len(a)


def test_a_match_that_commits_a_finished_copy_counts_its_tokens_once():
    c, copier, a, started = loading(2)
    assert started
    copier.run_all()  # done, not yet committed: the match commits it, as ahead
    assert c.check(a) == len(a)  # once (the commit's and the ahead count were both added)
    assert c.cache.tier_stats()["tier_loaded_ahead_blocks_total"] == 6
    c.cache.check_integrity({})


def test_a_prefetch_never_evicts_beyond_its_room_and_never_loads_twice():
    c = Cache(num_blocks=12)
    c.cache.copier = DeferredCopier()
    a = tokens(0, 20)  # 5 blocks
    c.run(a)
    c.run(tokens(1, 44))  # 11 blocks: a goes to the tier, the pool is full of this one
    free = c.pool.num_free
    assert c.cache.prefetch_prefix(a, room=0) == 0  # no room without evicting
    assert c.pool.num_free == free
    assert c.cache.prefetch_prefix(a, room=12) > 0
    assert c.cache.prefetch_prefix(a, room=12) == 0  # under way already
    c.cache.settle_loads(wait=True)
    c.cache.check_integrity({})
    assert c.check(a) == len(a)
    assert c.cache.tier_stats()["tier_loaded_sync_blocks_total"] == 0


def test_an_insert_that_adopts_a_node_being_loaded_leaves_the_copy_its_source():
    c, copier, a, started = loading(0)
    assert started
    c.run(a)  # a request computed the same prefix again: the tree takes its blocks
    c.run(tokens(2, 16))  # demotions allocate tier blocks: none of the copy's may be reused
    copier.run_all()
    c.cache.settle_loads()
    c.cache.check_integrity({})
    c.check(a)


# ---- predicted returns ------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_return_times_predict_from_each_programs_own_gaps_then_everyones():
    clock = Clock()
    rt = ReturnTimes(clock)
    assert rt.expected_gap("a") == DEFAULT_GAP_S
    for gap in (2.0, 4.0, 3.0):
        rt.paused("a")
        clock.t += gap
        rt.resumed("a")
    assert rt.expected_gap("a") == 3.0  # its median
    assert rt.expected_gap("new") == 3.0  # everyone's median, before its own
    rt.paused("a")
    assert rt.expected_return("a") == clock.t + 3.0
    assert rt.due(lead=0.5) == []
    assert rt.next_due(lead=0.5) == pytest.approx(clock.t + 2.5)
    clock.t += 2.6
    assert rt.due(lead=0.5) == ["a"]
    assert rt.due(lead=0.5) == []  # once per pause
    rt.ended("a")
    assert rt.next_due(0.5) is None


def test_retained_paths_leave_the_pool_furthest_predicted_return_first():
    c = Cache(num_blocks=40, tier=None)
    now = time.monotonic()
    paths = {name: tokens(i, 8) for i, name in enumerate("abcd")}
    returns = {"a": now + 1, "b": now + 50, "c": now + 10}  # d: plain, not retained
    for name, toks in paths.items():
        c.run(toks)
        if name in returns:
            c.cache.retain(c.cache.handle_of(toks), name, HOUR, returns[name])
    order = []
    for _ in range(4):
        c.cache.evict(1)  # one leaf (two blocks) at a time
        order += [n for n, t in paths.items() if not c.cache.peek_prefix_len(t) and n not in order]
    assert order == ["d", "b", "c", "a"]  # plain first, then the furthest return
    c.cache.check_integrity({})


def test_a_full_tier_drops_plain_paths_first_then_retained_ones_by_furthest_return():
    c = Cache(num_blocks=8, tier="host", tier_blocks=4)
    now = time.monotonic()
    near, far, plain = tokens(0, 8), tokens(1, 8), tokens(2, 8)  # 2 blocks each
    for name, toks, ret in (("near", near, now + 1), ("far", far, now + 60)):
        c.run(toks)
        c.cache.retain(c.cache.handle_of(toks), name, HOUR, ret)
    c.cache.evict(c.pool.num_blocks)  # both to the tier: it is full
    c.run(plain)
    c.cache.evict(c.pool.num_blocks)  # plain must go in: far is dropped, near stays
    assert c.cache.peek_prefix_len(near) == 8
    assert c.cache.peek_prefix_len(far) == 0
    c.run(tokens(3, 8))
    c.cache.evict(c.pool.num_blocks)  # plain (not retained) goes before near
    assert c.cache.peek_prefix_len(near) == 8
    assert c.cache.peek_prefix_len(plain) == 0
    c.cache.check_integrity({})


# ---- the disk tier ----------------------------------------------------------------------------
def test_the_disk_tier_spills_the_oldest_host_blocks_and_reads_every_block_back_whole(tmp_path):
    kv = KVCache(SHAPE, 24, block_size=BS, dtype=torch.bfloat16)
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    tier = SpillingTier(kv, host_blocks=3, disk_blocks=20, folder=tmp_path)
    assert not list(tmp_path.iterdir())  # unlinked once opened
    blocks = tier.pool.alloc(10)
    want = (kv.k[:, :10].clone(), kv.v[:, :10].clone())
    for i in range(0, 10, 2):  # in writes of two: the oldest spill as the host fills
        tier.write(list(range(i, i + 2)), blocks[i : i + 2])
    s = tier.stats()
    assert s["disk_spilled_blocks_total"] == 7 and s["disk_blocks_used"] == 7
    kv.k.zero_()
    kv.v.zero_()
    order = list(range(10))
    random.Random(0).shuffle(order)
    tier.read([blocks[i] for i in order], [10 + j for j in range(10)])
    for j, i in enumerate(order):
        assert torch.equal(kv.k[:, 10 + j], want[0][:, i])
        assert torch.equal(kv.v[:, 10 + j], want[1][:, i])
    k, v = tier.gather(blocks)  # what saving the cache reads
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])
    tier.pool.decref(blocks)
    assert tier.stats()["disk_blocks_used"] == 0 and tier.ram.pool.num_free == 3
    tier.close()


def test_a_disk_tier_needs_a_host_tier(tmp_path):
    folder = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=512)
    with pytest.raises(ValueError, match="needs a host tier"):
        Engine(folder, dtype="float32", num_blocks=32, disk_tier_size="1MiB")


# ---- on the engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=1024
    )


def agent_steps(e: Engine, agents: int, steps: int, seed: int = 0) -> list[list[int]]:
    """Agents taking turns: each call extends its agent's whole history (retained between
    calls), so every path is wanted again after the others ran."""
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB) for _ in range(24)]
    histories = [system + [rng.randrange(1, VOCAB) for _ in range(10)] for _ in range(agents)]
    outputs = []
    for _ in range(steps):
        handles = []
        for i, h in enumerate(histories):
            req = GenerateRequest(input_ids=h, sampling=GREEDY | {"max_new_tokens": 4},
                                  routing_key=f"agent-{i}", retain_s=HOUR)  # fmt: skip
            handles.append(e.submit(req))
            if i % 2:
                e.step()  # arrivals while others run
        while not all(h.done for h in handles):
            e.step()
        for i, handle in enumerate(handles):
            out = handle.result().output_ids
            outputs.append(out)
            histories[i] = histories[i] + out + [rng.randrange(1, VOCAB) for _ in range(12)]
    return outputs


TIERS = [{"host_tier_memory": "4MiB"}, {"host_tier_memory": "64KiB", "disk_tier_size": "4MiB"}]


@pytest.mark.parametrize("tiers", TIERS)
def test_agents_on_a_small_pool_with_prefetch_give_the_outputs_of_a_roomy_pool(
    folder, tmp_path, tiers
):
    want = agent_steps(stepped_engine(folder, retain_max_s=HOUR), 6, 4)
    e = stepped_engine(folder, num_blocks=48, retain_max_s=HOUR, retain_max_share=1.0,
                       cache_dir=None, **tiers)  # fmt: skip
    assert agent_steps(e, 6, 4) == want
    s = e.stats()
    assert s["tier_loaded_blocks_total"] > 0
    assert s["tier_prefetched_blocks_total"] > 0
    if "disk_tier_size" in tiers:
        assert s["disk_read_blocks_total"] > 0
    # /metrics reports the tiers' traffic where there is a tier.
    page = metrics.parse(metrics.render(s, metrics.HTTPCounters()))
    assert page["radixlang_tier_loaded_blocks_total"] == s["tier_loaded_blocks_total"]
    assert page["radixlang_tier_loaded_ahead_blocks_total"] == s["tier_loaded_ahead_blocks_total"]
    assert ("radixlang_disk_read_blocks_total" in page) == ("disk_tier_size" in tiers)
    e.check_integrity()
    e.shutdown(free_cache=True)


def test_a_paused_programs_path_is_loaded_back_before_its_predicted_return(folder):
    e = stepped_engine(folder, num_blocks=40, host_tier_memory="2MiB", retain_max_s=HOUR,
                       retain_max_share=1.0)  # fmt: skip
    clock = Clock()
    e.scheduler.return_times = ReturnTimes(clock)
    agent = [random.Random(0).randrange(1, VOCAB) for _ in range(40)]

    def call(tokens, key=None, retain=0.0, new=4):
        req = GenerateRequest(input_ids=tokens, sampling=GREEDY | {"max_new_tokens": new},
                              routing_key=key, retain_s=retain)  # fmt: skip
        handle = e.submit(req)
        while not handle.done:
            e.step()
        return handle.result()

    first = call(agent, "agent", HOUR)
    for i in range(1, 3):  # each needs the whole pool: the retained path goes to the tier
        call([random.Random(i).randrange(1, VOCAB) for _ in range(140)], new=6)
    assert e.stats()["tier_tokens"] > 0
    clock.t += DEFAULT_GAP_S  # its predicted return is here
    e.step()  # an idle step: the load falls due and starts
    assert e.stats()["tier_prefetched_blocks_total"] > 0
    e.cache.settle_loads(wait=True)
    resumed = call(agent + first.output_ids + [7, 8, 9], "agent")
    assert resumed.cached_tokens == len(agent) + len(first.output_ids) - 1
    s = e.stats()
    assert s["tier_loaded_ahead_blocks_total"] > 0
    assert s["tier_loaded_sync_blocks_total"] == 0 and s["tier_loaded_late_blocks_total"] == 0
    assert s["tier_loaded_ahead_share"] == 1.0
    e.check_integrity()


def test_a_queued_request_is_loaded_beside_the_forward_once_room_frees_then_admitted(folder):
    # At arrival running requests fill the pool: no room to prefetch. When one ends, the next
    # schedule starts the load on the copy thread and admits the request a step later, its
    # path resident: ahead, with no copy inside admission.
    e = stepped_engine(folder, num_blocks=40, host_tier_memory="2MiB", retain_max_s=HOUR,
                       retain_max_share=1.0)  # fmt: skip
    rng = random.Random(0)
    agent = [rng.randrange(1, VOCAB) for _ in range(40)]

    def submit(tokens, new, key=None, retain=0.0):
        req = GenerateRequest(input_ids=tokens, sampling=GREEDY | {"max_new_tokens": new},
                              routing_key=key, retain_s=retain)  # fmt: skip
        return e.submit(req)

    def finish(handle):
        while not handle.done:
            e.step()
        return handle.result()

    first = finish(submit(agent, 4, "agent", HOUR))
    for i in range(1, 3):  # each needs the whole pool: the retained path goes to the tier
        finish(submit([random.Random(i).randrange(1, VOCAB) for _ in range(140)], 6))
    assert e.stats()["tier_tokens"] > 0
    copier = DeferredCopier()
    e.cache.copier = copier
    short = submit([rng.randrange(1, VOCAB) for _ in range(68)], 2)
    long = submit([rng.randrange(1, VOCAB) for _ in range(68)], 24)
    e.step()
    resume = agent + first.output_ids + [7, 8, 9]
    resumed = submit(resume, 4, "agent")
    assert not copier.pending  # no room yet
    while not short.done:
        e.step()
        assert not resumed.done
        assert e.stats()["tier_loaded_blocks_total"] == 0  # no load inside admission either
    for _ in range(3):  # the load starts once the short request's blocks are free
        if copier.pending:
            break
        e.step()
    assert copier.pending and not long.done
    e.step()  # the copy has not run: the request waits beside the forward
    assert e.stats()["tier_loaded_blocks_total"] == 0
    copier.run_all()
    out = finish(resumed)
    assert out.cached_tokens == len(agent) + len(first.output_ids) - 1
    s = e.stats()
    assert s["tier_loaded_ahead_blocks_total"] == s["tier_loaded_blocks_total"] > 0
    assert s["tier_loaded_sync_blocks_total"] == s["tier_loaded_late_blocks_total"] == 0
    finish(long)
    e.check_integrity()


def test_a_lone_request_growing_into_a_loads_blocks_is_not_cut_short(folder):
    # A background load holds fresh blocks and its path locked. A lone running request that
    # then needs those blocks did not outgrow the pool: the load joins the tree (evictable)
    # and the request goes on to its max_new_tokens (it was ended early once, as "length").
    e = stepped_engine(folder, num_blocks=24, host_tier_memory="2MiB")
    rng = random.Random(3)
    a = [rng.randrange(1, VOCAB) for _ in range(40)]
    e.generate(a, GREEDY | {"max_new_tokens": 1})
    e.cache.evict(e.pool.num_blocks)  # a's path: in the tier
    assert e.stats()["tier_tokens"] > 0
    copier = DeferredCopier()
    e.cache.copier = copier
    grow = e.submit([rng.randrange(1, VOCAB) for _ in range(20)], GREEDY | {"max_new_tokens": 68})
    e.step()
    waiting = e.submit([*a, 1, 2], GREEDY | {"max_new_tokens": 2})
    e.step()
    assert copier.pending  # its prefix loads beside the forward, into free blocks
    while not grow.done:
        e.step()
    assert len(grow.result().output_ids) == 68
    while not waiting.done:
        e.step()
    copier.run_all()
    e.check_integrity()


def test_an_overdue_program_ranks_as_needed_last_before_its_deadline():
    c = Cache(num_blocks=40, tier=None)
    now = time.monotonic()
    late, soon = tokens(0, 8), tokens(1, 8)
    c.run(late)
    c.cache.retain(c.cache.handle_of(late), "late", HOUR, now + 1)  # overdue from now + 2
    c.run(soon)
    c.cache.retain(c.cache.handle_of(soon), "soon", HOUR, now + 30)
    c.cache.expire_retentions(now + 3)  # "late" never came back: its path goes first
    assert c.cache.retention_stats()["retained_paths"] == 2  # both still retained
    c.cache.evict(1)
    assert c.cache.peek_prefix_len(late) == 0 and c.cache.peek_prefix_len(soon) == 8
    c.cache.check_integrity({})
