"""Every benchmark result README.md and docs/ cite is committed and says where it came from: the
machine, the commit and the command that made it (its ``"provenance"``, benchmarks/provenance.py).

The check is ``problems(text, files, read)``: the documents' text, the committed files, and how
to read one; the tests below feed it the real README and made-up ones.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
CITED = re.compile(r"benchmarks/results/[A-Za-z0-9_./-]*")


def documents(repo: Path = REPO) -> str:
    """README.md and docs/**/*.md, one text."""
    paths = [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in paths if p.is_file())


def cited_paths(text: str) -> list[str]:
    """The result files the text names, once each, in order (the folder itself is no file)."""
    paths: list[str] = []
    for match in CITED.findall(text):
        path = match.rstrip(".")  # a sentence's full stop
        if not path.endswith("/") and path not in paths:
            paths.append(path)
    return paths


def committed_files(repo: Path = REPO) -> set[str]:
    """The files git tracks (``git ls-files``); outside a git checkout, those on disk."""
    try:
        done = subprocess.run(
            ["git", "ls-files", "-z", "--", RESULTS],
            cwd=repo,
            capture_output=True,
            check=True,
            timeout=60,
        )
        return {p for p in done.stdout.decode().split("\0") if p}
    except (OSError, subprocess.SubprocessError):
        folder = repo / RESULTS
        return {p.relative_to(repo).as_posix() for p in folder.rglob("*") if p.is_file()}


def provenance_problems(path: str, data: Any) -> list[str]:
    """What the result's JSON lacks of where it came from."""
    if not isinstance(data, dict):
        return ["not a JSON object"]
    found = []
    record = data.get("provenance")
    if not isinstance(record, dict):
        found.append("no provenance")
    else:
        found += [f"provenance has no {key}" for key in ("machine", "commit", "command")
                  if not record.get(key)]  # fmt: skip
    if Path(path).name == "bench_speculative.json" and not data.get("commit"):
        found.append("no top-level commit (bench_speculative --llama-from reads it)")
    return found


def problems(text: str, files: Collection[str], read: Callable[[str], str]) -> list[str]:
    """One line for each result the text cites that is not committed or lacks provenance."""
    found = []
    for path in cited_paths(text):
        if path not in files:
            found.append(f"{path}: cited but not committed")
        elif path.endswith(".json"):
            try:
                data = json.loads(read(path))
            except (OSError, ValueError) as e:
                found.append(f"{path}: unreadable ({e})")
                continue
            found += [f"{path}: {p}" for p in provenance_problems(path, data)]
    return found


def read_here(path: str) -> str:
    return (REPO / path).read_text(encoding="utf-8")


# ---- the real documents, one test per cited file ---------------------------------------------
@pytest.mark.parametrize("path", cited_paths(documents()))
def test_cited_result_is_committed_with_provenance(path):
    assert problems(path, committed_files(), read_here) == []


def test_the_documents_cite_results():
    assert f"{RESULTS}/bench_programs.json" in cited_paths(documents())


# ---- the check itself, on made-up documents --------------------------------------------------
GOOD = {"provenance": {"machine": {"cores": 2}, "commit": "abc", "command": "python b.py"}}


def fake(files: dict[str, Any]) -> tuple[set[str], Callable[[str], str]]:
    return set(files), lambda path: json.dumps(files[path])


def test_a_cited_file_that_is_not_committed_is_reported():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    text = readme + "\nSee `benchmarks/results/bench_nowhere.json`.\n"
    found = problems(text, committed_files(), read_here)
    assert "benchmarks/results/bench_nowhere.json: cited but not committed" in found


def test_a_cited_result_without_provenance_is_reported():
    files, read = fake(
        {
            f"{RESULTS}/a.json": GOOD,
            f"{RESULTS}/b.json": {"machine": {"cpus": 2}},
            f"{RESULTS}/c.json": {"provenance": {**GOOD["provenance"], "commit": None}},
            f"{RESULTS}/d.png": None,
        }
    )
    text = (
        f"{RESULTS}/ holds them: {RESULTS}/a.json, {RESULTS}/b.json and {RESULTS}/c.json. "
        f"The plot: {RESULTS}/d.png."
    )
    assert problems(text, files, read) == [
        f"{RESULTS}/b.json: no provenance",
        f"{RESULTS}/c.json: provenance has no commit",
    ]


def test_bench_speculative_keeps_its_top_level_commit():
    path = f"{RESULTS}/bench_speculative.json"
    files, read = fake({path: GOOD})
    assert problems(path, files, read) == [
        f"{path}: no top-level commit (bench_speculative --llama-from reads it)"
    ]
    files, read = fake({path: {**GOOD, "commit": "abc"}})
    assert problems(path, files, read) == []
