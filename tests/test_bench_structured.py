"""The structured-output benchmarks run end to end with --quick (numbers not checked)."""

import importlib.util
import json

import jsonschema
from bench_module import load

STRUCTURED_SUMMARY = {
    "forward_pass_cut_by_jump_forward",
    "throughput_ratio_jump_forward_on_vs_unconstrained",
    "throughput_ratio_jump_forward_off_vs_unconstrained",
    "throughput_ratio_inline_masks_vs_unconstrained",
    "overlap_speedup_vs_inline_masks",
    "grammar_mask_fill_ms_p50",
    "grammar_mask_fill_ms_p99",
    "grammar_mask_step_wait_ms_p50",
    "grammar_mask_step_wait_ms_p99",
    "grammar_mask_step_wait_ms_p99_inline",
    "schema_compile_ms_cold",
    "schema_compile_ms_cached",
    "valid_fraction_greedy",
    "valid_fraction_temperature_1",
    "targets_met",
}


def test_invoice_documents_come_with_valid_answers():
    bench = load("bench_structured")
    docs = bench.make_documents(8)
    assert len({doc for doc, _ in docs}) == 8
    for doc, truth in docs:
        jsonschema.validate(truth, bench.SCHEMA)
        assert truth["invoice_reference_number"] in doc
        assert bench.validate(json.dumps(truth), truth) == (True, 1.0, None)
    ok, accuracy, error = bench.validate('{"customer_full_legal_name": "x"}', docs[0][1])
    assert not ok and accuracy == 0 and "ValidationError" in error
    assert bench.validate('{"cut off', docs[0][1])[0] is False


def test_grammar_engine_cases_are_well_formed():
    bench = load("bench_grammar_engines")
    cases = bench.all_cases()  # checks every JSON example against its schema
    names = [c.name for c in cases]
    assert len(set(names)) == len(names) and set(bench.QUICK_CASES) <= set(names)
    assert {c.kind for c in cases} == {"json_schema", "regex", "grammar"}
    assert all(c.ebnf for c in cases if c.kind == "grammar")
    assert len({name for name, *_ in bench.COVERAGE}) == len(bench.COVERAGE)


def test_bench_structured_quick_writes_json_and_plot(tmp_path, chat_model_dir):
    bench = load("bench_structured")
    args = ["--quick", "--model", str(chat_model_dir), "--requests", "2"]
    result = bench.main([*args, "--compile-repeats", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_structured.json").read_text())
    assert saved["benchmark"] == "bench_structured" and saved["config"]["requests"] == 2
    assert set(saved["summary"]) == STRUCTURED_SUMMARY
    assert saved["compile"]["cold_ms"]["median"] > 0
    for name in ("greedy", "temperature_1.0"):
        entry = saved[name]
        assert set(entry["modes"]) == set(bench.MODES)
        for mode, stats in entry["modes"].items():
            assert stats["forward_passes"]["min"] > 0, (name, mode)
            assert stats["decode_tokens_per_s"]["median"] > 0, (name, mode)
            for run in stats["runs"]:
                if mode == "unconstrained":
                    continue
                # The grammar guarantees it: every output that ended by itself is valid.
                assert run["valid"] >= run["finish_reasons"].get("stop", 0), run
                assert run["grammar_mask_steps"] > 0
        on, inline, off = (entry["modes"][m]["runs"][0] for m in bench.MODES[:3])
        assert on["jump_forward_tokens"] > 0 and off["jump_forward_tokens"] == 0
        # Filling masks beside the forward or after it changes nothing in the outputs.
        assert on["generated_tokens"] == inline["generated_tokens"]
        assert on["jump_forward_tokens"] == inline["jump_forward_tokens"]
        # The unconstrained run generates as many tokens as the jump-forward run.
        assert (
            entry["modes"]["unconstrained"]["runs"][0]["generated_tokens"] == on["generated_tokens"]
        )
        assert 0 < entry["summary"]["forward_pass_cut_by_jump_forward"] < 1
    assert (tmp_path / "bench_structured.png").stat().st_size > 0
    assert result["summary"].keys() == saved["summary"].keys()


def test_bench_grammar_engines_quick_writes_json_and_plot(tmp_path):
    bench = load("bench_grammar_engines")
    result = bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_grammar_engines.json").read_text())
    engines = {"llguidance", "regex_automaton"}
    if importlib.util.find_spec("xgrammar") is not None:
        engines.add("xgrammar")
    assert set(saved["engines"]) == engines
    assert list(saved["cases"]) == list(bench.QUICK_CASES)
    for case, entries in saved["cases"].items():
        for name in engines:
            entry = entries[name]
            if entry.get("supported") is False:  # the regex automaton: regex only
                assert name == "regex_automaton" and entries["kind"] != "regex"
                continue
            assert entry["compile_ms"] > 0, (case, name)
            for key in ("first_walk", "batch1", "batch4"):
                assert entry[key]["steps"] > 0, (case, name, key)
                # every mask allowed the next token of a valid output
                assert entry[key]["rejected_tokens"] == 0, (case, name, key, entry[key])
            assert entry["batch4"]["bool_ms_p99"] >= entry["batch4"]["bool_ms_p50"] > 0
            jf = entry["jump_forward"]
            assert jf["supported"] == (name != "regex_automaton")
            if jf["supported"]:
                assert 0 <= jf["model_steps_with_jump_forward"] <= jf["example_tokens"]
    assert saved["cases"]["flat"]["llguidance"]["jump_forward"]["initial_forced_text"] == (
        '{"name": "'
    )
    assert len(saved["coverage"]) == len(bench.COVERAGE)
    llg = saved["summary"]["coverage"]["llguidance"]
    assert 0 < llg["enforced"] <= llg["compiles"] <= llg["probes"]
    if "xgrammar" in engines:
        assert (
            "geomean_time_ratio_other_over_llguidance"
            in saved["summary"]["vs_llguidance"]["xgrammar"]
        )
    assert (tmp_path / "bench_grammar_engines.png").stat().st_size > 0
    assert result["summary"].keys() == saved["summary"].keys()


def test_bench_token_healing_quick_writes_json_and_plot(tmp_path, chat_model_dir):
    bench = load("bench_token_healing")
    result = bench.main(["--quick", "--model", str(chat_model_dir), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_token_healing.json").read_text())
    assert set(saved["sets"]) == set(bench.SETS) and saved["decision"] == result["decision"]
    for name, entry in saved["sets"].items():
        assert entry["prompts"] == 4, name
        assert 0 <= entry["accuracy_off"] <= 1 and 0 <= entry["accuracy_on"] <= 1
        assert entry["fixed"] + entry["broken"] <= entry["changed_outputs"] <= entry["prompts"]
    # Every prompt of the cut set ends inside a longer token: healing backs each one up.
    assert saved["sets"]["cut"]["healed_share"] == 1.0
    assert (tmp_path / "bench_token_healing.png").stat().st_size > 0


def test_bench_tool_masks_quick_writes_json_and_plot(tmp_path):
    bench = load("bench_tool_masks")
    result = bench.main(["--quick", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_tool_masks.json").read_text())
    assert saved["cases"] == result["cases"] and len(saved["cases"]) == 3
    for case in saved["cases"].values():
        assert case["text_us_per_token"]["median"] > 0 and case["call_tokens"] > 5
    assert (tmp_path / "bench_tool_masks.png").stat().st_size > 0
