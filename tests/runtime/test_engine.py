"""The engine on a tiny random model: scheduling, prefix reuse, memory pressure, aborts,
sampling options, streaming, errors. Most tests drive ``step()`` themselves
(``background=False``) so that every step can be checked; a few use the engine thread."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch
from tiny_models import load_reference, make_tiny_model, reference_greedy
from tiny_models import stepped_engine as engine

from radixlang.runtime.block_pool import OutOfBlocksError, blocks_for
from radixlang.runtime.engine import CacheBusyError, Engine, RequestError, parse_memory
from radixlang.runtime.handle import GenerationError
from radixlang.runtime.radix_cache import common_prefix_len
from radixlang.runtime.request import MAX_CACHE_SALT_CHARS, FinishReason
from radixlang.runtime.scheduler import dfs_weight_order

VOCAB = 160
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(
        "llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def reference(folder):
    return load_reference(folder)


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    """Prompts in a few families that share prefixes (some ending inside a block), with
    varied lengths and max_new_tokens."""
    rng = random.Random(seed)
    families = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 30))] for _ in range(4)]
    items = []
    for _ in range(n):
        head = rng.choice(families)[: rng.randrange(1, 31)]
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))]
        items.append((head + tail, rng.randrange(1, 16)))
    return items


def idle_blocks_are_free_or_cached(eng: Engine) -> None:
    eng.check_integrity()  # with no request running, every held block is held by the tree
    assert eng.pool.num_used == eng.pool.num_blocks - eng.pool.num_free
    assert eng.cache.protected_size() == 0
    assert eng.flush_cache()
    assert eng.pool.num_free == eng.pool.num_blocks


# ---- greedy outputs ----------------------------------------------------------------------------
def test_greedy_matches_transformers_alone_and_batched(folder, reference):
    items = workload(12, seed=1)
    want = [reference_greedy(reference, p, n) for p, n in items]
    eng = engine(folder)
    alone = [eng.generate(p, GREEDY | {"max_new_tokens": n}).output_ids for p, n in items]
    assert alone == want
    eng.flush_cache()
    together = eng.generate(
        [p for p, _ in items], [GREEDY | {"max_new_tokens": n} for _, n in items]
    )
    assert [r.output_ids for r in together] == want
    idle_blocks_are_free_or_cached(eng)


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_policies_and_chunked_prefill_give_the_same_outputs(folder, policy):
    items = workload(16, seed=2)
    base = engine(folder).generate(
        [p for p, _ in items], [GREEDY | {"max_new_tokens": n} for _, n in items]
    )
    eng = engine(folder, schedule_policy=policy, max_batch_tokens=7)
    got = eng.generate([p for p, _ in items], [GREEDY | {"max_new_tokens": n} for _, n in items])
    assert [r.output_ids for r in got] == [r.output_ids for r in base]
    idle_blocks_are_free_or_cached(eng)


def test_requests_joining_mid_decode(folder, reference):
    items = workload(10, seed=3)
    want = [reference_greedy(reference, p, 12) for p, _ in items]
    eng = engine(folder)
    handles = [eng.submit(p, GREEDY | {"max_new_tokens": 12}) for p, _ in items[:4]]
    for i in range(4, 10):  # one new request every two steps, while the first ones decode
        eng.step()
        eng.step()
        handles.append(eng.submit(items[i][0], GREEDY | {"max_new_tokens": 12}))
    while not all(h.done for h in handles):
        eng.step()
    assert [h.result().output_ids for h in handles] == want


# ---- prefix reuse ------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [8, 11, 12, 13])  # block size 4: on and inside a block
def test_reused_prefix_gives_the_same_logprobs_as_scratch(folder, shared):
    rng = random.Random(shared)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared)]
    first = prefix + [rng.randrange(3, VOCAB) for _ in range(9)]
    second = prefix + [rng.randrange(3, VOCAB) for _ in range(6)]
    params = GREEDY | {"max_new_tokens": 5, "return_logprob": True, "top_logprobs_num": 20}
    params |= {"logprob_start_len": shared}
    eng = engine(folder)
    eng.generate(first, params)
    hit = eng.generate(second, params)
    assert hit.cached_tokens == shared - 1  # scoring position `shared` needs the one before
    fresh = engine(folder).generate(second, params)
    assert fresh.cached_tokens == 0
    assert hit.output_ids == fresh.output_ids
    for a, b in zip(
        hit.prompt_logprobs + [(0, x) for x in hit.output_logprobs],
        fresh.prompt_logprobs + [(0, x) for x in fresh.output_logprobs],
        strict=True,
    ):
        assert a[0] == b[0] and abs(a[1] - b[1]) < 2e-4
    for a, b in zip(hit.output_top_logprobs, fresh.output_top_logprobs, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 2e-4


def test_shared_prefix_is_computed_once(folder):
    rng = random.Random(5)
    prefix = [rng.randrange(3, VOCAB) for _ in range(150)]
    prompts = [
        prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 12))] for _ in range(32)
    ]
    prompts += [prompts[0], prompts[1][:-1]]  # a duplicate, and a prompt that is a prefix
    eng = engine(folder, max_batch_tokens=64)
    eng.generate(prompts, GREEDY | {"max_new_tokens": 3})
    stats = eng.stats()
    trie = distinct_trie_tokens(prompts)
    assert stats["prompt_tokens_computed"] <= trie + len(prompts)
    assert stats["prompt_tokens_reused"] + stats["prompt_tokens_computed"] == sum(map(len, prompts))


def distinct_trie_tokens(prompts: list[list[int]]) -> int:
    nodes: set[tuple[int, ...]] = set()
    for p in prompts:
        nodes.update(tuple(p[: i + 1]) for i in range(len(p)))
    return len(nodes)


def test_prefill_only_request_caches_the_prompt(folder):
    eng = engine(folder)
    prompt = list(range(3, 40))
    r = eng.generate(prompt, {"max_new_tokens": 0})
    assert r.output_ids == [] and r.finish_reason is FinishReason.LENGTH
    assert eng.cache.peek_prefix_len(prompt) == len(prompt)
    again = eng.generate(prompt, {"max_new_tokens": 0})  # all cached: nothing to compute
    assert again.cached_tokens == len(prompt)
    follow = eng.generate([*prompt, 7, 8], GREEDY | {"max_new_tokens": 2})
    assert follow.cached_tokens == len(prompt)


def test_prompt_logprobs_across_chunks_match_transformers(folder, reference):
    prompt = [random.Random(9).randrange(3, VOCAB) for _ in range(23)]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt])).logits[0].float()
    want = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    eng = engine(folder, max_batch_tokens=5)  # the prompt is computed in five chunks
    for start in (0, 1, 6, 22):
        r = eng.generate(
            prompt,
            {
                "max_new_tokens": 0,
                "return_logprob": True,
                "logprob_start_len": start,
                "top_logprobs_num": 3,
            },
        )
        positions = range(start, len(prompt))
        assert [t for t, _ in r.prompt_logprobs] == [prompt[p] for p in positions]
        for p, (_, lp) in zip(positions, r.prompt_logprobs, strict=True):
            if p == 0:
                assert lp is None
            else:
                assert abs(lp - float(want[p - 1])) < 1e-4
                top = r.prompt_top_logprobs[p - start]
                assert top[0][1] >= top[1][1] >= top[2][1] >= lp - 1e-6 or lp >= top[2][1] - 1e-6


# ---- memory pressure ---------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_pool_of_a_tenth_of_the_workload(folder, seed):
    items = workload(64, seed=seed)
    params = [GREEDY | {"max_new_tokens": n} for _, n in items]
    prompts = [p for p, _ in items]
    want = engine(folder, num_blocks=2048).generate(prompts, params)
    total = sum(len(p) + n for p, n in items)
    small = engine(folder, num_blocks=blocks_for(total // 10, 4))
    got = small.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    stats = small.stats()
    assert stats["retractions"] > 0 and stats["evicted_blocks"] > 0  # pressure did happen
    idle_blocks_are_free_or_cached(small)


def test_sequence_longer_than_the_pool_stops_at_length(folder):
    eng = engine(folder, num_blocks=4)  # 16 token slots
    r = eng.generate(list(range(3, 13)), GREEDY | {"max_new_tokens": 50})
    assert r.finish_reason is FinishReason.LENGTH and len(r.output_ids) in (6, 7)
    idle_blocks_are_free_or_cached(eng)


def test_a_cached_prompt_that_fills_the_pool_is_admitted(folder):
    """Its cached prefix fills the pool but for a copy of its partly shared last block, with
    nothing running to free one: it reuses the whole blocks only, instead of waiting forever."""
    eng = engine(folder, num_blocks=9)
    prompt = list(range(10, 45))  # 35 tokens: 9 blocks, the last one partly filled
    eng.generate(prompt, {"max_new_tokens": 0})
    h = eng.submit(prompt, GREEDY | {"max_new_tokens": 1})
    for _ in range(50):
        if h.done:
            break
        eng.step()
    assert h.done and len(h.result().output_ids) == 1
    idle_blocks_are_free_or_cached(eng)


def test_block_copies_a_locked_path_pins_do_not_cut_a_request_short(folder):
    """Prompts that ended inside a block left a copy of it on each node after them; a request
    alone in the pool unpins them instead of ending at length with its sequence fitting."""
    params = GREEDY | {"max_new_tokens": 18}
    prompt = list(range(10, 26))  # 16 tokens + 18 new fit 9 blocks of 4
    eng = engine(folder, num_blocks=9)
    for n in (9, 10, 13):  # each ends inside block 2, one token or more past the last
        eng.generate(prompt[:n], {"max_new_tokens": 0})
    r = eng.generate(prompt, params)
    assert r.cached_tokens == 13
    assert r.output_ids == engine(folder, num_blocks=9).generate(prompt, params).output_ids
    assert len(r.output_ids) == 18
    idle_blocks_are_free_or_cached(eng)


# ---- aborts ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aborts_at_random_points_free_everything(folder, seed):
    rng = random.Random(seed)
    items = workload(24, seed=10 + seed)
    params = [GREEDY | {"max_new_tokens": n + 4} for _, n in items]
    want = engine(folder).generate([p for p, _ in items], params)
    eng = engine(folder, max_batch_tokens=16, max_running_requests=8)
    handles = [eng.submit(p, s) for (p, _), s in zip(items, params, strict=True)]
    doomed = set(rng.sample(range(len(items)), 8))
    step = 0
    states = set()
    while not all(h.done for h in handles):
        for i in sorted(doomed):
            if not handles[i].done and rng.random() < 0.25:
                req = eng._reqs.get(handles[i].request_id)
                if req is not None:
                    states.add(
                        "prefill"
                        if req.is_prefilling and req.blocks
                        else "decode"
                        if req.blocks
                        else "waiting"
                    )
                handles[i].abort()
                doomed.discard(i)
        eng.step()
        step += 1
    for i, h in enumerate(handles):
        r = h.result()
        if r.finish_reason is FinishReason.ABORT:
            assert r.output_ids == want[i].output_ids[: len(r.output_ids)]
        else:
            assert r.output_ids == want[i].output_ids
    assert states  # aborts hit live requests
    idle_blocks_are_free_or_cached(eng)


def test_abort_in_each_state_waiting_prefill_and_decode(folder):
    items = workload(6, seed=21)
    params = GREEDY | {"max_new_tokens": 12}
    want = engine(folder).generate([p for p, _ in items], params)
    eng = engine(folder, max_batch_tokens=6, max_running_requests=3)
    handles = [eng.submit(p, params) for p, _ in items]
    reqs = {}
    eng.step()
    for h in handles:
        reqs[h.request_id] = eng._reqs[h.request_id]

    def find(state):
        for h in handles:
            req = reqs[h.request_id]
            if h.done or req.finish_reason is not None:
                continue
            if state == "waiting" and not req.blocks:
                return h
            if state == "prefill" and req.blocks and req.is_prefilling:
                return h
            if state == "decode" and req.blocks and not req.is_prefilling:
                return h
        return None

    aborted = {}
    for state in ("waiting", "prefill", "decode"):
        while (h := find(state)) is None:
            eng.step()
        h.abort()
        eng.step()  # the abort is taken at the start of the step
        aborted[h.request_id] = state
        assert h.done and h.result().finish_reason is FinishReason.ABORT
    while not all(h.done for h in handles):
        eng.step()
    assert sorted(aborted.values()) == ["decode", "prefill", "waiting"]
    for h, w in zip(handles, want, strict=True):
        r = h.result()
        if h.request_id in aborted:
            assert r.output_ids == w.output_ids[: len(r.output_ids)]
        else:
            assert r.output_ids == w.output_ids
    idle_blocks_are_free_or_cached(eng)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_traffic_under_pressure_keeps_every_invariant(folder, seed):
    """Arrivals between steps, aborts, prefill-only and scoring requests, sampled and greedy
    ones, on a pool far smaller than the traffic: integrity holds after every step (the engine
    checks it), every request finishes, greedy ones as on a large pool, and nothing leaks."""
    rng = random.Random(seed)
    items = workload(40, seed=100 + seed)
    kinds = [rng.choice(["greedy", "greedy", "sampled", "prefill", "scored"]) for _ in items]

    def params(kind: str, n: int) -> dict:
        if kind == "prefill":
            return {"max_new_tokens": 0}
        if kind == "scored":
            return {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 3}
        if kind == "sampled":
            return {"temperature": 1.0, "top_k": 8, "seed": n, "max_new_tokens": n}
        return GREEDY | {"max_new_tokens": n}

    all_params = [params(k, n) for k, (_, n) in zip(kinds, items, strict=True)]
    want = engine(folder, num_blocks=4096).generate([p for p, _ in items], all_params)
    total = sum(len(p) + n for p, n in items)
    eng = engine(
        folder,
        num_blocks=blocks_for(total // 8, 4),
        max_batch_tokens=24,
        max_running_requests=rng.choice([4, 16, 64]),
        schedule_policy=rng.choice(["lpm", "dfs-weight", "fcfs"]),
    )
    handles: list = [None] * len(items)
    pending = list(range(len(items)))
    rng.shuffle(pending)
    aborted = set()
    while pending or not all(h.done for h in handles if h is not None):
        for _ in range(rng.randrange(0, 4)):
            if pending:
                i = pending.pop()
                handles[i] = eng.submit(items[i][0], all_params[i])
        live = [i for i, h in enumerate(handles) if h is not None and not h.done]
        if live and rng.random() < 0.1:
            i = rng.choice(live)
            handles[i].abort()
            aborted.add(i)
        eng.step()
    for i, h in enumerate(handles):
        r = h.result()
        if i in aborted and r.finish_reason is FinishReason.ABORT:
            continue
        assert r.output_ids == want[i].output_ids, (i, kinds[i])
        if kinds[i] == "scored":
            got = [lp for _, lp in r.prompt_logprobs]
            ref = [lp for _, lp in want[i].prompt_logprobs]
            assert len(got) == len(ref) == max(0, len(items[i][0]) - 3)
            assert all(abs(a - b) < 1e-4 for a, b in zip(got, ref, strict=True))
    idle_blocks_are_free_or_cached(eng)


# ---- sampling ----------------------------------------------------------------------------------
def test_seeded_sampling_ignores_the_rest_of_the_batch(folder):
    prompt = list(range(10, 30))
    params = {
        "temperature": 1.0,
        "top_p": 0.9,
        "seed": 1234,
        "max_new_tokens": 12,
        "ignore_eos": True,
    }
    eng = engine(folder)
    alone = eng.generate(prompt, params).output_ids
    others = [list(range(40, 40 + k)) for k in range(1, 8)]
    batch = eng.generate(
        [*others[:3], prompt, *others[3:]],
        [{"temperature": 1.0, "max_new_tokens": 9}] * 3
        + [params]
        + [{"temperature": 1.0, "max_new_tokens": 9}] * 4,
    )
    assert batch[3].output_ids == alone
    other_seed = eng.generate(prompt, params | {"seed": 99}).output_ids
    assert other_seed != alone


def test_stop_token_ids_min_and_max_new_tokens(folder):
    eng = engine(folder)
    prompt = list(range(20, 35))
    free = eng.generate(prompt, GREEDY | {"max_new_tokens": 12}).output_ids
    stop_at = free[4]
    first = free.index(stop_at)
    r = eng.generate(prompt, GREEDY | {"max_new_tokens": 12, "stop_token_ids": [stop_at]})
    assert r.output_ids == free[: first + 1] and r.finish_reason is FinishReason.STOP
    assert r.matched_stop == stop_at
    # min_new_tokens masks the stop token until it is reached
    r = eng.generate(
        prompt, GREEDY | {"max_new_tokens": 12, "min_new_tokens": 12, "stop_token_ids": [stop_at]}
    )
    assert len(r.output_ids) == 12 and stop_at not in r.output_ids
    r = eng.generate(prompt, GREEDY | {"max_new_tokens": 3})
    assert r.output_ids == free[:3] and r.finish_reason is FinishReason.LENGTH


def test_eos_stops_unless_ignored(folder):
    eng = engine(folder)
    assert eng.eos_token_ids == frozenset({2})
    prompt = list(range(50, 60))
    free = eng.generate(prompt, GREEDY | {"max_new_tokens": 8}).output_ids
    r = eng.generate(prompt, {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": []})
    if 2 in free:
        assert r.output_ids == free[: free.index(2) + 1]
    eos_forced = eng.generate(
        prompt, {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [free[0]]}
    )
    assert eos_forced.output_ids == [free[0]]


def test_generated_logprobs_are_the_models(folder, reference):
    prompt = list(range(60, 75))
    r = engine(folder).generate(
        prompt, GREEDY | {"max_new_tokens": 4, "return_logprob": True, "top_logprobs_num": 2}
    )
    seq = prompt + r.output_ids
    with torch.no_grad():
        scores = torch.log_softmax(reference(torch.tensor([seq])).logits[0].float(), -1)
    for i, (tok, lp) in enumerate(zip(r.output_ids, r.output_logprobs, strict=True)):
        row = scores[len(prompt) - 1 + i]
        assert abs(lp - float(row[tok])) < 1e-4
        assert r.output_top_logprobs[i][0][0] == tok == int(row.argmax())


# ---- streaming and the thread ------------------------------------------------------------------
def test_streaming_iterator_async_and_callback(folder):
    eng = engine(folder, background=True, check_integrity_every_step=False)
    try:
        seen = []
        h = eng.submit(list(range(5, 25)), GREEDY | {"max_new_tokens": 10}, on_event=seen.append)
        events = list(h)
        result = h.result()
        assert [t for e in events for t in e.token_ids] == result.output_ids
        assert events[-1].finished and events[-1].finish_reason is FinishReason.LENGTH
        assert [t for e in seen for t in e.token_ids] == result.output_ids

        async def consume():
            h2 = eng.submit(list(range(5, 25)), GREEDY | {"max_new_tokens": 10})
            tokens = [t async for e in h2 for t in e.token_ids]
            return tokens, await h2

        tokens, again = asyncio.run(consume())
        assert tokens == result.output_ids == again.output_ids
        assert again.cached_tokens == 19
    finally:
        eng.shutdown()


def test_submissions_from_many_threads(folder):
    # Deterministic engines: which requests share a batch here follows the threads' timing,
    # and in the default mode a batch's composition moves logits in their last bits (a near
    # tie of the tiny random model would flip a greedy token on an unlucky interleaving).
    items = workload(24, seed=7)
    want = engine(folder, deterministic=True).generate(
        [p for p, _ in items], [GREEDY | {"max_new_tokens": n} for _, n in items]
    )
    eng = engine(folder, background=True, deterministic=True)
    results: dict[int, list[int]] = {}

    def client(indices):
        for i in indices:
            results[i] = (
                eng.submit(items[i][0], GREEDY | {"max_new_tokens": items[i][1]})
                .result()
                .output_ids
            )

    threads = [threading.Thread(target=client, args=(range(k, 24, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(24)] == [r.output_ids for r in want]
    eng.check_integrity()
    stats = eng.stats()
    assert stats["running_requests"] == stats["waiting_requests"] == 0
    assert stats["generated_tokens"] == sum(len(r.output_ids) for r in want)
    eng.shutdown()


def test_shutdown_aborts_what_is_in_flight(folder):
    eng = engine(folder, background=True, check_integrity_every_step=False)
    handles = [
        eng.submit(list(range(5, 30)), {"max_new_tokens": 500, "ignore_eos": True})
        for _ in range(4)
    ]
    eng.shutdown()
    assert all(
        h.result().finish_reason in (FinishReason.ABORT, FinishReason.LENGTH) for h in handles
    )
    assert eng.pool.num_used == eng.pool.num_blocks - eng.pool.num_free
    eng.scheduler.check_integrity()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit([5, 6], {"max_new_tokens": 1})


# ---- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], {}, "empty"),
        ([5, VOCAB], {}, "outside"),
        ([5, -1], {}, "outside"),
        ("text", {}, "no tokenizer"),
        ([5, 6], {"max_new_tokens": -1}, "max_new_tokens"),
        ([5, 6], {"temperature": -0.5}, "temperature"),
        ([5, 6], {"top_p": 0}, "top_p"),
        ([5, 6], {"bogus": 1}, "bogus"),
        ([5, 6], {"stop": ["x"]}, "tokenizer"),
        ([5] * 1024, {}, "context"),
        ([5] * 2000, {"max_new_tokens": 0}, "context"),
    ],
)
def test_bad_requests_are_refused_at_submit(folder, prompt, params, message):
    eng = engine(folder)
    with pytest.raises(RequestError, match=message):
        eng.submit(prompt, params)
    assert eng.generate([5, 6, 7], GREEDY | {"max_new_tokens": 2}).output_ids  # still serving


def test_prompt_larger_than_the_pool_is_refused(folder):
    eng = engine(folder, num_blocks=4)
    with pytest.raises(RequestError, match="KV blocks"):
        eng.submit(list(range(3, 30)), {"max_new_tokens": 1})


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(folder, monkeypatch):
    eng = engine(folder)
    real = eng.runner.model.forward
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if calls["n"] == 2:  # the first decode step
            raise RuntimeError("injected fault")
        return real(*args)

    monkeypatch.setattr(eng.runner.model, "forward", flaky)
    h = eng.submit(list(range(5, 20)), GREEDY | {"max_new_tokens": 6})
    while not h.done:
        eng.step()
    with pytest.raises(GenerationError, match="injected fault"):
        h.result()
    assert h.result(raise_on_error=False).finish_reason is FinishReason.ERROR
    assert len(eng.generate(list(range(5, 20)), GREEDY | {"max_new_tokens": 6}).output_ids) == 6
    idle_blocks_are_free_or_cached(eng)


def test_a_fault_outside_the_model_run_fails_what_is_queued_and_the_engine_goes_on(
    folder, monkeypatch
):
    eng = engine(folder, background=True)
    try:
        real = eng.scheduler.schedule
        all_submitted, failed = threading.Event(), []

        def broken():
            # The engine steps on only once all three are submitted (a loaded machine may run
            # steps between two submits), and fails once it holds all three.
            all_submitted.wait(timeout=60)
            held = len(eng.scheduler.waiting) + len(eng.scheduler.running)
            if not failed and held == 3:
                failed.append(True)
                raise RuntimeError("scheduler bug")
            return real()

        monkeypatch.setattr(eng.scheduler, "schedule", broken)
        handles = [
            eng.submit(list(range(5, 20)), GREEDY | {"max_new_tokens": 30}) for _ in range(3)
        ]
        all_submitted.set()
        results = [h.result(timeout=60, raise_on_error=False) for h in handles]
        assert all(r.finish_reason is FinishReason.ERROR for r in results)
        assert "scheduler bug" in results[0].error
        again = eng.submit(list(range(5, 20)), GREEDY | {"max_new_tokens": 4}).result(timeout=60)
        assert len(again.output_ids) == 4
        eng.check_integrity()
    finally:
        eng.shutdown()


def test_flush_is_refused_while_requests_run(folder):
    eng = engine(folder)
    h = eng.submit(list(range(5, 20)), GREEDY | {"max_new_tokens": 6})
    eng.step()
    with pytest.raises(CacheBusyError, match="1 running and 0 waiting"):
        eng.flush_cache()
    while not h.done:
        eng.step()
    assert eng.flush_cache() is True


def test_duplicate_request_ids_are_refused(folder):
    eng = engine(folder)
    eng.submit([5, 6], {"max_new_tokens": 2}, request_id="a")
    with pytest.raises(RequestError, match="already in use"):
        eng.submit([5, 6], {"max_new_tokens": 2}, request_id="a")


# ---- helpers -----------------------------------------------------------------------------------
def test_parse_memory():
    assert parse_memory("2GiB") == 2 * 2**30
    assert parse_memory("512MB") == 512 * 10**6
    assert parse_memory(1000) == 1000
    with pytest.raises(ValueError, match="kv_memory"):
        parse_memory("lots")


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5] * 100 + [1], [5] * 100 + [2]) == 100


class _R:
    def __init__(self, tokens, arrival, cache_salt=""):
        self.tokens, self.arrival, self.cache_salt = tokens, arrival, cache_salt


def test_dfs_weight_order_groups_shared_prefixes_largest_first():
    R = _R

    reqs = [
        R([1, 2, 3], 0),
        R([9, 9], 1),
        R([1, 2, 4], 2),
        R([9, 8], 3),
        R([1, 5], 4),
        R([7], 5),
        R([1, 2, 3], 6),
    ]
    order = [r.arrival for r in dfs_weight_order(reqs)]
    # [1, ...] holds four requests, [9, ...] two, [7] one; inside [1, 2, ...] the 3s (two) first
    assert order == [0, 6, 2, 4, 1, 3, 5] or order == [0, 6, 2, 4, 3, 1, 5]


def test_dfs_weight_order_never_groups_requests_of_different_salts():
    # Same tokens, two tenants: a prefix is shared only within a salt, so each salt's
    # requests come out together, the salt with more requests first.
    reqs = [_R([1, 2, 3], 0, "a"), _R([1, 2, 3], 1, "b"), _R([1, 2, 4], 2, "a"),
            _R([1, 2, 3], 3, "b"), _R([1, 2, 3], 4, "b"), _R([5], 5, "a"),
            _R([9], 6, "b")]  # fmt: skip
    order = [(r.cache_salt, r.arrival) for r in dfs_weight_order(reqs)]
    assert order[:4] == [("b", 1), ("b", 3), ("b", 4), ("b", 6)]
    assert order[4:] in ([("a", 0), ("a", 2), ("a", 5)], [("a", 2), ("a", 0), ("a", 5)])


def test_allocation_failures_delay_requests_but_fail_none(folder, monkeypatch):
    """The pool refuses a third of its allocations at random (as a device out of memory
    would): admissions and growth wait for the next step instead, every request still ends
    with its greedy output, no reference is left behind, and integrity holds every step."""
    items = workload(24, seed=7)
    params = [GREEDY | {"max_new_tokens": n} for _, n in items]
    want = [r.output_ids for r in engine(folder).generate([p for p, _ in items], params)]
    eng = engine(folder, num_blocks=64, max_batch_tokens=32)
    rng = random.Random(3)
    alloc = eng.pool.alloc
    refused = 0

    def flaky_alloc(n):
        nonlocal refused
        if n and rng.random() < 1 / 3:
            refused += 1
            raise OutOfBlocksError(n, eng.pool.num_free, eng.pool.num_blocks)
        return alloc(n)

    monkeypatch.setattr(eng.pool, "alloc", flaky_alloc)
    results = eng.generate([p for p, _ in items], params)
    assert refused > 10
    assert [r.finish_reason for r in results] == [FinishReason.LENGTH] * len(items)
    assert [r.output_ids for r in results] == want
    assert eng.scheduler.counters.retractions > 0  # growth refused: the request waited
    monkeypatch.undo()
    idle_blocks_are_free_or_cached(eng)


# ---- on a GPU (compiled Triton kernels) --------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_engine_on_cuda_matches_cpu_also_under_memory_pressure(folder):
    items = workload(48, seed=4)
    prompts = [p for p, _ in items]
    params = [GREEDY | {"max_new_tokens": n} for _, n in items]
    want = [r.output_ids for r in engine(folder).generate(prompts, params)]
    gpu = engine(folder, device="cuda")
    assert [r.output_ids for r in gpu.generate(prompts, params)] == want
    idle_blocks_are_free_or_cached(gpu)
    total = sum(len(p) + n for p, n in items)
    small = engine(folder, device="cuda", num_blocks=blocks_for(total // 10, 4))
    assert [r.output_ids for r in small.generate(prompts, params)] == want
    assert small.stats()["retractions"] > 0
    idle_blocks_are_free_or_cached(small)


@pytest.mark.gpu
@needs_cuda
def test_seeded_sampling_and_logprobs_on_cuda(folder, reference):
    eng = engine(folder, device="cuda")
    prompt = list(range(10, 30))
    params = {"temperature": 0.9, "top_k": 20, "seed": 7, "max_new_tokens": 10, "ignore_eos": True}
    alone = eng.generate(prompt, params).output_ids
    batch = eng.generate([[5, 6, 7], prompt, [8, 9]], [params | {"seed": 1}, params, {}])
    assert batch[1].output_ids == alone
    r = eng.generate(prompt, GREEDY | {"max_new_tokens": 3, "return_logprob": True})
    with torch.no_grad():
        scores = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert r.output_ids[0] == int(scores.argmax())
    assert abs(r.output_logprobs[0] - float(scores.max())) < 1e-4


def test_callbacks_may_submit_but_not_wait_on_the_engine_thread(folder):
    eng = engine(folder, background=True, check_integrity_every_step=False)
    try:
        follow_ups, errors = [], []

        def on_event(event):
            if event.finished:
                follow_ups.append(eng.submit([7, 8, 9], GREEDY | {"max_new_tokens": 2}))
                try:
                    eng.generate([7, 8], GREEDY | {"max_new_tokens": 1})
                except RuntimeError as e:
                    errors.append(str(e))

        eng.submit(list(range(5, 15)), GREEDY | {"max_new_tokens": 3}, on_event=on_event).result()
        assert len(follow_ups[0].result(timeout=60).output_ids) == 2
        assert errors and "use submit()" in errors[0]
    finally:
        eng.shutdown()


# ---- cache salts -------------------------------------------------------------------------------
def run_salted(eng: Engine, prompt: list[int], salt: str | None, via_request: bool = False):
    if via_request:
        from radixlang.runtime.request import GenerateRequest

        request = GenerateRequest(input_ids=prompt, sampling=GREEDY | {"max_new_tokens": 2})
        request.cache_salt = salt or ""
        handle = eng.submit(request)
    else:
        handle = eng.submit(prompt, GREEDY | {"max_new_tokens": 2}, cache_salt=salt)
    while not handle.done:
        eng.step()
    return handle.result()


def test_cache_salt_isolates_prefixes(folder):
    eng = engine(folder)
    prompt = [random.Random(31).randrange(3, VOCAB) for _ in range(40)]
    first = run_salted(eng, prompt, "a")
    assert first.cached_tokens == 0
    again = run_salted(eng, prompt, "a", via_request=True)
    assert again.cached_tokens >= 36  # reused within the salt
    other = run_salted(eng, prompt, "b")
    assert other.cached_tokens == 0  # never across salts
    default = run_salted(eng, prompt, None)
    assert default.cached_tokens == 0  # nor with the default salt
    assert run_salted(eng, prompt, "").cached_tokens >= 36
    assert run_salted(eng, prompt, "b").cached_tokens >= 36
    assert again.output_ids == other.output_ids == default.output_ids == first.output_ids
    with pytest.raises(RequestError, match="cache_salt"):
        eng.submit(prompt, GREEDY, cache_salt="x" * (MAX_CACHE_SALT_CHARS + 1))
    idle_blocks_are_free_or_cached(eng)


def test_requests_of_different_salts_do_not_wait_for_each_other(folder):
    """A waiting request is deferred behind an in-flight one that computes its prefix only when
    both have one salt: another salt's prefill would never be reused."""
    eng = engine(folder, max_batch_tokens=8)
    prompt = [random.Random(32).randrange(3, VOCAB) for _ in range(40)]
    handles = [
        eng.submit(prompt, GREEDY | {"max_new_tokens": 1}, cache_salt=salt)
        for salt in ("a", "b", "a")
    ]
    while not all(h.done for h in handles):
        eng.step()
    a1, b, a2 = (h.result() for h in handles)
    assert b.cached_tokens == 0 and a1.cached_tokens == 0
    assert a2.cached_tokens > 0
    idle_blocks_are_free_or_cached(eng)


def test_a_saved_cache_keeps_its_salts(folder, tmp_path):
    prompt = [random.Random(33).randrange(3, VOCAB) for _ in range(30)]
    e = engine(folder, cache_dir=tmp_path)
    run_salted(e, prompt, "a")
    e.shutdown()
    again = engine(folder, cache_dir=tmp_path)
    assert again.cache_load_report["loaded"] is True
    assert again.cache.salts == ["", "a"]
    assert run_salted(again, prompt, None).cached_tokens == 0
    assert run_salted(again, prompt, "a").cached_tokens >= 28
    again.check_integrity()
    again.shutdown()
