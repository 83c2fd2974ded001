"""A streamed run's failure is never lost: raised to whoever reads the stream or the state, or,
when nobody does, reported on stderr (as an unhandled exception in a thread is) once its state
is gone or the process exits. Each case runs in a subprocess, since the report may come at
exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

PRELUDE = f"""
import gc, sys, time
sys.path.insert(0, {str(HERE)!r})
from fake_backend import FakeBackend
import radixlang as sgl

backend = FakeBackend()
backend.fail_on = "bad"

@sgl.function
def raises(s):
    s += "x"
    raise ValueError("boom from the body")

@sgl.function
def gen_fails(s):
    s += "bad" + sgl.gen("a")
"""


def run_script(body: str) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_an_unread_program_exception_is_reported_at_exit():
    # The process ends at once: the run may still be going, and its failure is not lost.
    done = run_script("state = raises.run(backend=backend, stream=True)\n")
    assert done.returncode == 0, done.stderr
    assert "ValueError: boom from the body" in done.stderr
    assert "raises" in done.stderr  # the report names the program
    assert done.stderr.count("ValueError: boom from the body") == 1


def test_an_unread_gen_failure_is_reported_at_exit():
    done = run_script("state = gen_fails.run(backend=backend, stream=True)\n")
    assert "ValueError: backend failure on 'bad'" in done.stderr
    assert done.stderr.count("ValueError: backend failure") == 1


def test_a_dropped_failed_run_is_reported_when_its_state_goes():
    done = run_script("""
        import io
        sys.stderr = captured = io.StringIO()
        raises.run(backend=backend, stream=True)  # the state is dropped at once
        deadline = time.monotonic() + 30
        while "boom" not in captured.getvalue() and time.monotonic() < deadline:
            gc.collect()  # the run ends on its own thread, and then its state can go
            time.sleep(0.05)
        sys.stderr = sys.__stderr__
        print("reported before exit:", "boom" in captured.getvalue())
        print(captured.getvalue(), file=sys.stderr)
    """)
    assert "reported before exit: True" in done.stdout, done.stderr
    assert "ValueError: boom from the body" in done.stderr
    assert done.stderr.count("ValueError: boom from the body") == 1


def test_a_reader_gets_the_exception_and_it_is_not_reported_again():
    # Each read waits for what it reads, so it always meets the failure.
    for prog, read in (
        ("raises", "list(state.text_iter())"),
        ("gen_fails", "list(state.text_iter())"),
        ("gen_fails", "state['a']"),
        ("gen_fails", "list(state.text_iter('a'))"),
        ("gen_fails", "list(state.text_iter('a', return_meta_data=True))"),
    ):
        done = run_script(f"""
            state = {prog}.run(backend=backend, stream=True)
            try:
                {read}
            except ValueError as e:
                print("caught:", e)
            else:
                print("not raised")
        """)
        assert done.returncode == 0, done.stderr
        assert "caught:" in done.stdout, (prog, read, done.stdout, done.stderr)
        assert "ValueError" not in done.stderr, (prog, read, done.stderr)
