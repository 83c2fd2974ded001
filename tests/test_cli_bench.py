"""`radixlang bench`: the source checkout's benchmarks listed with what each measures, one run
with its own arguments, and the JSON and PNG files it wrote named."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from radixlang.cli import main
from radixlang.cli.bench_catalog import BenchmarkError, benchmarks_dir, find_benchmark

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_lists_every_benchmark_with_its_description(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    files = sorted(BENCHMARKS.glob("bench_*.py"))
    assert len(files) >= 5
    for path in files:
        first_line = ast.get_docstring(ast.parse(path.read_text())).splitlines()[0]
        first_line = first_line.replace("``", "")  # printed as plain words
        name = path.stem.removeprefix("bench_")
        assert any(
            line.split()[:1] == [name] and first_line in line for line in out.splitlines()
        ), (name, out)
    assert "make_random_model" not in out and "regex_automaton" not in out  # not benchmarks


def test_bench_runs_one_and_names_what_it_wrote(tmp_path, capfd):
    args = ["--sequences", "300", "--leaves", "50", "200", "--evictions", "20"]
    assert main(["bench", "radix_cache", *args, "--out", str(tmp_path)]) == 0
    out = capfd.readouterr().out
    json_path, png_path = tmp_path / "bench_radix_cache.json", tmp_path / "bench_radix_cache.png"
    assert json_path.stat().st_size > 0 and png_path.stat().st_size > 0
    assert f"wrote {json_path.resolve()}" in out and f"wrote {png_path.resolve()}" in out


def test_bench_passes_the_benchmarks_exit_code_through(capfd):
    assert main(["bench", "bench_radix_cache.py", "--no-such-flag"]) == 2  # argparse's error
    assert "--no-such-flag" in capfd.readouterr().err


def test_an_unknown_benchmark_is_named_with_a_suggestion(capsys):
    assert main(["bench", "programz"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'programz': did you mean programs?" in err


def test_outside_a_source_checkout_the_error_says_so(tmp_path):
    with pytest.raises(BenchmarkError, match="source checkout"):
        benchmarks_dir(tmp_path / "site-packages" / "radixlang")
    assert find_benchmark("programs").path == BENCHMARKS / "bench_programs.py"
