"""The host tier, swap preemption and the saved cache, on the engine with a tiny random model.

Outputs are compared with an engine that has memory to spare (nothing evicted, retracted or
reloaded): moving KV between the pool, the tier and the disk must never change a token.
"""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny_model
from tiny_models import stepped_engine as engine

from radixlang.runtime import cache_store
from radixlang.runtime.engine import Engine

VOCAB = 160
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=1024
    )


def few_shot_rounds(rounds: int, seed: int = 0) -> list[list[tuple[list[int], int]]]:
    """Four long 'few-shot prefixes' (42 tokens: ending inside a 4-token block), each with
    questions; every round asks each prefix a new question, so prefixes are revisited."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(42)] for _ in range(4)]
    return [
        [(p + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))], 6) for p in prefixes]
        for _ in range(rounds)
    ]


def run_rounds(e: Engine, rounds) -> list[list[int]]:
    outputs = []
    for batch in rounds:
        results = e.generate(
            [p for p, _ in batch], [GREEDY | {"max_new_tokens": n} for _, n in batch]
        )
        outputs += [r.output_ids for r in results]
    return outputs


def test_the_tier_keeps_evicted_prefixes_and_outputs_do_not_change(folder):
    rounds = few_shot_rounds(4)
    roomy = engine(folder)
    want = run_rounds(roomy, rounds)
    computed = {}
    for tier in (None, "2MiB"):
        # 24 blocks of 4 tokens: one prefix and its question at a time; four prefixes do not fit.
        e = engine(folder, num_blocks=24, host_tier_memory=tier, max_running_requests=1)
        assert run_rounds(e, rounds) == want
        s = e.stats()
        computed[tier] = s["prompt_tokens_computed"]
        if tier is None:
            assert s["tier_loaded_tokens"] == 0
        else:
            assert s["tier_loaded_tokens"] > 0 and s["tier_written_blocks_total"] > 0
            assert s["tier_dropped_tokens_total"] == 0
        e.check_integrity()
        assert e.flush_cache() and e.pool.num_free == e.pool.num_blocks
        if tier is not None:
            assert e.host_tier.pool.num_free == e.host_tier.pool.num_blocks
    # With the tier only the first round computes the prefixes.
    assert computed["2MiB"] * 2 < computed[None]


def test_swap_and_recompute_preemption_give_the_unpressured_outputs(folder):
    prompts = [[(7 * i + j) % VOCAB + 1 for j in range(10 + 3 * i)] for i in range(6)]
    params = [GREEDY | {"max_new_tokens": 40}] * len(prompts)
    want = [r.output_ids for r in engine(folder).generate(prompts, params)]
    stats = {}
    for policy, tier in (("recompute", None), ("swap", "4MiB")):
        e = engine(folder, num_blocks=30, host_tier_memory=tier, preemption=policy)
        assert [r.output_ids for r in e.generate(prompts, params)] == want
        stats[policy] = e.stats()
        assert stats[policy]["retractions"] > 0
        e.check_integrity()
        assert e.flush_cache() and e.pool.num_free == e.pool.num_blocks
    assert stats["swap"]["swapped_out_blocks"] > 0 and stats["swap"]["tier_loaded_tokens"] > 0
    assert stats["swap"]["recomputed_tokens"] < stats["recompute"]["recomputed_tokens"]


def test_swap_needs_a_tier_and_bad_policies_are_refused(folder):
    with pytest.raises(ValueError, match="host tier"):
        engine(folder, preemption="swap")
    with pytest.raises(ValueError, match="preemption must be one of"):
        engine(folder, preemption="later")
    with pytest.raises(ValueError, match="holds no KV block"):
        engine(folder, host_tier_memory="1KiB")


def test_the_cache_survives_a_restart(folder, tmp_path):
    prefix = [(5 * j) % VOCAB + 1 for j in range(37)]
    prompts = [[*prefix, 11, 12], [*prefix, 13], [3, 4, 5, 6, 7, 8, 9]]
    params = [GREEDY | {"max_new_tokens": 5}] * 3
    e = engine(folder, cache_dir=tmp_path, host_tier_memory="1MiB")
    before = [r.output_ids for r in e.generate(prompts, params)]
    e.cache.evict(8)  # some of it in the tier: both kinds are saved
    assert e.cache.tiered_tokens > 0
    e.shutdown()
    assert (tmp_path / cache_store.FILE_NAME).is_file()

    again = engine(folder, cache_dir=tmp_path)  # no tier this time: all back on the device
    assert again.cache_load_report["loaded"] is True
    r = again.generate([*prefix, 11, 12], params[0])
    # All but the last prompt token (computed for its logits) come from the saved cache.
    assert r.cached_tokens == len(prefix) + 1
    assert r.output_ids == before[0]
    assert [x.output_ids for x in again.generate(prompts, params)] == before
    again.check_integrity()
    again.shutdown()


def test_a_damaged_or_foreign_cache_file_is_refused(folder, tmp_path):
    e = engine(folder, cache_dir=tmp_path)
    e.generate([1, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY | {"max_new_tokens": 3})
    e.shutdown()
    path = tmp_path / cache_store.FILE_NAME
    data = path.read_bytes()

    path.write_bytes(data[:-10])  # truncated
    e = engine(folder, cache_dir=tmp_path)
    assert e.cache_load_report["loaded"] is False
    assert "truncated" in e.cache_load_report["reason"]
    assert e.cache.cached_tokens == 0
    r = e.generate([1, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY | {"max_new_tokens": 3})
    assert r.cached_tokens == 0 and r.completion_tokens == 3  # still serving

    body = bytearray(data)
    body[-5] ^= 0xFF  # one flipped byte in the KV
    path.write_bytes(bytes(body))
    e = engine(folder, cache_dir=tmp_path)
    assert e.cache_load_report["loaded"] is False and "damaged" in e.cache_load_report["reason"]

    path.write_bytes(data)
    e = engine(folder, cache_dir=tmp_path, block_size=8)  # another block size
    assert e.cache_load_report["loaded"] is False
    assert "block_size" in e.cache_load_report["reason"]
    e = engine(folder, cache_dir=tmp_path)  # the intact file still loads
    assert e.cache_load_report["loaded"] is True and e.cache.cached_tokens > 0


def test_save_cache_on_demand_while_serving(folder, tmp_path):
    e = engine(folder, host_tier_memory="1MiB", background=True, num_blocks=64)
    try:
        e.generate([9, 8, 7, 6, 5, 4, 3, 2, 1], GREEDY | {"max_new_tokens": 4})
        saved = e.save_cache(tmp_path)
        assert saved["nodes"] >= 1 and saved["tokens"] >= 12 and saved["bytes"] > 0
        with pytest.raises(ValueError, match="needs a folder"):
            e.save_cache()
    finally:
        e.shutdown()
