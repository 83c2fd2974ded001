"""bench_agents' traces and optimum, without a model: the traces are the seed's, the working
set counts every path once, and the optimum is the prompts' trie less what decoding computed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_agents


def args(**kw) -> argparse.Namespace:
    base = dict(seed=0, agents=5, min_steps=2, max_steps=4, system_tokens=30, task_tokens=5,
                tool_max_tokens=60, tool_median_s=0.3, tool_sigma=1.0, tool_max_s=3.0,
                stagger_s=0.1)  # fmt: skip
    return argparse.Namespace(**base | kw)


def test_traces_are_seeded_and_within_their_bounds():
    system, agents = bench_agents.make_traces(args(), vocab=100)
    again = bench_agents.make_traces(args(), vocab=100)
    assert (system, agents) == again
    assert bench_agents.make_traces(args(seed=1), vocab=100)[1] != agents
    assert len(system) == 30 and len(agents) == 5
    for a in agents:
        assert 2 <= len(a.steps) <= 4
        for step in a.steps:
            assert 0.05 <= step.tool_s <= 3.0 and 50 <= len(step.tool_tokens) <= 60


def test_the_optimum_counts_shared_prefixes_once_and_leaves_out_decoded_tokens():
    system = [1, 2, 3]
    # Two agents, two calls each; outputs of 2 tokens; the second prompt extends the first.
    sent = [[*system, 4], [*system, 5], [*system, 4, 9, 9, 7], [*system, 5, 8, 8, 6]]
    # Trie: 3 shared + 2 tasks + 2 x 3 (output and tool) = 11; two calls were extended, each
    # output's first token computed while decoding.
    assert bench_agents.optimum(sent, step_tokens=2, calls_followed=2) == 11 - 2
    agent = bench_agents.Agent([4], [bench_agents.Step(0.1, [7]), bench_agents.Step(0.1, [])], 0)
    assert bench_agents.working_set_tokens(system, [agent], step_tokens=2) == 3 + 1 + 3 + 2


def test_coding_traces_reach_long_contexts_with_long_tool_outputs():
    coding = bench_agents.parse_args(["--traces", "coding", "--agents", "6"])
    assert (coding.min_steps, coding.max_steps) == (8, 12) and coding.tool_max_tokens == 4000
    for turns in ((8, 12), (8, 20), (20, 20)):
        a = argparse.Namespace(**vars(coding) | {"min_steps": turns[0], "max_steps": turns[1]})
        system, agents = bench_agents.make_coding_traces(a, vocab=49152)
        assert (system, agents) == bench_agents.make_coding_traces(a, vocab=49152)
        assert len(agents) == 6
        for agent in agents:
            assert turns[0] <= len(agent.steps) <= turns[1]
            path = bench_agents.working_set_tokens(system, [agent], a.step_tokens)
            assert 16384 <= path <= 32768  # the last prompt and its answer
            assert all(200 <= len(s.tool_tokens) <= 4000 for s in agent.steps[:-1])
            assert agent.steps[-1].tool_tokens == []  # the answer: no tool after it


def test_split_tokens_fills_every_part_within_its_bounds():
    import random

    for total in (7 * 200, 7 * 4000, 12345):
        sizes = bench_agents.split_tokens(total, 7, 200, 4000, random.Random(total))
        assert sum(sizes) == total and all(200 <= n <= 4000 for n in sizes)


def test_chat_traffic_is_16_agents_of_6_steps_with_100_to_300_word_observations():
    chat = bench_agents.parse_args(["--traffic", "chat"])
    system, agents = bench_agents.make_chat_traces(chat)
    assert (system, agents) == bench_agents.make_chat_traces(chat)  # the seed's text
    assert (
        bench_agents.make_chat_traces(argparse.Namespace(**vars(chat) | {"seed": 1}))[0] != system
    )
    assert len(agents) == 16 and all(len(a.steps) == 6 for a in agents)
    assert 300 <= len(system.split()) <= 330  # about 350 tokens
    for agent in agents:
        for step in agent.steps:
            head, *words = step.observation.split()
            assert head == "Observation:" and 100 <= len(words) <= 300
            assert set(w.strip(".").lower() for w in words) <= set(bench_agents.WORDS)
    # Each call's conversation: system, task, then a reply and an observation per step done.
    messages = bench_agents.chat_messages(system, agents[0], ["a", "b"])
    assert [m["role"] for m in messages] == ["system", "user", *["assistant", "user"] * 2]
    assert messages[-1]["content"] == agents[0].steps[1].observation


def test_workload_defaults_and_ratios_to_the_full_pool():
    assert bench_agents.parse_args([]).agents == 32  # the default traces are unchanged
    assert bench_agents.parse_args([]).out.name == "bench_agents.json"
    chat = bench_agents.parse_args(["--traffic", "chat"])
    assert (chat.pools, chat.configs) == ("1.0,0.25", "plain,retain+tier")
    assert chat.out.name == "bench_agents_chat.json"

    def config(mean: float, p99: float) -> dict:
        return {f"jct_{k}_s": {"median": v} for k, v in (("mean", mean), ("p50", mean),
                                                          ("p99", p99))}  # fmt: skip

    result = {"pools": {"100%": {"configs": {"plain": config(10, 20),
                                             "retain+tier": config(10, 20)}},
                        "25%": {"configs": {"plain": config(30, 60),
                                            "retain+tier": config(10.2, 21)}}}}  # fmt: skip
    bench_agents.compare(result)
    tiered = result["pools"]["25%"]["configs"]["retain+tier"]
    assert tiered["vs_full_pool"]["mean"] == 1.02 and tiered["mean_jct_vs_plain"] == 30 / 10.2
    assert result["acceptance"]["passed"] is True  # p99 1.05x <= 1.10, mean 1.02x <= 1.03
