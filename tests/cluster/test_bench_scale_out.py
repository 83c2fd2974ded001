"""bench_scale_out runs end to end with --quick on the session's two-node Ray cluster and the
tiny chat model (its timings are not checked; that each setup ran the same traffic is)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/bench_module.py
from bench_module import load

pytestmark = [pytest.mark.ray, pytest.mark.compares_outputs]


def test_bench_scale_out_quick_writes_json_and_plot(ray_cluster, chat_model_dir, tmp_path):
    bench = load("bench_scale_out")
    # Deterministic: the setups batch the same programs otherwise, and the multi-turn chats feed
    # each reply back into the next prompt, so prompt tokens are equal only if replies are.
    args = ["--quick", "--model", str(chat_model_dir), "--kv-memory", "64MiB", "--deterministic"]
    bench.main([*args, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_scale_out.json").read_text())
    assert (tmp_path / "bench_scale_out.png").stat().st_size > 0
    setups = {s["setup"]: s for s in saved["setups"]}
    assert [s["replicas"] for s in saved["setups"]] == [1, 2, 2]
    runs = [s["rounds"][0] for s in saved["setups"]]
    # The same programs everywhere: greedy, or sampled with fixed seeds.
    assert len({r["prompt_tokens"] for r in runs}) == 1
    assert len({r["generated_tokens"] for r in runs}) == 1 and runs[0]["generated_tokens"] > 0
    for run in runs:
        assert run["prompt_tokens_computed"] + run["prompt_tokens_reused"] == run["prompt_tokens"]
    in_turn = setups["2 replicas, round-robin"]["rounds"][0]["routed"]
    aware = setups["2 replicas, cache-aware"]["rounds"][0]["routed"]
    assert in_turn["round_robin"] > 0 and in_turn["prefix"] == 0
    assert aware["round_robin"] == 0 and aware["prefix"] + aware["key"] > 0
