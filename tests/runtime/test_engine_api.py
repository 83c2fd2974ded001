"""The engine's API surface on the tiny chat model: ``model``/``model_path``, ``threads``, the
``"auto"`` dtype, ``stats`` and ``reset_stats``, ``flush_cache(wait=...)`` and
``CacheBusyError``."""

from __future__ import annotations

import inspect
import itertools
import time
from pathlib import Path

import pytest
import torch
from engine_gate import hold_steps  # tests/, on the path through tests/conftest.py

from radixlang.runtime import CacheBusyError, Engine
from radixlang.runtime.cpu_threads import PROC_STAT, ThreadGovernor
from radixlang.runtime.dtype_choice import choose_dtype

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = list(range(100, 140))

# The figures stats() keeps since start (or the last reset), and those that describe now.
CUMULATIVE = (
    "steps",
    "generated_tokens",
    "finished_requests",
    "finished_stop",
    "finished_length",
    "finished_abort",
    "finished_error",
    "prompt_tokens",
    "prompt_tokens_reused",
    "prompt_tokens_computed",
    "recomputed_tokens",
    "tier_loaded_tokens",
    "swapped_out_blocks",
    "retractions",
    "evicted_blocks",
    "jump_forward_tokens",
    "jump_forward_jumps",
    "overlapped_steps",
    "grammar_mask_steps",
    "grammar_mask_ms_p50",
    "grammar_mask_ms_p99",
    "grammar_mask_wait_ms_p50",
    "grammar_mask_wait_ms_p99",
    "cache_hit_rate",
    "busy_tokens_per_second",
)
STATE = (
    "running_requests",
    "waiting_requests",
    # Retention (programs paused at tool calls): what is retained now, and since the start.
    "retained_keys",
    "retained_paths",
    "retained_blocks",
    "retained_total",
    "retained_evicted_blocks_total",
    # Predicted returns: programs paused now, and the median gap between their calls.
    "paused_programs",
    "return_gap_median_s",
    "blocks_total",
    "blocks_free",
    "blocks_used",
    "blocks_evictable",
    "cached_tokens",
    # The forward passes' CPU threads now, and (adaptive threads) changes since the start and
    # what other processes used at the last look.
    "cpu_threads",
    "cpu_thread_changes",
    "other_cores_busy",
)


@pytest.fixture(scope="module")
def threaded(chat_model_dir):
    """An engine on its own thread, with room for sequences of 1000 tokens."""
    engine = Engine(chat_model_dir, num_blocks=600, block_size=4, dtype="float32")
    yield engine
    engine.shutdown()


def stepped(chat_model_dir, **kw) -> Engine:
    kw.setdefault("num_blocks", 256)
    return Engine(
        chat_model_dir, block_size=4, background=False, check_integrity_every_step=True, **kw
    )


def run(engine: Engine, handles) -> None:
    while not all(h.done for h in handles):
        engine.step()


# ---- model and model_path ------------------------------------------------------------------
def test_model_path_is_an_alias_of_model(chat_model_dir):
    by_alias = Engine(model_path=chat_model_dir, num_blocks=8, background=False)
    assert by_alias.files.path == stepped(chat_model_dir, num_blocks=8).files.path
    assert inspect.signature(Engine).parameters["model"].default is None  # the default model
    with pytest.raises(TypeError, match="both model and model_path"):
        Engine(chat_model_dir, model_path=chat_model_dir, num_blocks=8, background=False)


# ---- threads -------------------------------------------------------------------------------
def test_threads_is_the_torch_thread_count_of_the_engine_thread(chat_model_dir):
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2  # differs from the default, so the test can fail
    seen: list[int] = []
    engine = Engine(chat_model_dir, num_blocks=64, threads=want)
    try:
        assert engine.threads == want
        # on_event runs on the engine thread: the thread whose OpenMP team runs the forwards.
        handle = engine.submit(
            PROMPT,
            GREEDY | {"max_new_tokens": 2},
            on_event=lambda e: seen.append(torch.get_num_threads()),
        )
        assert len(handle.result(timeout=60).output_ids) == 2
        assert seen and set(seen) == {want}
    finally:
        engine.shutdown()
        torch.set_num_threads(before)  # torch keeps the count process-wide: restore it


@pytest.mark.parametrize("threads", [0, -2, 1.5, True, "4"])
def test_bad_threads_are_refused_before_anything_loads(threads):
    with pytest.raises(ValueError, match="threads must be None or an int >= 1"):
        Engine("no-such-model", threads=threads)


# ---- dtype ---------------------------------------------------------------------------------
def test_auto_dtype_is_the_default_and_the_engine_reports_its_choice(chat_model_dir):
    assert inspect.signature(Engine).parameters["dtype"].default == "auto"
    chosen = stepped(chat_model_dir, num_blocks=8)
    auto = choose_dtype("auto", "cpu")  # the hardware's pick, or $RADIXLANG_AUTO_DTYPE's
    assert chosen.dtype == str(auto).removeprefix("torch.")
    assert chosen.runner.dtype == auto
    assert chosen.runner.kv.dtype == auto  # the KV cache follows the weights
    assert stepped(chat_model_dir, num_blocks=8, dtype="bfloat16").dtype == "bfloat16"
    assert stepped(chat_model_dir, num_blocks=8, dtype=torch.float32).dtype == "float32"


