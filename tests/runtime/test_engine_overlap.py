"""The engine's tests again with overlapped scheduling on (``runtime/overlap.py``), plus the
overlap's own: its outputs are the ones without it, its placeholders never leak into results,
and its ordering holds under stops, aborts, memory pressure and failures."""

from __future__ import annotations

import pytest
from test_engine import *  # noqa: F403  (every engine test, run again with overlap on)
from test_engine import GREEDY, engine, idle_blocks_are_free_or_cached

import radixlang.runtime.engine as engine_module


@pytest.fixture(autouse=True)
def overlap_on(monkeypatch):
    """Every engine made in these tests overlaps its steps (unless it has a host tier)."""
    choose = engine_module._choose_overlap

    def forced(overlap, device, host_tier_memory):
        if overlap is None and not engine_module.parse_memory(host_tier_memory):
            overlap = True
        return choose(overlap, device, host_tier_memory)

    monkeypatch.setattr(engine_module, "_choose_overlap", forced)


def test_the_engines_here_overlap(folder):
    eng = engine(folder)
    try:
        assert eng.overlap and eng._stepper.device is not None  # step_loop.Overlapped
        out = eng.generate([5, 6, 7], {**GREEDY, "max_new_tokens": 4})
        assert len(out.output_ids) == 4
    finally:
        eng.shutdown()


# ---- the overlap's own tests ----------------------------------------------------------------
import random  # noqa: E402
import threading  # noqa: E402

from radixlang.runtime.overlap import (  # noqa: E402
    DeviceWorker,
    PreviousStepFailed,
    placeholder,
    placeholder_row,
    resolve_placeholders,
)


def test_placeholders_name_rows_of_the_previous_step():
    assert [placeholder(r) for r in range(3)] == [-1, -2, -3]
    assert [placeholder_row(placeholder(r)) for r in (0, 7, 300)] == [0, 7, 300]
    assert resolve_placeholders([placeholder(2), placeholder(0)], [40, 41, 42]) == [42, 40]
    with pytest.raises(PreviousStepFailed):
        resolve_placeholders([placeholder(0)], None)
    assert resolve_placeholders([], None) == []  # nothing to resolve: fine after a failure


