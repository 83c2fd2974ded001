"""Every fenced code block of README.md and docs/**/*.md runs, or says why not
(the convention: tests/docs/code_blocks.py). One test per page.

Python blocks run in this process, one namespace per page, on the real engine with the default
model swapped for a tiny random one (tests/docs/tiny_model_hook/sitecustomize.py): milliseconds
per step. Shell blocks run in bash from the repository root, their Python processes on the same
tiny default model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import linecache
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
from code_blocks import (
    PYTHON,
    Block,
    MarkerError,
    normalize_output,
    pages,
    pair_outputs,
    parse,
    unmarked,
)

ROOT = Path(__file__).resolve().parents[2]
HOOK = Path(__file__).resolve().parent / "tiny_model_hook"
SHELL_TIMEOUT_S = 300
PAGES = pages(ROOT)

# The hook's module under a name of its own: in this process it is no sitecustomize.
_spec = importlib.util.spec_from_file_location("docs_tiny_model_hook", HOOK / "sitecustomize.py")
_hook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hook)
ENV, use_tiny_default = _hook.ENV, _hook.use_tiny_default


def _engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "radixlang-engine" and t.is_alive()}


def _live_engines() -> set[Any]:
    engine = sys.modules.get("radixlang.runtime.engine")
    return set(engine._live_engines) if engine is not None else set()


@contextlib.contextmanager
def _page_session():
    """Afterwards: the engines the page started (and left running) shut down, the default
    backend as it was, and no engine thread of the page's left."""
    import radixlang as sgl

    engines, threads, backend = _live_engines(), _engine_threads(), sgl.get_default_backend()
    try:
        yield
    finally:
        for engine in _live_engines() - engines:
            engine.shutdown()
        sgl.set_default_backend(backend)
    left = _engine_threads() - threads
    assert not left, f"engine threads still running after the page: {left}"


def _run_python(block: Block, namespace: dict[str, Any]) -> str:
    filename = f"{block.page}:{block.line}"
    linecache.cache[filename] = (len(block.code), None, block.code.splitlines(True), filename)
    out = io.StringIO()
    error = None
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block.code, filename, "exec"), namespace)
    except BaseException:  # SystemExit too: a block must not exit
        error = traceback.format_exc()
    if error is not None:
        pytest.fail(f"{block.where} raised:\n{error}\nits output:\n{out.getvalue()}", pytrace=False)
    return out.getvalue()


def _run_shell(block: Block, tiny_model: Path) -> str:
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["HF_HUB_OFFLINE"] = "1"
    env[ENV] = str(tiny_model)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HOOK), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    try:
        proc = subprocess.run(
            ["bash", "-e", "-c", block.code],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=SHELL_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where} ran past {SHELL_TIMEOUT_S} s", pytrace=False)
    if proc.returncode != 0:
        pytest.fail(
            f"{block.where} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}",
            pytrace=False,
        )
    return proc.stdout


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_code_blocks_run_or_say_why_not(page, request, tmp_path, monkeypatch):
    name = str(page.relative_to(ROOT))
    try:
        blocks = parse(page.read_text(encoding="utf-8"), name)
        runs = pair_outputs(blocks)
    except MarkerError as e:
        pytest.fail(str(e), pytrace=False)
    missing = unmarked(blocks)
    if missing:
        pytest.fail(
            "\n".join(
                f"{b.where}: a ```{b.lang or '(no language)'} block is not run: mark it "
                "<!-- not run: why --> on the line above (or make it a python or bash block)"
                for b in missing
            ),
            pytrace=False,
        )
    if not runs:
        return
    tiny_model = request.getfixturevalue("chat_model_dir")
    use_tiny_default(tiny_model, monkeypatch.setattr)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict[str, Any] = {"__name__": "__main__"}
    with _page_session():
        for block, expected in runs:
            if block.lang in PYTHON:
                out = _run_python(block, namespace)
            else:
                out = _run_shell(block, tiny_model)
            if expected is not None and normalize_output(out) != normalize_output(expected.code):
                pytest.fail(
                    f"{block.where}: its output differs from the <!-- output --> block at "
                    f"line {expected.line}\nexpected:\n{normalize_output(expected.code)}\n"
                    f"got:\n{normalize_output(out)}",
                    pytrace=False,
                )
