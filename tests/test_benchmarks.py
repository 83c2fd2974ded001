"""The benchmarks run end to end on tiny sizes (their numbers are not checked here)."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
