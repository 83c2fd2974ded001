"""The soak (benchmarks/bench_soak.py) at CI size: 300 requests from 30 loopback clients over
every route, on a KV pool about a quarter of the working set, with 20% of the requests dropped
by their clients, aborts, a slow client that stops reading, and injected faults (model runs,
the tokenizer, constraints, allocations). Nothing is lost or leaked (``bench_soak.check``).
The full run: ``.venv/bin/python benchmarks/bench_soak.py`` (2,000 requests, 100 clients)."""

import json

from bench_module import load


def test_the_soak_loses_nothing_and_leaks_nothing(tmp_path, chat_model_dir):
    bench = load("bench_soak")
    out = tmp_path / "bench_soak.json"
    result = bench.main(["--quick", "--model", str(chat_model_dir), "--out", str(out)])
    assert json.loads(out.read_text())["outcomes"] == result["outcomes"]
    assert out.with_suffix(".png").stat().st_size > 0
    # main() ran bench.check(result); what it covers must have happened in this run. Which
    # requests a failed model run takes with it depends on the batching: the counts that follow
    # from the plan are exact, the rest bounded (check() bounds "ok" by the faults' reach).
    planned, outcomes = result["planned"], result["outcomes"]
    assert planned["forward_fault"] == planned["constraint_fault"] == 1  # one per 400, at least 1
    faults = result["faults_injected"]
    assert faults["forward"] >= 1 and faults["constraint"] >= 1 and faults["alloc"] >= 1
    assert faults["tokenizer"] == planned["tokenizer_fault"] > 0
    assert outcomes["faulted"] >= sum(planned[k] for k in ("tokenizer_fault", "forward_fault",
                                                           "constraint_fault"))  # fmt: skip
    assert outcomes["ok"] > 0 and outcomes["disconnected"] > 0
    assert outcomes["refused_ok"] > 0  # light routes and malformed bodies answered as they must
    assert result["pool_blocks"] < 0.5 * result["working_set_blocks"]
    assert result["retractions"] + result["evicted_blocks"] > 0  # the pool was short
    assert result["latency_p99_s"] >= result["latency_p50_s"] > 0


def test_check_fails_a_run_that_lost_a_request_or_leaked_a_block():
    bench = load("bench_soak")
    good = {"requests": 4, "answered": 4, "outcomes": {"ok": 3, "faulted": 1}, "lost": [],
            "held_blocks_after": 0, "flushed_after": True, "free_blocks_after_flush": 8,
            "pool_blocks": 8, "engine_idle_while_slow_clients_held_their_streams": True,
            "faults_injected": {"forward": 1, "alloc": 1, "tokenizer": 1, "constraint": 1},
            "answers_naming_a_failed_model_run": 1, "requests_in_failed_model_runs": 2,
            "planned": {"complete": 5, "forward_fault": 1}}  # fmt: skip
    bench.check(good)
    for broken in ({"outcomes": {"ok": 3, "lost": 1}}, {"held_blocks_after": 1},
                   {"outcomes": {"ok": 1, "faulted": 3}},  # more failed than the faults reach
                   {"free_blocks_after_flush": 7}, {"answered": 3},
                   {"engine_idle_while_slow_clients_held_their_streams": False},
                   {"faults_injected": {"forward": 1}},
                   {"answers_naming_a_failed_model_run": 3}):  # fmt: skip
        try:
            bench.check({**good, **broken})
        except AssertionError:
            continue
        raise AssertionError(f"check passed a broken run: {broken}")
