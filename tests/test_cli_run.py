"""`radixlang run FILE.py`: a program file runs as __main__ with the default backend set from the
command's flags (built only when first needed), a program's own Runtime takes those settings
for what it does not pass, and the cache of every backend used is reported at the end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import radixlang as sgl
from radixlang.cli import main

REPO = Path(__file__).resolve().parents[1]

ASK = """
import sys
import radixlang as sgl

@sgl.function
def ask(s, question):
    s += sgl.system("You answer in one word.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=3, temperature=0))
"""


def program(tmp_path: Path, body: str, name: str = "program.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def engine_threads() -> int:
    return sum(t.name == "radixlang-engine" and t.is_alive() for t in threading.enumerate())


def tiny(chat_model_dir: Path) -> list[str]:
    return ["--model", str(chat_model_dir), "--dtype", "float32", "--kv-memory", "16MiB"]


def reused_and_computed(summary: str) -> tuple[int, int]:
    m = re.search(r"prompt tokens (\d+): (\d+) reused from the cache, (\d+) computed", summary)
    assert m, summary
    total, reused, computed = map(int, m.groups())
    assert reused + computed == total
    return reused, computed


def test_a_program_runs_with_no_backend_boilerplate(tmp_path, chat_model_dir, capsys):
    path = program(
        tmp_path,
        ASK
        + """
print("argv", sys.argv[1:])
for q in sys.argv[1:]:
    print("answer", repr(ask.run(question=q)["answer"]))
sys.exit(3)
""",
    )
    before_argv, threads = list(sys.argv), engine_threads()
    before_backend = sgl.get_default_backend()  # an earlier test may have left one set
    code = main(["run", str(path), *tiny(chat_model_dir), "--", "Capital of France?", "2+2?"])
    out, err = capsys.readouterr()
    assert code == 3  # the program's own exit code
    assert "argv ['Capital of France?', '2+2?']" in out
    assert out.count("answer '") == 2
    assert f"cache of {chat_model_dir.name} (local engine, float32, cpu)" in err
    reused, computed = reused_and_computed(err)
    assert reused > 0 and computed > 0  # the second question reused the shared system prompt
    assert "requests      2 finished" in err
    # Everything is put back: argv, the default backend, and no engine left running.
    assert sys.argv == before_argv and sgl.get_default_backend() is before_backend
    assert engine_threads() == threads


def test_a_program_with_its_own_runtime_loads_no_second_model(tmp_path, chat_model_dir, capsys):
    path = program(
        tmp_path,
        """
        import json
        import radixlang as sgl

        rt = sgl.Runtime(kv_memory="4MiB")  # as the examples do; it passes kv_memory itself
        sgl.set_default_backend(rt)

        @sgl.function
        def hello(s):
            s += "Hello" + sgl.gen("x", max_tokens=2)

        hello.run()
        engine = rt.engine
        kv_bytes = (engine.pool.num_blocks * engine.pool.block_size
                    * engine.files.config.kv_bytes_per_token(4))
        print(json.dumps({"model": str(engine.files.path),
                          "dtype": str(engine.runner.dtype).removeprefix("torch."),
                          "block_size": engine.pool.block_size, "kv_bytes": kv_bytes}))
        """,
    )
    threads = engine_threads()
    args = ["run", str(path), *tiny(chat_model_dir), "--block-size", "8"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    made = json.loads(out.strip().splitlines()[-1])
    assert made["model"] == str(chat_model_dir)  # --model reached the program's Runtime()
    assert made["dtype"] == "float32" and made["block_size"] == 8  # so did the other flags
    assert made["kv_bytes"] <= 4 * 2**20  # but what the program passed itself won
    assert err.count("cache of ") == 1  # the lazy default backend was never built
    assert engine_threads() == threads  # the program's Runtime was shut down


def test_an_exception_exits_1_with_the_programs_traceback(tmp_path, capsys):
    path = program(
        tmp_path,
        """
        def parse(text):
            raise ValueError(f"cannot parse {text!r}")

        parse("oops")
        """,
    )
    assert main(["run", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ValueError: cannot parse 'oops'" in err
    assert f'File "{path}", line 3, in parse' in err
    assert "runpy" not in err  # the frames start at the program's own
    assert "no model was used" in err  # and no engine was built for it


def test_sys_exit_with_a_message_exits_1_and_prints_it(tmp_path, capsys):
    path = program(tmp_path, "import sys\nsys.exit('giving up')\n")
    assert main(["run", str(path)]) == 1
    assert "giving up" in capsys.readouterr().err


def test_bad_invocations_exit_2_naming_the_problem(tmp_path, capsys):
    assert main(["run", str(tmp_path / "missing.py")]) == 2
    assert "no program file" in capsys.readouterr().err
    path = program(tmp_path, "print('hi')\n")
    assert main(["run", str(path), "--url", "http://127.0.0.1:1", "--dtype", "float32"]) == 2
    assert "--dtype configure a local engine" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["run", str(path), "--depth", "2"])
    assert e.value.code == 2
    assert "the program's own arguments go after --" in capsys.readouterr().err


def test_a_program_runs_on_a_server_with_url(tmp_path, chat_model_dir, capsys):
    from radixlang.runtime.engine import Engine
    from radixlang.server.app import serve_in_thread

    path = program(
        tmp_path,
        ASK
        + """
for q in ["Capital of France?", "Capital of Spain?"]:
    print("answer", repr(ask.run(question=q)["answer"]))
""",
    )
    engine = Engine(str(chat_model_dir), kv_memory="16MiB", dtype="float32")
    try:
        with serve_in_thread(engine) as server:
            engine.generate(["Warm the server's counters"], {"max_new_tokens": 1})
            assert main(["run", str(path), "--url", server.url]) == 0
    finally:
        engine.shutdown(free_cache=True)
    out, err = capsys.readouterr()
    assert out.count("answer '") == 2
    assert f"cache of the server at {server.url} (this run's share" in err
    reused, computed = reused_and_computed(err)
    assert reused > 0 and computed > 0
    assert "in 2 requests" in err  # the warm-up request before the run is not counted


@pytest.mark.slow
def test_run_tree_of_thought_example_unchanged():
    """The acceptance: the main example, unchanged, under `radixlang run` on the default model."""
    cmd = [sys.executable, "-m", "radixlang.cli", "run", "examples/tree_of_thought.py", "--"]
    cmd += ["--branching", "2", "--depth", "2", "--max-tokens", "8"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "4 leaves" in done.stdout and "the vote's winner" in done.stdout
    assert done.stderr.count("cache of smollm2-135m-instruct (local engine") == 1
    reused, computed = reused_and_computed(done.stderr)
    assert reused > computed  # the tree's prompts share their prefixes
