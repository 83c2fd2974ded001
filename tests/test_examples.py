import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_main_job_runs_on_the_default_model():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "prefix_cache_demo.py")],
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


@pytest.mark.slow
def test_readme_main_job_generates_through_the_engine():
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_main.sh"), "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    replies = [line for line in out.splitlines() if line.startswith("  [")]
    assert len(replies) == 8  # one per prompt in examples/prompts/questions.txt
    assert all("prompt tokens cached]" in r for r in replies)
    stats = next(line for line in out.splitlines() if line.startswith("prompt tokens"))
    reused = int(stats.split(": ")[1].split()[0])
    assert reused > 0  # the shared system prompt came from the cache
    assert "radix cache:" in out and "0 protected" in out
