"""SGLang 0.5.23's own serving benchmark client, ``python -m sglang.bench_serving --backend
sglang``, runs against ``radixlang serve`` with no request refused: benchmarks/
bench_sglang_serving.py --quick (a real server subprocess on the tiny random-weight chat model,
one client subprocess per dataset), for the random-ids and generated-shared-prefix datasets."""

import importlib.util
import json
import math

import pytest
from bench_module import load  # tests/, on the path through tests/conftest.py

DATASETS = ("random-ids", "generated-shared-prefix")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="sglang is not installed (scripts/setup.sh installs sglang==0.5.23 without its GPU "
    "stack)",
)


def test_sglang_bench_serving_completes_every_request(tmp_path, chat_model_dir):
    bench = load("bench_sglang_serving")
    args = ["--quick", "--model", str(chat_model_dir), "--datasets", *DATASETS]
    result = bench.main([*args, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_sglang_serving.json").read_text())
    assert list(saved["datasets"]) == list(DATASETS)
    for name, entry in saved["datasets"].items():
        why = (name, entry["errors"], entry["server_http_responses"], entry["client_log_tail"])
        assert entry["client_exit_code"] == 0, why
        assert entry["requests_sent"] == 4, why
        assert entry["completed"] == 4 and entry["failed"] == 0, why
        # every /generate the server saw (the client's warm-up request too) answered 200
        assert entry["refused"] == 0 and entry["server_generate_responses"] == {"200": 5}, why
        assert entry["server_finished_by_reason"] == {"length": 5}, why  # EOS ignored
        assert entry["output_lens_in_requested_range"], why
        # The client's timings are reported, not judged: positive where they hold by
        # construction (4 answers with tokens, each after a round trip). The ITL may be 0: a
        # client that reads late gets a request's few tokens in one chunk, leaving no gap.
        assert entry["output_throughput"] > 0 and entry["median_ttft_ms"] > 0, why
        assert math.isfinite(entry["median_itl_ms"]) and entry["median_itl_ms"] >= 0, why
        assert entry["ok"] and entry["problems"] == [], why
    gsp = saved["datasets"]["generated-shared-prefix"]
    assert gsp["server_prompt_tokens"]["reused"] > 0  # the groups' shared system prompts
    assert saved["summary"]["all_ok"] and saved["summary"]["refused"] == 0
    assert saved["server"]["clean_shutdown"], saved["server"]["stderr_tail"]
    assert (tmp_path / "bench_sglang_serving.png").stat().st_size > 0
    assert result["summary"] == saved["summary"]
