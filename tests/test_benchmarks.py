"""The benchmarks run end to end on tiny sizes (their numbers are not checked here)."""

import json
from pathlib import Path

import pytest
from bench_module import load


def test_bench_radix_cache_writes_json_and_plot(tmp_path):
    bench = load("bench_radix_cache")
    args = ["--sequences", "300", "--leaves", "50", "200", "--evictions", "20"]
    result = bench.main([*args, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_radix_cache.json").read_text())
    assert saved["throughput"]["sequences"] == 300
    assert saved["throughput"]["all_blocks_free_after"] is True
    assert saved["throughput"]["sharing_factor"] > 1
    assert [r["leaves"] for r in saved["eviction_scaling"]["heap"]] == [50, 200]
    assert (tmp_path / "bench_radix_cache.png").stat().st_size > 0
    assert result["summary"]["leaf_growth"] == 4
    record = saved["provenance"]  # benchmarks/provenance.py: where the numbers came from
    assert record["command"].startswith("python benchmarks/bench_radix_cache.py --sequences 300")
    assert record["machine"]["cores"] and "platform" in record["machine"]
    if (Path(__file__).parents[1] / ".git").exists():
        assert len(record["commit"]) == 40 and isinstance(record["dirty"], bool)


def test_bench_forward_writes_json_and_plot(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "runtime"))
    from tiny_models import make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "model")
    bench = load("bench_forward")
    args = ["--model", str(folder), "--dtypes", "float32", "--batches", "1", "3"]
    args += ["--context", "10", "--steps", "2", "--prefill-tokens", "24", "--repeats", "1"]
    result = bench.main([*args, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_forward.json").read_text())
    (run,) = saved["runs"]
    assert run["dtype"] == "float32" and [d["batch"] for d in run["decode"]] == [1, 3]
    assert run["prefill"]["max_abs_logit_diff"] < 2e-4  # both sides ran the same weights
    assert all(d["radixlang_ms"] > 0 and d["transformers_ms"] > 0 for d in run["decode"])
    assert "batch1_time_ratio_at_most_0.7" in run["targets"]
    assert (tmp_path / "bench_forward.png").stat().st_size > 0
    assert result["runs"][0]["prefill"]["tokens"] == 24


def test_bench_engine_writes_json_and_plot(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "runtime"))
    from tiny_models import make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "model")
    bench = load("bench_engine")
    args = ["--model", str(folder), "--dtypes", "float32", "--requests", "6"]
    args += ["--prompt-tokens", "8", "--new-tokens", "5", "--hf-batches", "2", "4"]
    args += ["--prefix-tokens", "60", "--suffix-tokens", "4", "--ttft-repeats", "2"]
    args += [
        "--kv-memory",
        "4MiB",
        "--deterministic",
        "--det-new-tokens",
        "3",
        "--det-repeats",
        "1",
    ]
    result = bench.main([*args, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_engine.json").read_text())
    (run,) = saved["runs"]
    cost = run["deterministic"]["cost"]
    assert set(cost) == {"b1", "b8", "b64", "prefill"}
    assert all(c["slowdown"] > 0 for c in cost.values())
    assert run["deterministic"]["first_request_same_at_every_batch"]["deterministic"] is True
    throughput = run["throughput"]
    assert throughput["radixlang"]["tokens_per_s"] > 0
    # greedy on the same weights: the engine and transformers agree
    assert throughput["transformers_b2"]["identical_outputs"] == 6
    assert len(run["ttft"]["cold_ms"]) == len(run["ttft"]["hot_ms"]) == 2
    assert run["engine_stats"]["running_requests"] == 0
    assert (tmp_path / "bench_engine.png").stat().st_size > 0
    assert result["runs"][0]["dtype"] == "float32"


def test_bench_host_overhead_quick_writes_json_and_plot(tmp_path, chat_model_dir):
    bench = load("bench_host_overhead")
    result = bench.main(["--quick", "--model", str(chat_model_dir), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_host_overhead.json").read_text())
    cases = {(c["mode"], c["batch"], c["overlap"]): c for c in saved["cases"]}
    modes = ("greedy", "sampled")
    assert set(cases) == {(m, b, o) for m in modes for b in (1, 8) for o in (False, True)}
    for (_, _, overlap), case in cases.items():
        assert case["decode_steps"] > 0 and case["total"]["median_ms"] > 0
        assert case["cpu"]["median_ms"] > 0
        # The device's time is taken out of the step's: what is left is host time, between 0
        # (with overlap the device may cover a whole step; a sum of clipped intervals may round
        # a few ulps past it) and the step's time. How much, the benchmark reports.
        assert -1e-9 <= case["critical_path"]["median_ms"] <= case["total"]["median_ms"]
        if not overlap:
            assert set(case["breakdown_mean_ms"]) == set(bench.PARTS)
            assert case["breakdown_mean_ms"]["sample"] > 0
    assert saved["vocab_size"] == 49152
    assert (tmp_path / "bench_host_overhead.png").stat().st_size > 0
    assert result["cases"][0]["mode"] == "greedy"


def test_bench_memory_writes_json_and_plot(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "runtime"))
    from tiny_models import make_tiny_model

    folder = make_tiny_model("llama", tmp_path / "model", max_position_embeddings=512)
    bench = load("bench_memory")
    args = ["--model", str(folder), "--dtype", "float32", "--block-size", "4"]
    args += ["--prefixes", "3", "--prefix-tokens", "24", "--question-tokens", "2"]
    args += ["--answer-tokens", "2", "--rounds", "3", "--tier-memory", "2MiB"]
    args += ["--requests", "4", "--prompt-tokens", "12", "--new-tokens", "6"]
    result = bench.main([*args, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_memory.json").read_text())
    (rep,) = saved["repeats"]
    runs = rep["tier"]["runs"]
    # Rounds after the first load the prefixes back instead of computing them.
    assert runs["tier"]["tier_loaded_tokens"] > 0 and runs["no_tier"]["tier_loaded_tokens"] == 0
    assert rep["tier"]["computed_ratio"] > 1.5 and rep["tier"]["outputs_identical"]
    pre = rep["preemption"]["runs"]
    assert pre["recompute"]["retractions"] > 0 and pre["swap"]["swapped_out_blocks"] > 0
    assert all(pre[n]["outputs_equal_unpressured"] for n in ("swap", "recompute"))
    assert pre["unpressured"]["memory_report"]["allocated_per_live"] >= 1.0
    assert (tmp_path / "bench_memory.png").stat().st_size > 0
    assert result["targets"]["tier_outputs_identical"] is True


@pytest.fixture()
def no_cache_left(tmp_path):
    """Removes the model-cache folders (a GGUF's config and tokenizer) that engines made for
    GGUF files under ``tmp_path``: they would pile up in the user's cache run after run."""
    yield
    import shutil

    from radixlang.model_files import cache_dir

    for source in (cache_dir() / "models").glob("*/radixlang-source.json"):
        gguf = json.loads(source.read_text()).get("gguf", "")
        if gguf.startswith(str(tmp_path)):
            shutil.rmtree(source.parent, ignore_errors=True)


def test_bench_scale_writes_json_and_plot(tmp_path, no_cache_left):
    """A tiny shape written as random Q4_0 blocks, measured in a process of its own (radixlang
    alone: llama-server is not built in CI), deterministic mode beside the default in it."""
    bench = load("bench_scale")
    args = ["--shapes", "tiny", "--types", "q4_0", "--batches", "1", "2", "--prefills", "32"]
    args += ["--steps", "2", "--no-llama-server", "--models", str(tmp_path / "models")]
    args += ["--deterministic"]
    bench.main([*args, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_scale.json").read_text())
    (case,) = saved["cases"]
    assert case["shape"] == "tiny" and case["type"] == "q4_0" and case["floor_ms"] > 0
    figures = case["systems"]["radixlang"]
    assert figures["quantization"] == "gguf"  # served from the file's blocks
    assert set(figures["decode_ms"]) == {"1", "2"} and figures["prefill_tokens_per_s"]["32"] > 0
    det = case["systems"]["radixlang-deterministic"]
    assert set(det["decode_ms"]) == {"1", "2"} and det["prefill_tokens_per_s"]["32"] > 0
    ratios = case["deterministic_over_default"]
    assert set(ratios) == {"prefill 32", "decode b1", "decode b2"}
    assert ratios["decode b2"] == round(det["decode_ms"]["2"] / figures["decode_ms"]["2"], 3)
    # The step's bytes: every layer's matrices at Q4_0's 18 bytes per 32 weights, and the
    # tied output layer (the token embedding).
    shape = bench.SHAPES["tiny"]
    hidden, inter, heads, kv = shape["hidden"], shape["inter"], shape["heads"], shape["kv"]
    per_layer = hidden * (hidden + 2 * kv * hidden // heads) + hidden * hidden + 3 * hidden * inter
    weights = shape["layers"] * per_layer + shape["vocab"] * hidden
    assert case["weight_bytes_per_step"] == weights // 32 * 18
    # The floor: the step's bytes over the highest bandwidth of the run's samples.
    samples = saved["machine"]["bandwidth_samples_gb_s"]
    assert len(samples) == 2 and saved["machine"]["bandwidth_gb_s"] == pytest.approx(
        max(samples), abs=0.01
    )
    floor = case["weight_bytes_per_step"] / (saved["machine"]["bandwidth_gb_s"] * 1e9) * 1000
    assert case["floor_ms"] == pytest.approx(floor)
    assert figures["decode_x_floor"]["2"] == pytest.approx(figures["decode_ms"]["2"] / floor)
    assert (tmp_path / "bench_scale.png").stat().st_size > 0
