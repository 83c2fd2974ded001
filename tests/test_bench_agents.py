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
