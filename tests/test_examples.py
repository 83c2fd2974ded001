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
    assert out.rstrip().endswith("every block is free again")
