"""examples/json_extract.py on the default model: 16 documents, each a parsed pydantic record;
the shared instructions come from the cache and the schema's forced text is jump-forwarded."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_json_extract_example():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "json_extract.py"), "--num-docs", "16"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    records = re.findall(r"^doc +\d+: CompanyRecord\((.*)\)$", out, flags=re.M)
    assert len(records) == 16, out[-3000:]
    assert all("company_legal_name=" in r and "primary_industry_sector=" in r for r in records)
    assert "16 of 16 records parsed as CompanyRecord" in out
    m = re.search(r"jump-forward: (\d+) of (\d+) generated tokens", out)
    assert m and 0 < int(m[1]) < int(m[2])  # the key names were forced, the values sampled
    m = re.search(r"prompt tokens: (\d+) reused, (\d+) computed of (\d+)", out)
    assert m and int(m[1]) + int(m[2]) == int(m[3])
    assert int(m[1]) > int(m[2])  # the instructions were computed once, reused 15 times
