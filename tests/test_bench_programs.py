"""bench_programs runs end to end at its small scale (numbers not checked): on the tiny random
chat model, which speaks the default model's tokenizer, so that the smoke test costs seconds
rather than the minutes the default model and its transformers baseline take on 2 cores."""

import argparse
import json
import math
import re
import types

import httpx
import pytest
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
    args = ["--model", str(chat_model_dir), "--scale", "small"]  # --dtype auto, --llama-cpp auto
    result = bench.main([*args, "--kv-memory", "256MiB", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["scale"] == "small" and saved["model"] == chat_model_dir.name
    device = saved["machine"]["device"]
    assert saved["dtype"] == str(bench.choose_dtype("auto", device)).removeprefix("torch.")
    assert saved["config"]["dtype_requested"] == "auto"
    # the llama.cpp GGUF files are the default model's: on the tiny model the baseline is skipped
    assert "default model" in saved["llama_cpp"]["skipped"]
    assert saved["summary_vs_llama_cpp"] == {}
    assert list(saved["workloads"]) == list(bench.WORKLOADS)
    for name, entry in saved["workloads"].items():
        for side in ("radixlang", "sequential", "batched"):
            assert entry[side]["seconds"] > 0, (name, side)
        summary = entry["summary"]
        for key in ("speedup_vs_sequential", "speedup_vs_batched", "speedup_vs_best"):
            assert math.isfinite(summary[key]) and summary[key] > 0, (name, key)
        assert summary["best_baseline"] in ("sequential", "batched")
        assert entry["llama_cpp"] == saved["llama_cpp"]
        assert not any(key.startswith("speedup_vs_llama_cpp") for key in summary)
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


# ---- the llama.cpp baseline (benchmarks/llama_cpp.py) ----------------------------------------
class FakeTokenizer:
    """Characters as token ids (their code points): enough to build and check requests."""

    def __call__(self, text):
        return types.SimpleNamespace(input_ids=[ord(c) for c in text])


def fake_llama_server(requests):
    """An httpx transport answering /completion as llama-server does (the response_fields
    flattened by path): the prompt's first 3 tokens come from the cache; a request with a
    grammar "generates" the grammar's tokens, each with log-probability -(token % 7)."""

    def handler(request):
        body = json.loads(request.content)
        requests.append(body)
        prompt = body["prompt"]
        out = {
            "tokens_evaluated": len(prompt),
            "timings/prompt_n": len(prompt) - min(3, len(prompt) - 1),
            "timings/cache_n": min(3, len(prompt) - 1),
        }
        if "grammar" in body:
            ids = [int(t) for t in re.findall(r"<\[(\d+)\]>", body["grammar"])]
            probs = [
                {"id": t, "token": chr(t), "logprob": -(t % 7), "top_logprobs": []} for t in ids
            ]
            out.update(content="".join(map(chr, ids)), tokens=ids, completion_probabilities=probs)
        else:
            ids = [ord("x")] * body["n_predict"]
            out.update(content="x" * len(ids), tokens=ids)
        out["tokens_predicted"] = len(ids)
        return httpx.Response(200, json=out)

    return httpx.MockTransport(handler)


def test_llama_cpp_request_bodies_follow_the_generation_params():
    bench, lc = load("bench_programs"), load("llama_cpp")
    greedy = lc.completion_body([5, 6, 7], bench.GenParams(8, stop="\n"), seed=3)
    assert greedy["prompt"] == [5, 6, 7] and greedy["n_predict"] == 8
    assert greedy["cache_prompt"] is True and greedy["stream"] is False
    assert greedy["temperature"] == 0.0 and greedy["stop"] == ["\n"]
    assert greedy["ignore_eos"] is False and "seed" not in greedy
    sampled = lc.completion_body([5], bench.GenParams(12, 0.7, force_length=True), seed=3)
    assert sampled["temperature"] == 0.7 and sampled["ignore_eos"] is True
    assert sampled["stop"] == [] and sampled["seed"] == 3
    # the whole distribution, as transformers samples it (top_k=0, top_p=1.0): no truncation
    assert (sampled["top_k"], sampled["top_p"], sampled["min_p"]) == (0, 1.0, 0.0)
    assert sampled["repeat_penalty"] == 1.0 and sampled["dry_multiplier"] == 0.0
    forced = lc.forced_choice_body([1, 2], [30, 31])
    assert forced["grammar"] == "root ::= <[30]> <[31]>" and forced["n_predict"] == 2
    assert forced["n_probs"] == 1 and forced["post_sampling_probs"] is False
    assert forced["temperature"] == 0.0 and forced["cache_prompt"] is True
    with pytest.raises(ValueError):
        lc.forced_choice_body([1, 2], [])


def test_llama_cpp_response_fields_flat_or_nested():
    lc = load("llama_cpp")
    assert lc.field({"timings/prompt_n": 4}, "timings/prompt_n") == 4
    assert lc.field({"timings": {"cache_n": 9}}, "timings/cache_n") == 9
    assert lc.field({}, "timings/cache_n", 0) == 0
    good = {"completion_probabilities": [{"id": 3, "logprob": -0.5}, {"id": 4, "logprob": -1}]}
    assert lc.choice_logprobs(good, [3, 4]) == [-0.5, -1.0]
    with pytest.raises(RuntimeError, match="forced choice tokens"):
        lc.choice_logprobs(good, [3, 5])


def test_llama_cpp_backend_counts_and_selects_on_a_mock_server():
    bench, lc = load("bench_programs"), load("llama_cpp")
    requests = []
    lm = lc.LlamaCpp("http://llama", FakeTokenizer(), transport=fake_llama_server(requests))
    with lm:
        texts = lm.generate(["abcd", "abce"], bench.GenParams(2, 0.7, force_length=True))
        assert texts == ["xx", "xx"]
        assert sorted(r["seed"] for r in requests) == [0, 1]  # one seed per sampled call
        assert lm.counts() == {
            "model_calls": 2,
            "requests": 2,
            "prompt_tokens": 8,
            "prompt_tokens_computed": 2,
            "prompt_tokens_cached": 6,
            "generated_tokens": 4,
        }
        assert lm.prompts == [[97, 98, 99, 100], [97, 98, 99, 101]]
        requests.clear()
        # choices scored from where they depart from the prompt, by the mean of the log-
        # probabilities (here -(token % 7): " " 32 -> -4, "a" 97 -> -6, "b" 98 -> 0, "i" 105 -> 0)
        picks = lm.select(["Q:", "R:"], [[" ab", " bi"], [" i", " a"]])
        assert picks == [1, 0]  # -4/3 beats -10/3; -2 beats -5
        assert sorted(r["prompt"] for r in requests) == [[81, 58]] * 2 + [[82, 58]] * 2
        grammars = {r["grammar"] for r in requests}
        assert "root ::= <[32]> <[97]> <[98]>" in grammars and len(grammars) == 4
        assert lm.counts()["requests"] == 6


def test_llama_cpp_reads_the_flags_a_server_build_takes(tmp_path, monkeypatch):
    lc = load("llama_cpp")
    binary = tmp_path / "llama-server"
    help_text = "-cram,  --cache-ram N   set the maximum cache size in MiB\n-c, --ctx-size N"
    binary.write_text(f"#!/bin/sh\necho '{help_text}'\n")
    binary.chmod(0o755)
    assert lc.supports_flag(binary, "--cache-ram") and lc.supports_flag(binary, "--ctx-size")
    assert not lc.supports_flag(binary, "--cache-ram-x") and not lc.supports_flag(binary, "--ram")
    assert not lc.supports_flag(tmp_path / "missing", "--cache-ram")
    # The converter needs setup_llama_cpp.sh's sources: without them, how to get them.
    monkeypatch.setenv("RADIXLANG_BENCH_CACHE", str(tmp_path))
    with pytest.raises(lc.LlamaCppMissing, match=re.escape("setup_llama_cpp.sh")):
        lc.convert_to_gguf(tmp_path, tmp_path / "out.gguf")


def test_llama_cpp_missing_binary_says_how_to_build_it(tmp_path, monkeypatch):
    lc = load("llama_cpp")
    monkeypatch.setenv("RADIXLANG_BENCH_CACHE", str(tmp_path))
    monkeypatch.delenv("RADIXLANG_LLAMA_SERVER", raising=False)
    assert lc.cache_dir() == tmp_path / "llama.cpp"
    assert lc.pinned_version()  # read from setup_llama_cpp.sh
    for find in (lc.find_server, lambda: lc.find_gguf("q4_1")):
        with pytest.raises(
            lc.LlamaCppMissing, match=re.escape("bash benchmarks/setup_llama_cpp.sh")
        ):
            find()
    with pytest.raises(lc.LlamaCppMissing, match="no executable llama-server"):
        lc.find_server(tmp_path / "nope")
    binary = tmp_path / "llama.cpp" / f"build-{lc.pinned_version()}" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert lc.find_server() == binary
    monkeypatch.setenv("RADIXLANG_LLAMA_SERVER", str(binary))
    assert lc.find_server() == binary


def test_llama_cpp_auto_skips_with_a_message_and_on_stops(tmp_path, monkeypatch, capsys):
    bench = load("bench_programs")
    monkeypatch.setenv("RADIXLANG_BENCH_CACHE", str(tmp_path))
    monkeypatch.delenv("RADIXLANG_LLAMA_SERVER", raising=False)

    def args(*extra):
        ns = argparse.Namespace(
            model=bench.DEFAULT_MODEL, llama_gguf=["q4_1", "f32"], llama_server=None
        )
        for key, value in extra:
            setattr(ns, key, value)
        return ns

    plan = bench.plan_llama_cpp(args(("llama_cpp", "auto")))
    assert plan.server is None and "setup_llama_cpp.sh" in plan.skipped
    assert "setup_llama_cpp.sh" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=re.escape("setup_llama_cpp.sh")):
        bench.plan_llama_cpp(args(("llama_cpp", "on")))
    assert bench.plan_llama_cpp(args(("llama_cpp", "off"))).skipped == "--llama-cpp off"
    # the named GGUF files are the default model's: another model skips them
    plan = bench.plan_llama_cpp(args(("llama_cpp", "auto"), ("model", "/some/model")))
    assert "default model" in plan.skipped


def test_summary_and_plot_carry_the_llama_cpp_bars(tmp_path):
    bench = load("bench_programs")
    side = {"seconds": 2.0, "generated_tokens": 5, "prompt_tokens": 9}
    base = {
        "sequential": {
            **side,
            "prompt_trie_tokens": 7,
            "prompt_trie_tokens_not_generated": 6,
        },
        "batched": side,
    }
    ours = {"seconds": 0.5, "generated_tokens": 5, "prompt_tokens": 9, "prompt_tokens_computed": 3}
    llama = {
        label: {**side, "seconds": s, "prompt_tokens_computed": 4, "prompt_tokens_cached": 5}
        for label, s in (("q4_1", 1.0), ("f32", 1.5))
    }
    summary = bench.summarize("few_shot", base, ours, llama)
    assert summary["speedup_vs_llama_cpp_q4_1"] == 2.0
    assert summary["speedup_vs_llama_cpp_f32"] == 3.0
    assert summary["generated_tokens"]["llama_cpp_f32"] == 5
    assert summary["llama_cpp_q4_1_prompt_tokens_cached"] == 5
    result = {
        "model": "m",
        "dtype": "float32",
        "machine": {"device": "cpu"},
        "scale": "small",
        "llama_cpp": {"ggufs": {"q4_1": "a.gguf", "f32": "b.gguf"}},
        "workloads": {"few_shot": {"summary": summary}},
    }
    bench.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_llama_server_runs_the_q4_1_gguf_when_built():
    """Exercises the real llama-server when setup_llama_cpp.sh has run (never in CI)."""
    bench, lc = load("bench_programs"), load("llama_cpp")
    try:
        binary, gguf = lc.find_server(), lc.find_gguf("q4_1")
    except lc.LlamaCppMissing as e:
        pytest.skip(str(e))
    from radixlang.model_files import load_model_files

    tokenizer = load_model_files(bench.DEFAULT_MODEL).load_tokenizer()
    workload = bench.FewShot(
        bench.Scale(**{**vars(bench.SCALES["small"]), "few_shot_questions": 2})
    )
    with lc.LlamaServer(binary, gguf) as server, lc.LlamaCpp(server.url, tokenizer) as lm:
        out = workload.baseline(lm, tokenizer)
        counts = lm.counts()
        assert counts["requests"] == 2 and counts["generated_tokens"] > 0
        assert (
            counts["prompt_tokens_computed"] + counts["prompt_tokens_cached"]
            == counts["prompt_tokens"]
        )
        assert 0 <= out["accuracy"] <= 1
        select = bench.Select(bench.Scale(**{**vars(bench.SCALES["small"]), "select_items": 1}))
        assert 0 <= select.baseline(lm, tokenizer)["accuracy"] <= 1
    assert server.proc is None  # stopped
