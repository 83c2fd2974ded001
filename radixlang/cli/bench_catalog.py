"""The benchmarks of a source checkout (``benchmarks/bench_*.py`` beside the package): their
names and one-line descriptions, and running one as a script, then naming the JSON and PNG
files it wrote."""

from __future__ import annotations

import ast
import difflib
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # radixlang/: radixlang.__file__'s folder
PREFIX = "bench_"
RESULT_SUFFIXES = (".json", ".png")


class BenchmarkError(LookupError):
    """No benchmarks here (an installed package without its checkout), or no such benchmark."""


@dataclass(frozen=True)
class Benchmark:
    name: str  # the file's stem without "bench_": "programs"
    path: Path
    description: str  # the first line of the module's docstring


def benchmarks_dir(package: Path = PACKAGE_DIR) -> Path:
    """``benchmarks/`` of the source checkout that holds ``package`` (this one's folder)."""
    folder = package.parent / "benchmarks"
    if not folder.is_dir():
        raise BenchmarkError(
            f"the benchmarks live in the source checkout (benchmarks/ beside the radixlang "
            f"package), and there is none beside {package}: run radixlang from a clone of the "
            "repository (pip install -e .)"
        )
    return folder


def describe(path: Path) -> str:
    """The first line of the file's docstring, read without importing it."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (OSError, SyntaxError, UnicodeDecodeError):
        doc = None
    # reST's inline literals (``generate``) read as plain words in a terminal
    return doc.strip().splitlines()[0].replace("``", "") if doc else "(no description)"


def list_benchmarks(folder: Path | None = None) -> list[Benchmark]:
    folder = folder or benchmarks_dir()
    return [
        Benchmark(path.stem.removeprefix(PREFIX), path, describe(path))
        for path in sorted(folder.glob(f"{PREFIX}*.py"))
    ]


def find_benchmark(name: str, folder: Path | None = None) -> Benchmark:
    """A benchmark by name: ``programs``, ``bench_programs`` or ``bench_programs.py``."""
    benches = list_benchmarks(folder)
    wanted = name.removesuffix(".py").removeprefix(PREFIX)
    for bench in benches:
        if bench.name == wanted:
            return bench
    names = [b.name for b in benches]
    close = difflib.get_close_matches(wanted, names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise BenchmarkError(f"no benchmark {name!r}: {hint}the benchmarks are {', '.join(names)}")


def _result_files(folders: Sequence[Path]) -> dict[Path, int]:
    """JSON and PNG files directly in ``folders``, with their modification times."""
    found: dict[Path, int] = {}
    for folder in folders:
        if folder.is_dir():
            for path in folder.iterdir():
                if path.suffix in RESULT_SUFFIXES and path.is_file():
                    found[path.resolve()] = path.stat().st_mtime_ns
    return found


def _out_folders(bench: Benchmark, args: Sequence[str]) -> list[Path]:
    """Where results may land: benchmarks/results, and ``--out``'s folder (or file's folder)."""
    folders = [bench.path.parent / "results"]
    for i, arg in enumerate(args):
        value = None
        if arg == "--out" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--out="):
            value = arg.removeprefix("--out=")
        if value:
            out = Path(value)
            folders += [out, out.parent]
    return folders


def run_benchmark(bench: Benchmark, args: Sequence[str]) -> tuple[int, list[Path]]:
    """Run the benchmark as ``python FILE ARGS`` (output passed through): its exit code and
    the JSON and PNG files it wrote or rewrote."""
    folders = _out_folders(bench, args)
    before = _result_files(folders)
    command = [sys.executable, str(bench.path), *args]
    # Unbuffered: its log lines and its progress bars (stderr) reach the terminal in order.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code = subprocess.call(command, cwd=bench.path.parents[1], env=env)
    after = _result_files(folders)
    written = sorted(p for p, mtime in after.items() if before.get(p) != mtime)
    return code, written
