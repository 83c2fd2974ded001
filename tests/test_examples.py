import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_main_job_runs_on_the_default_model():
    out = subprocess.run(
        # 4 greedy tokens a request, not 12: the same requests, reuse and logits check, with a
        # third of the default model's decode steps.
        [sys.executable, str(ROOT / "examples" / "prefix_cache_demo.py"), "--new-tokens", "4"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "LlamaForCausalLM: 30 layers" in out
    # Ten requests share one system prompt: most prompt tokens come from the cache.
    summary = next(line for line in out.splitlines() if line.startswith("10 requests"))
    reused = int(summary.split(": ")[1].split()[0])
    total = int(summary.split(", ")[1].split()[0])
    assert reused > total / 2
    assert "radix cache:" in out and "hits=" in out
    # Every request ran the model: each printed a reply.
    rows = [r for r in out.splitlines() if re.match(r"(chat \d+ turn|fork branch) \d+ +\d+", r)]
    assert len(rows) == 10 and all(row.split("  ")[-1].strip("' ") for row in rows)
    # Logits over a reused prefix equal those computed from scratch.
    diff_line = next(line for line in out.splitlines() if "max |logit difference|" in line)
    assert float(diff_line.rsplit("= ", 1)[1]) < 2e-4
    assert out.rstrip().endswith("every block is free again")


def run_example(name: str, *args: str) -> str:
    """Run ``examples/<name>`` with its smallest options; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def cache_stats(out: str) -> tuple[int, int, float]:
    """(reused, computed, hit rate) from the example's closing statistics line."""
    m = re.search(
        r"prompt tokens: (\d+) reused, (\d+) computed of (\d+) \(cache hit rate ([\d.]+)%\)", out
    )
    assert m, out[-2000:]
    reused, computed, total = int(m[1]), int(m[2]), int(m[3])
    assert reused + computed == total
    return reused, computed, float(m[4]) / 100


@pytest.mark.slow
def test_multi_turn_example():
    out = run_example("multi_turn.py", "--max-tokens", "8", "--turns", "3", "--chats", "1")
    roles = re.findall(r"^\[(system|user|assistant)\]", out, flags=re.M)
    assert roles == ["system"] + ["user", "assistant"] * 3
    reused, _, _ = cache_stats(out)
    assert reused > 0  # each turn reuses the conversation before it


@pytest.mark.slow
def test_fork_join_example():
    out = run_example("fork_join.py", "--tips", "2", "--max-tokens", "8")
    assert re.search(r"^1\. .*\n   .*\n2\. ", out, flags=re.M)
    reused, _, _ = cache_stats(out)
    assert reused > 0  # the branches share the outline


@pytest.mark.slow
def test_self_consistency_example():
    out = run_example("self_consistency.py", "--samples", "3", "--max-tokens", "8")
    assert len(re.findall(r"^sample \d: answer", out, flags=re.M)) == 3
    assert "winner: " in out
    assert "prompt computed once: yes" in out
    cache_stats(out)


@pytest.mark.slow
def test_readme_main_job_tree_of_thought():
    """The README's main job at its default size (27 leaves): prompt tokens computed stay
    within 1.05x the distinct tokens of the token trie of all the prompts it sent."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_main.sh"), "--max-tokens", "16"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    leaves = re.findall(r"Step 3: .*\[(yes|no), P\(yes\)=[\d.]+\]", out)
    assert len(leaves) == 27 and "27 leaves" in out
    distinct = int(
        re.search(r"distinct prompt tokens \(token trie of all prompts\): (\d+)", out)[1]
    )
    computed = int(re.search(r"prompt tokens computed by the runtime: (\d+)", out)[1])
    sent = int(re.search(r"prompts sent: \d+ with (\d+) tokens", out)[1])
    least = int(re.search(r"least prompt computation with a perfect prefix cache: (\d+)", out)[1])
    assert 0 < least <= distinct < sent
    # No prefix cache computes less than the trie positions no generation decoded ...
    assert least <= computed
    # ... and this one computes at most 1.05x the trie's distinct tokens.
    assert computed <= 1.05 * distinct
    cache_stats(out)


@pytest.mark.slow
def test_few_shot_batch_example():
    out = run_example("few_shot_batch.py", "--num-questions", "16", "--max-tokens", "4")
    assert len(re.findall(r"^   A: ", out, flags=re.M)) == 16
    _, _, hit_rate = cache_stats(out)
    assert hit_rate > 0.5  # the few-shot prefix is computed once for 16 programs


@pytest.mark.slow
def test_serve_and_query_example():
    out = run_example("serve_and_query.py", "--max-tokens", "12")
    ideas = re.findall(r"^\d\. (.+)$", out, re.MULTILINE)
    assert len(ideas) == 3 and all(ideas)
    m = re.search(r"/generate over the program's prompt: (\d+) of (\d+) prompt tokens", out)
    assert m and int(m[1]) == int(m[2]) - 1  # all but the last token came from the cache
    m = re.search(r"server: (\d+) requests, prompt tokens: (\d+) reused, (\d+) computed", out)
    assert m and int(m[1]) == 6  # the fork's prefill, 3 branches, 1 chat, 1 /generate
    assert int(m[2]) > int(m[3])


def run_with_radixlang_run(name: str, *args: str) -> str:
    """``radixlang run examples/<name> -- args``; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "radixlang.cli", "run", str(ROOT / "examples" / name), "--", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_react_agent_example_under_radixlang_run():
    out = run_with_radixlang_run("react_agent.py", "--questions", "2", "--steps", "2",
                                 "--max-tokens", "64")  # fmt: skip
    assert out.count("Q: ") == 2 and out.count("  answer: ") == 2
    # Every agent's first step must call a tool: each printed one call and its result at least.
    steps = re.findall(r"^  step \d: (\w+)\((.*)\) -> (.+)  \[(.+)\]$", out, flags=re.M)
    assert len(steps) >= 2
    assert {name for name, *_ in steps} <= {"search_docs", "calculate", "convert_units"}
    calls = int(re.search(r"2 agents, (\d+) tool calls", out)[1])
    assert calls == len(steps)
    reused, computed, _ = cache_stats(out)
    assert reused > computed  # every step and both agents extend one shared prefix


@pytest.mark.slow
def test_multi_agent_example_under_radixlang_run():
    out = run_with_radixlang_run("multi_agent.py", "--workers", "2", "--max-tokens", "96")
    workers = re.findall(r"^worker \d: (.+)$", out, flags=re.M)
    assert 1 <= len(workers) <= 2
    # Each worker's branch called a tool (tool_choice="required") and ran it.
    assert len(re.findall(r"^  (search_docs|calculate|convert_units)\(.*\) -> ", out,
                          flags=re.M)) >= len(workers)  # fmt: skip
    assert out.count("  finding: ") == len(workers) and "\nanswer: " in out
    reused, _, _ = cache_stats(out)
    assert reused > 0  # the branches share the planner's conversation
