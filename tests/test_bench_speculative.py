"""bench_speculative end to end on a tiny chat model and tiny sizes (its numbers are not
checked here): every part runs and writes its JSON and plot, the greedy-equality check holds."""

from __future__ import annotations

import json

from bench_module import load


def test_bench_speculative_writes_json_and_plot(tmp_path, chat_model_dir):
    bench = load("bench_speculative")
    args = ["--model", str(chat_model_dir), "--dtype", "float32", "--kv-memory", "64MiB"]
    args += ["--tasks", "quote_tool", "self_consistency", "--batches", "1", "3"]
    args += ["--max-new-tokens", "12", "--repeats", "1", "--programs", "few_shot", "select"]
    # llama-server's part reused from an earlier result (read before this run writes).
    earlier = {"commit": "abc123", "llama_server": {"quote_tool/1": {"speedup": 1.5}}}
    (tmp_path / "bench_speculative.json").write_text(json.dumps(earlier))
    args += ["--program-scale", "small", "--llama-from", str(tmp_path / "bench_speculative.json")]
    result = bench.main([*args, "--out", str(tmp_path / "bench_speculative.json")])
    saved = json.loads((tmp_path / "bench_speculative.json").read_text())
    assert set(saved["tasks"]) == {
        f"{t}/{b}" for t in ("quote_tool", "self_consistency") for b in (1, 3)
    }
    for entry in saved["tasks"].values():
        assert entry["off_tokens_per_second"] > 0 and entry["on_tokens_per_second"] > 0
    assert set(saved["programs"]) == {"few_shot", "select"}
    for entry in saved["greedy_equal"].values():  # deterministic mode: drafts change nothing
        assert entry["equal"] == entry["requests"]
    assert all(e["equal"] for e in saved["greedy_equal_programs"].values())
    assert (tmp_path / "bench_speculative.png").stat().st_size > 0
    assert result["benchmark"] == "bench_speculative"
    llama = saved["llama_server"]
    assert llama["quote_tool/1"] == {"speedup": 1.5}
    assert llama["reused_from"]["commit"] == "abc123"
