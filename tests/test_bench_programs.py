"""bench_programs runs end to end at its small scale (numbers not checked): on the tiny random
chat model, which speaks the default model's tokenizer, so that the smoke test costs seconds
rather than the minutes the default model and its transformers baseline take on 2 cores."""

import json
import math

from bench_module import load


def test_prompt_trie_tokens_counts_shared_prefixes_once():
    bench = load("bench_programs")
    assert bench.prompt_trie_tokens([]) == 0
    assert bench.prompt_trie_tokens([[1, 2, 3], [1, 2, 4], [1, 2, 3], [5]]) == 5
    assert bench.prompt_trie_tokens([[1, 2], [1, 2, 3, 4]]) == 4
    # 3 and 4 were generated after [1, 2] (the last output token, 5, never went through the
    # model): a cache that keeps generated tokens computes only 1, 2, 5, 6 of these prompts.
    prompts, generated = [[1, 2], [1, 2, 3, 4, 5, 6]], [([1, 2], [3, 4, 5])]
    assert bench.prompt_trie_tokens(prompts) == 6
    assert bench.prompt_trie_tokens(prompts, generated) == 4


def test_transformers_baseline_counts_tokens_up_to_the_stop():
    bench = load("bench_programs")

    class Tokenizer:
        def decode(self, ids, skip_special_tokens=False):
            return "".join({7: "a", 8: "\n", 9: "b", 2: ""}[i] for i in ids)

    lm = bench.Transformers.__new__(bench.Transformers)
    lm.tokenizer, lm.eos_ids, lm.generated_tokens = Tokenizer(), {2}, 0
    assert lm._finish([7, 8, 9, 2], bench.GenParams(4, stop="\n")) == ("a", [7, 8])
    assert lm._finish([7, 9, 2, 2], bench.GenParams(4)) == ("ab", [7, 9, 2])
    assert lm._finish([7, 2, 9, 9], bench.GenParams(4, force_length=True)) == ("abb", [7, 2, 9, 9])
    assert lm.generated_tokens == 2 + 3 + 4


def test_bench_programs_small_scale_writes_json_and_plot(tmp_path, chat_model_dir):
    bench = load("bench_programs")
    out = tmp_path / "bench_programs.json"
    args = ["--model", str(chat_model_dir), "--dtype", "float32", "--scale", "small"]
    result = bench.main([*args, "--kv-memory", "256MiB", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["scale"] == "small" and saved["model"] == chat_model_dir.name
    assert list(saved["workloads"]) == list(bench.WORKLOADS)
    for name, entry in saved["workloads"].items():
        for side in ("radixlang", "sequential", "batched"):
            assert entry[side]["seconds"] > 0, (name, side)
        summary = entry["summary"]
        for key in ("speedup_vs_sequential", "speedup_vs_batched", "speedup_vs_best"):
            assert math.isfinite(summary[key]) and summary[key] > 0, (name, key)
        assert summary["best_baseline"] in ("sequential", "batched")
        assert summary["prompt_trie_tokens"] >= summary["prompt_trie_tokens_not_generated"] > 0
        assert summary["radixlang_computed_over_optimum"] > 0
        ours = entry["radixlang"]
        assert (
            ours["prompt_tokens_computed"] + ours["prompt_tokens_reused"] == ours["prompt_tokens"]
        )
        assert 0 <= ours["cache_hit_rate"] <= 1
        if name != "select":  # select generates nothing on either side
            assert ours["generated_tokens"] > 0 and entry["batched"]["generated_tokens"] > 0
        assert ("target_met" in summary) == (name in bench.TARGETS)
    # forced lengths: the sampling workloads generate exactly max_tokens per call on every side
    tot = saved["workloads"]["tree_of_thought"]
    expected = tot["params"]["gen_calls"] * tot["params"]["max_tokens"]
    assert set(tot["summary"]["generated_tokens"].values()) == {expected}
    assert (tmp_path / "bench_programs.png").stat().st_size > 0
    assert result["summary"].keys() == saved["summary"].keys()