# ---- stats and reset_stats -----------------------------------------------------------------
class BusyMachine:
    """/proc as a governor reads it on a 4-core machine that other processes keep busy: every
    read of /proc/stat finds 400 more busy ticks, none of them this process's."""

    def __init__(self) -> None:
        self.ticks = 0

    def read(self, path: Path) -> str:
        if path == PROC_STAT:
            self.ticks += 400
            return f"cpu  {self.ticks} 0 0 1000 0 0 0 0 0 0\n"
        return "1 (python) S " + " ".join(["0"] * 10 + ["7", "3"] + ["0"] * 8)


def test_reset_stats_zeroes_the_cumulative_figures_and_keeps_the_state(chat_model_dir, monkeypatch):
    # The thread governor on (off in tests by default), so that its figures are in the stats,
    # reading a made-up busy machine, not this one's /proc: its first look lowers the threads
    # to 1, once, whatever else runs here. (torch's count is process-wide: restored below.)
    from radixlang.runtime import engine as engine_module

    machine, ticks = BusyMachine(), itertools.count()
    monkeypatch.setattr(engine_module, "ThreadGovernor", lambda: ThreadGovernor(
        max_threads=2, cores=4, read=machine.read, clock=lambda: float(next(ticks))))  # fmt: skip
    threads = torch.get_num_threads()
    try:
        _reset_stats_checks(chat_model_dir)
    finally:
        torch.set_num_threads(threads)


def _reset_stats_checks(chat_model_dir) -> None:
    # A pool of 32 blocks for 6 sequences of 15 blocks each: retractions and evictions happen.
    engine = stepped(chat_model_dir, num_blocks=32, adapt_threads=True)
    handles = [engine.submit([*PROMPT[:20], i], GREEDY | {"max_new_tokens": 40}) for i in range(6)]
    handles.append(engine.submit("The answer is", {"regex": r"hello world [0-9]", "seed": 1}))
    run(engine, handles)
    run(engine, [engine.submit([*PROMPT[:20], 0], GREEDY | {"max_new_tokens": 1})])  # a hit
    before = engine.stats()
    for key in ("steps", "generated_tokens", "finished_requests", "finished_length",
                "finished_stop", "prompt_tokens", "prompt_tokens_reused",
                "prompt_tokens_computed", "retractions", "evicted_blocks",
                "jump_forward_tokens", "jump_forward_jumps", "grammar_mask_steps",
                "cache_hit_rate", "busy_tokens_per_second"):  # fmt: skip
        assert before[key] > 0, key  # the workload did exercise every counter checked below
    # The governor's figures: one change, to the one thread the busy machine leaves.
    assert (before["cpu_threads"], before["cpu_thread_changes"]) == (1, 1)
    assert before["other_cores_busy"] == 4.0

    engine.reset_stats()
    after = engine.stats()
    assert set(after) == set(before)
    assert set(CUMULATIVE) | set(STATE) | {"tokens_per_second"} == set(after)
    assert {key: after[key] for key in CUMULATIVE} == dict.fromkeys(CUMULATIVE, 0)
    assert {key: after[key] for key in STATE} == {key: before[key] for key in STATE}
    assert after["cached_tokens"] > 0
    assert after["tokens_per_second"] > 0  # over the last seconds: not a counter

    # The next request counts from zero; the cache still serves its prefix.
    prompt = [*PROMPT[:20], 1, 2, 3]
    result = engine.generate(prompt, GREEDY | {"max_new_tokens": 5})
    again = engine.stats()
    assert again["finished_requests"] == again["finished_length"] == 1
    assert again["generated_tokens"] == len(result.output_ids) == 5
    assert again["prompt_tokens"] == len(prompt)
    assert again["prompt_tokens_reused"] == result.cached_tokens > 0
    assert again["prompt_tokens_reused"] + again["prompt_tokens_computed"] == len(prompt)
    assert 1 <= again["steps"] <= 5
    assert again["retractions"] == again["jump_forward_tokens"] == 0


def test_reset_stats_on_a_running_engine_thread(threaded):
    threaded.generate(PROMPT, GREEDY | {"max_new_tokens": 3})
    assert threaded.stats()["generated_tokens"] > 0
    threaded.reset_stats()
    assert threaded.stats()["generated_tokens"] == 0
    threaded.generate(PROMPT, GREEDY | {"max_new_tokens": 3})
    assert threaded.stats()["generated_tokens"] == 3


# ---- flush_cache ---------------------------------------------------------------------------
def test_flush_waits_for_requests_in_flight_then_flushes(threaded):
    handle = threaded.submit(PROMPT, GREEDY | {"max_new_tokens": 40})
    assert threaded.flush_cache(wait=60) is True
    assert handle.done and len(handle.result().output_ids) == 40
    stats = threaded.stats()
    assert stats["cached_tokens"] == 0 and stats["blocks_free"] == stats["blocks_total"]