def test_the_device_worker_runs_work_in_submission_order():
    worker = DeviceWorker()
    try:
        seen: list[int] = []
        futures = [worker.submit(lambda i=i: seen.append(i) or i) for i in range(50)]
        assert [f.result() for f in futures] == list(range(50))
        assert seen == list(range(50))
        # run() from the worker itself runs inline instead of waiting for itself.
        assert worker.run(lambda: worker.run(lambda: threading.current_thread().name)) == (
            worker.thread.name
        )
        boom = worker.submit(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            boom.result()
        assert worker.run(lambda: "still serving") == "still serving"
    finally:
        worker.close()
    assert not worker.thread.is_alive()


def mixed_workload(n: int, seed: int) -> list[tuple[list[int], dict]]:
    """Prompts sharing prefixes, with greedy and seeded sampled rows, stop tokens that end
    some requests early, min_new_tokens, logprobs."""
    rng = random.Random(seed)
    head = [rng.randrange(3, VOCAB) for _ in range(12)]  # noqa: F405
    items = []
    for i in range(n):
        prompt = head[: rng.randrange(0, 13)] + [rng.randrange(3, VOCAB) for _ in range(5)]  # noqa: F405
        params: dict = {"max_new_tokens": rng.randrange(1, 24), "ignore_eos": True}
        if i % 2:
            params |= {"temperature": 0.8, "top_p": 0.9, "seed": 1000 + i}
        else:
            params["temperature"] = 0
        if i % 3 == 0:
            params["stop_token_ids"] = [rng.randrange(3, VOCAB) for _ in range(12)]  # noqa: F405
        if i % 4 == 1:
            params["min_new_tokens"] = 3
        if i % 5 == 2:
            params |= {"return_logprob": True, "top_logprobs_num": 2}
        items.append((prompt, params))
    return items


on_cuda = [pytest.mark.gpu, needs_cuda]  # noqa: F405


@pytest.mark.parametrize(
    "seed, device",
    [(0, "cpu"), (1, "cpu"), pytest.param(0, "cuda", marks=on_cuda)],
)
def test_overlapped_outputs_are_the_ones_without_overlap(folder, seed, device):
    """Token for token, logprob for logprob, and the same finish reasons; streams carry the
    output in order and never a placeholder; every block comes back. (On CUDA both runs
    replay CUDA graphs for their decode steps.)"""
    items = mixed_workload(24, seed)
    results = {}
    for overlap in (False, True):
        eng = engine(folder, overlap=overlap, num_blocks=96, device=device)
        try:
            streamed: dict[str, list[int]] = {}

            def on_event(event, streamed=streamed):
                assert all(t >= 0 for t in event.token_ids)
                streamed.setdefault(event.request_id, []).extend(event.token_ids)

            handles = [eng.submit(p, params, on_event=on_event) for p, params in items]
            while not all(h.done for h in handles):
                eng.step()
            out = [h.result() for h in handles]
            for h, r in zip(handles, out, strict=True):
                assert streamed.get(h.request_id, []) == r.output_ids
                assert all(t >= 0 for t in r.output_ids)
            results[overlap] = [
                (r.output_ids, r.finish_reason, r.matched_stop, r.output_logprobs) for r in out
            ]
            results[overlap].append(eng.stats()["cached_tokens"])  # the same cache left
            assert any(r.finish_reason.value == "stop" for r in out)  # some stopped early
            assert (eng.stats()["overlapped_steps"] > 10) == overlap
            idle_blocks_are_free_or_cached(eng)
        finally:
            eng.shutdown()
    assert results[True] == results[False]


def test_the_host_goes_on_while_a_step_runs(folder):
    """step() submits a decode step and returns with it still running on the device thread,
    having taken the previous step's tokens; the next step() waits for it."""
    eng = engine(folder, overlap=True)
    try:
        real = eng.runner.model.forward
        gate, entered = threading.Event(), threading.Event()

        def gated(*args):
            entered.set()
            assert gate.wait(30), "the test never opened the gate"
            return real(*args)

        handles = [eng.submit([5 + i, 6, 7, 8], GREEDY | {"max_new_tokens": 8}) for i in range(3)]
        eng.step()  # the prefill: one at a time
        eng.step()  # the first decode step: submitted
        eng.step()  # the second: submitted; the first one's tokens taken
        emitted = [len(h.result(timeout=0).output_ids) if h.done else None for h in handles]
        assert emitted == [None] * 3
        streamed_before = eng.stats()["generated_tokens"]
        eng._inflight.future.result()  # the second step ran on the real forward
        eng.runner.model.forward = gated
        entered.clear()
        eng.step()  # the third decode step blocks on the device thread...
        assert entered.wait(10)
        assert not gate.is_set()  # ... yet step() came back, with the second step's tokens
        assert eng.stats()["generated_tokens"] == streamed_before + 3
        gate.set()
        while not all(h.done for h in handles):
            eng.step()
        assert all(len(h.result().output_ids) == 8 for h in handles)
        idle_blocks_are_free_or_cached(eng)
    finally:
        gate.set()
        eng.shutdown()


def test_requests_that_need_each_token_turn_the_overlap_off_while_they_run(folder):
    """A penalty reads the output so far: with such a request present, steps run one at a
    time (and it gets the tokens it would without overlap); after it, they overlap again."""
    penalised = GREEDY | {"max_new_tokens": 10, "repetition_penalty": 1.5}
    eng = engine(folder, overlap=True)
    ref = engine(folder, overlap=False)
    try:
        out = eng.generate(
            [[5, 6, 7, 8], [9, 10, 11]], [penalised, GREEDY | {"max_new_tokens": 10}]
        )
        assert eng.stats()["overlapped_steps"] == 0
        expected = ref.generate(
            [[5, 6, 7, 8], [9, 10, 11]], [penalised, GREEDY | {"max_new_tokens": 10}]
        )
        assert [r.output_ids for r in out] == [r.output_ids for r in expected]
        eng.generate([9, 10, 11], GREEDY | {"max_new_tokens": 10})
        assert eng.stats()["overlapped_steps"] > 0
    finally:
        eng.shutdown()
        ref.shutdown()


def test_overlap_with_a_host_tier_is_refused(folder):
    with pytest.raises(ValueError, match="host tier"):
        engine(folder, overlap=True, host_tier_memory="1MiB")
    eng = engine(folder, host_tier_memory="1MiB")
    try:
        assert not eng.overlap
    finally:
        eng.shutdown()


def test_overlap_with_the_engine_thread_and_aborts(folder):
    """The background engine thread, streams read from another thread, aborts landing at any
    point: every request ends, nothing leaks."""
    eng = engine(folder, overlap=True, background=True, check_integrity_every_step=True)
    try:
        rng = random.Random(3)
        handles = [
            eng.submit([rng.randrange(3, 150) for _ in range(6)], GREEDY | {"max_new_tokens": 30})
            for _ in range(12)
        ]
        for h in handles[::3]:
            h.abort()
        results = [h.result(timeout=60, raise_on_error=False) for h in handles]
        assert all(t >= 0 for r in results for t in r.output_ids)
        assert {r.finish_reason.value for r in results} <= {"abort", "length"}
        assert sum(len(r.output_ids) == 30 for r in results) >= 8
        eng.check_integrity()
        assert eng.flush_cache(wait=10)
        assert eng.pool.num_free == eng.pool.num_blocks
    finally:
        eng.shutdown()


def test_the_scheduler_waits_for_tokens_still_being_sampled():
    """A request whose last token is a placeholder is not admitted (it was retracted with its
    token in flight), and a running one whose placeholder is its last allowed token is not
    scheduled again: it has nothing left to compute."""
    from radixlang.runtime.block_pool import BlockPool
    from radixlang.runtime.radix_cache import RadixCache
    from radixlang.runtime.request import Req
    from radixlang.runtime.sampling import SamplingParams
    from radixlang.runtime.scheduler import Scheduler

    pool = BlockPool(64, 4)
    scheduler = Scheduler(pool, RadixCache(pool))
    req = Req("a", [5, 6, 7], SamplingParams(max_new_tokens=2), frozenset(), 2)
    req.tokens.append(placeholder(0))
    scheduler.add(req)
    assert not scheduler.schedule().chunks and scheduler.waiting == [req]
    req.tokens[-1] = 9  # its token came back
    (chunk,) = scheduler.schedule().chunks
    assert chunk.req is req and (chunk.start, chunk.end) == (0, 4)
    scheduler.commit(chunk)
    req.tokens.append(placeholder(0))  # its second and last token is being sampled
    assert req.awaits_last_token
    assert not scheduler.schedule().chunks and scheduler.running == [req]
    scheduler.check_integrity()
