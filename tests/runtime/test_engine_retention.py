"""Retention on the engine: a request with ``retain_s`` leaves its path retained for its program
(its routing key) when it ends. Retained paths outlive plain ones under memory pressure, go to
the host tier rather than away when they must leave the pool, end at their deadline or when
the program is released, and can never keep a new request out: a pool full of retained paths
still admits new work. Every step checks the pool's and the cache's invariants."""

from __future__ import annotations

import random

import pytest
from tiny_models import make_tiny_model, stepped_engine

from radixlang.runtime.engine import Engine
from radixlang.runtime.request import GenerateRequest, RequestError

VOCAB = 160
GREEDY = {"temperature": 0, "ignore_eos": True}
# Retentions here last an hour (deadlines are wall-clock time): none may expire on a slow or
# loaded machine before the test looks. Deadlines are tested with an explicit time.
HOUR = 3600.0


def engine(folder, **kw) -> Engine:
    kw.setdefault("retain_max_s", HOUR)
    return stepped_engine(folder, **kw)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=1024
    )


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def call(e: Engine, tokens: list[int], program: str | None = None, retain: float = 0.0,
         new: int = 4):  # fmt: skip
    request = GenerateRequest(input_ids=tokens, sampling=GREEDY | {"max_new_tokens": new},
                              routing_key=program, retain_s=retain)  # fmt: skip
    handle = e.submit(request)
    while not handle.done:
        e.step()
    return handle.result()


def test_a_retained_path_outlives_plain_ones_and_its_program_resumes_from_it(folder):
    e = engine(folder, num_blocks=40)  # 160 tokens: the agent's path and one more, at most
    agent = prompt(0)
    first = call(e, agent, "agent", retain=HOUR)
    assert e.stats()["retained_paths"] == 1
    for i in range(1, 6):  # other traffic, without retention, fills the pool several times
        call(e, prompt(i), new=8)
    stats = e.stats()
    assert stats["evicted_blocks"] > 0 and stats["retained_evicted_blocks_total"] == 0
    # The agent is back with its tool's result: all it had (but the last, uncomputed, output
    # token) is still cached.
    resumed = call(e, agent + first.output_ids + prompt(99, 6), "agent", retain=HOUR)
    assert resumed.cached_tokens == len(agent) + len(first.output_ids) - 1


def test_plain_lru_recomputes_the_same_program(folder):
    e = engine(folder, num_blocks=40)
    agent = prompt(0)
    first = call(e, agent, "agent")  # no retention: a plain path
    for i in range(1, 6):
        call(e, prompt(i), new=8)
    resumed = call(e, agent + first.output_ids + prompt(99, 6), "agent")
    assert resumed.cached_tokens < len(agent) // 2


def test_a_pool_full_of_retained_paths_still_admits_new_requests(folder):
    # Retention may take the whole pool here (share 1.0): only eviction order protects it.
    e = engine(folder, num_blocks=48, retain_max_share=1.0)
    for i in range(12):  # twelve programs paused at tool calls: far more than the pool holds
        call(e, prompt(i, 12), f"program-{i}", retain=HOUR)
    stats = e.stats()
    assert stats["retained_blocks"] > 0.5 * stats["blocks_total"]
    assert stats["blocks_free"] + stats["blocks_evictable"] == stats["blocks_total"]
    # New requests that need nearly the whole pool, several at once: all admitted, all done.
    handles = [e.submit(GenerateRequest(input_ids=prompt(100 + i, 120),
                                        sampling=GREEDY | {"max_new_tokens": 30}))
               for i in range(3)]  # fmt: skip
    while not all(h.done for h in handles):
        e.step()
    assert all(len(h.result().output_ids) == 30 for h in handles)
    after = e.stats()
    assert after["retained_evicted_blocks_total"] > 0  # retained paths gave way
    assert after["finished_error"] == 0
    e.check_integrity()


def test_retention_is_bounded_by_its_share_of_the_pool(folder):
    e = engine(folder, num_blocks=64, retain_max_share=0.25)
    for i in range(10):
        call(e, prompt(i, 20), f"program-{i}", retain=HOUR)
    assert e.stats()["retained_blocks"] <= 16


def test_the_host_tier_keeps_a_retained_path_that_must_leave_the_pool(folder):
    e = engine(folder, num_blocks=40, host_tier_memory="2MiB", retain_max_share=1.0)
    agent = prompt(0)
    first = call(e, agent, "agent", retain=HOUR)
    for i in range(1, 4):  # each needs the whole pool: the retained path must go too
        call(e, prompt(i, 150), new=6)
    assert e.stats()["retained_evicted_blocks_total"] > 0
    resumed = call(e, agent + first.output_ids + prompt(99, 6), "agent")
    # Loaded back from the tier, not computed again.
    assert resumed.cached_tokens == len(agent) + len(first.output_ids) - 1
    assert e.stats()["tier_loaded_tokens_total"] >= len(agent)


def test_release_and_deadlines_end_retention(folder):
    e = engine(folder, num_blocks=64)
    call(e, prompt(0), "a", retain=HOUR)
    call(e, prompt(1), "b", retain=HOUR)
    e.release_retained("a")
    assert e.stats()["retained_keys"] == 1
    e.cache.expire_retentions(now=float("inf"))
    assert e.stats()["retained_keys"] == 0
    # retain_max_s cuts a longer ask; 0 turns retention off.
    off = engine(folder, num_blocks=64, retain_max_s=0)
    call(off, prompt(0), "a", retain=HOUR)
    assert off.stats()["retained_total"] == 0


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "10", True])
def test_a_bad_retain_s_is_refused_at_submit(folder, bad):
    e = engine(folder, num_blocks=16)
    with pytest.raises(RequestError, match="retain_s must be a number of seconds >= 0"):
        e.submit(GenerateRequest(input_ids=prompt(0, 8), retain_s=bad))
    e.check_integrity()


def test_the_program_policy_serves_the_least_served_program_first(folder):
    e = engine(folder, num_blocks=128, schedule_policy="program", max_running_requests=1)
    long_agent, short_agent = "long", "short"
    for _ in range(3):  # the long agent has had three calls' worth of service
        call(e, prompt(7, 30), long_agent, new=10)
    assert e.scheduler.service[long_agent] > 0
    handles = [
        e.submit(GenerateRequest(input_ids=prompt(1, 20), sampling=GREEDY | {"max_new_tokens": 3},
                                 routing_key=long_agent)),
        e.submit(GenerateRequest(input_ids=prompt(2, 20), sampling=GREEDY | {"max_new_tokens": 3},
                                 routing_key=short_agent)),
    ]  # fmt: skip
    # One runs at a time: the short agent's call is admitted first and ends first.
    while not any(h.done for h in handles):
        e.step()
    assert handles[1].done and not handles[0].done
    while not handles[0].done:
        e.step()