def test_flush_with_requests_still_in_flight_raises_and_flushes_nothing(threaded):
    threaded.generate(PROMPT, GREEDY | {"max_new_tokens": 1})  # something cached
    cached = threaded.stats()["cached_tokens"]
    # Held after its first token: it is still running whatever the machine's speed.
    with hold_steps(threaded, after_tokens=1) as gate:
        handle = threaded.submit(PROMPT[:5], GREEDY | {"max_new_tokens": 40})
        try:
            gate.wait_holding()
            busy = r"1 running and 0 waiting requests are in flight"
            with pytest.raises(CacheBusyError, match=busy):
                threaded.flush_cache()
            started = time.perf_counter()
            with pytest.raises(CacheBusyError, match=r"after waiting 0\.2 s"):
                threaded.flush_cache(wait=0.2)
            assert time.perf_counter() - started >= 0.2
            assert not handle.done
            assert threaded.stats()["cached_tokens"] >= cached  # nothing was flushed
        finally:
            handle.abort()
    handle.result(timeout=60, raise_on_error=False)
    assert threaded.flush_cache(wait=10) is True
    assert threaded.stats()["cached_tokens"] == 0


def test_flush_cannot_wait_on_the_engine_thread(threaded):
    outcomes: list[str] = []

    def on_event(event) -> None:
        if not outcomes:
            try:
                threaded.flush_cache(wait=30)
                outcomes.append("flushed")
            except CacheBusyError:
                outcomes.append("busy")

    threaded.submit(PROMPT, GREEDY | {"max_new_tokens": 3}, on_event=on_event).result(timeout=60)
    assert outcomes == ["busy"]  # at once: waiting there would block the requests it waits for


def test_flush_without_an_engine_thread_steps_the_requests_to_their_end(chat_model_dir):
    engine = stepped(chat_model_dir)
    handle = engine.submit(PROMPT, GREEDY | {"max_new_tokens": 6})
    engine.step()
    with pytest.raises(CacheBusyError):
        engine.flush_cache()
    assert engine.flush_cache(wait=None) is True
    assert len(handle.result().output_ids) == 6
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("wait", [-1, float("nan"), "1", True])
def test_bad_flush_waits_are_refused(threaded, wait):
    with pytest.raises(ValueError, match="flush_cache"):
        threaded.flush_cache(wait=wait)


# ---- max_context -----------------------------------------------------------------------------
def test_max_context_caps_prompts_and_outputs(chat_model_dir):
    from radixlang.runtime import RequestError, SamplingParams

    engine = stepped(chat_model_dir, max_context=40)
    assert engine.max_context == 40 < engine.runner.max_context
    with pytest.raises(RequestError, match="context window is 40"):
        engine.submit(list(range(5, 45)), {"max_new_tokens": 4})
    # A max_new_tokens given that does not fit is refused, with the numbers (as SGLang and
    # OpenAI answer it); one that just fits is not.
    prompt = list(range(5, 35))  # 30 tokens: 10 more fit
    for asked, sampling in (
        (100, {"max_new_tokens": 100}),
        (11, SamplingParams(max_new_tokens=11)),
    ):
        with pytest.raises(RequestError) as refused:
            engine.submit(prompt, sampling)
        message = str(refused.value)
        assert message.startswith("max_new_tokens")  # the field, first (the server names it)
        for number in (f"is {asked}", "30 tokens", "at most 10", "window of 40"):
            assert number in message, message
    fits = engine.submit(prompt, {"max_new_tokens": 10, "ignore_eos": True})
    # Left unset, max_new_tokens is the default (128) cut to fit: nobody asked for more.
    default = engine.submit(prompt, {"ignore_eos": True})
    run(engine, [fits, default])
    assert fits.result().completion_tokens == default.result().completion_tokens == 10
    engine.check_integrity()


def test_allow_auto_truncate_cuts_max_new_tokens_to_fit(chat_model_dir):
    from radixlang.runtime import RequestError

    engine = stepped(chat_model_dir, max_context=40, allow_auto_truncate=True)
    handle = engine.submit(list(range(5, 35)), {"max_new_tokens": 100, "ignore_eos": True})
    run(engine, [handle])
    assert handle.result().completion_tokens == 10  # cut to fit 40 tokens in all
    with pytest.raises(RequestError, match="context window is 40"):  # a prompt is never cut
        engine.submit(list(range(5, 45)), {"max_new_tokens": 4})
    engine.check_integrity()
    with pytest.raises(ValueError, match="allow_auto_truncate must be True or False"):
        Engine("no-such-model", allow_auto_truncate="yes")


@pytest.mark.parametrize("cap", [0, -3, 2.5, True])
def test_bad_max_context_is_refused_before_anything_loads(cap):
    with pytest.raises(ValueError, match="max_context must be a positive integer"):
        Engine("no-such-model", max_context=cap)


def test_max_context_above_the_models_is_refused(chat_model_dir):
    with pytest.raises(ValueError, match="exceeds the model's context window"):
        stepped(chat_model_dir, max_context=10**7)
