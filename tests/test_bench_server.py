"""bench_server runs end to end with --quick: a real `radixlang serve` subprocess and the
in-process engine, on the tiny random-weight chat model (its numbers are not checked)."""

import json

from bench_module import load


def test_percentile_interpolates_between_ranks():
    bench = load("bench_server")
    assert bench.percentile([3.0], 99) == 3.0
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert bench.percentile([1.0, 2.0], 99) == 1.99


def test_prompts_are_distinct_and_share_the_preamble_only_when_asked():
    bench = load("bench_server")
    shared = bench.make_prompts(200, shared_prefix=True)
    assert len(set(shared)) == 200 and all(p.startswith(bench.PREAMBLE) for p in shared)
    apart = bench.make_prompts(20, shared_prefix=False)
    assert len({p[:12] for p in apart}) == 20  # they differ from their first characters


def test_bench_server_quick_writes_json_and_plot(tmp_path, chat_model_dir):
    """With --dashboard: the levels also run with the dashboard open and closed in turn."""
    bench = load("bench_server")
    args = ["--quick", "--model", str(chat_model_dir), "--kv-memory", "64MiB", "--dashboard",
            "--dashboard-rounds", "1", "--dashboard-windows", "4",
            "--dashboard-window", "0.5"]  # fmt: skip
    result = bench.main([*args, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_server_dashboard.json").read_text())
    assert [lv["concurrency"] for lv in saved["levels"]] == [1, 4]
    for level in saved["levels"]:
        for side in ("server", "engine"):
            f = level[side]
            assert f["requests"] == level["requests"], side
            assert f["output_tokens_per_s"] > 0 and f["requests_per_s"] > 0, side
            assert f["latency_p99_s"] >= f["latency_p50_s"] > 0, side
            assert f["ttft_p99_s"] >= f["ttft_p50_s"] > 0, side
            # EOS ignored: every request generated max_new_tokens, all counted by the engine
            assert f["generated_tokens"] == level["requests"] * 8, side
            assert f["counters"]["generated_tokens"] == f["generated_tokens"], side
            assert f["counters"]["finished_requests"] == level["requests"], side
            counters = f["counters"]
            assert (
                counters["prompt_tokens_computed"] + counters["prompt_tokens_reused"]
                == counters["prompt_tokens"]
                == f["prompt_tokens"]
            ), side
            assert counters["prompt_tokens_reused"] > 0, side  # the warmed-up shared preamble
            assert f["after"]["running_requests"] == 0, side
        assert level["ratios"]["http_overhead"] > 0
    server = saved["server"]
    assert server["before_stop"]["blocks_used"] == 0  # flushed, nothing held
    # SIGINT: the server drained, freed every block and exited 0, with no error logged
    assert server["exit_code"] == 0, server["stderr_tail"]
    assert server["clean_shutdown"], server["stderr_tail"]
    assert (tmp_path / "bench_server_dashboard.png").stat().st_size > 0
    assert not (tmp_path / "bench_server.json").exists()  # the plain run's result stays
    assert result["summary"]["http_overhead"].keys() == {"1", "4"}
    dashboard = server["dashboard"]
    assert dashboard["watched"][0]["events"] >= 1  # the watcher read the live stream
    for lv in dashboard["levels"]:
        assert len(lv["closed_tokens_per_s"]) == 2 and len(lv["open_tokens_per_s"]) == 1
        assert lv["ratio_min"] <= lv["ratio_of_medians"] <= lv["ratio_max"]
        assert len(lv["pair_ratios"]) == 1 and lv["median_pair_ratio"] > 0
    assert result["summary"]["dashboard_ratio"].keys() == {"1", "4"}
    windows = dashboard["windows"]
    assert [w["open"] for w in windows["windows"]] == [True, False, False, True]
    assert all(w["tokens"] > 0 for w in windows["windows"])  # the load ran throughout
    assert windows["windows"][0]["events"] >= 1 and len(windows["pair_ratios"]) == 2
