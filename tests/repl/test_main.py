"""``radixlang.repl.main`` as the cli calls it, with input from a pipe (no terminal)."""

from __future__ import annotations

import argparse
import io
from dataclasses import dataclass

import pytest

from radixlang.repl import add_arguments, main


@dataclass
class Config:
    kv_memory: str = "64MiB"

    def engine_kwargs(self) -> dict:
        return {"kv_memory": self.kv_memory, "dtype": "float32"}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_piped_commands_run_and_end_with_status_0(chat_model_dir, monkeypatch, capsys):
    lines = "hi\n/fork 2\n/pick 1\n/bogus\n/stats\n/set\n/help\n/exit\nnever read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    args = parse("--model", str(chat_model_dir), "--max-tokens", "4", "--system", "Be brief.")
    assert main(args, Config()) == 0
    out = capsys.readouterr().out
    assert "radixlang repl" in out and "(local)" in out
    assert out.count(" computed · ") == 3  # usage lines: the turn and two forks
    assert "unknown command /bogus" in out
    assert "blocks held by requests" in out and "integrity" in out
    assert "'Be brief.'" in out and "max_tokens" in out  # /set shows the settings
    assert "/fork N [MESSAGE]" in out and "Esc then Enter" in out


def test_start_up_errors_are_messages_with_status_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(parse("--url", "http://127.0.0.1:9"), None) == 1
    assert "cannot reach a server at http://127.0.0.1:9" in capsys.readouterr().out
    assert main(parse("--model", str(tmp_path / "no-such-model")), Config()) == 1
    assert "cannot start on" in capsys.readouterr().out
    assert main(parse("--temperature", "-1"), Config()) == 2
    assert "temperature must be >= 0" in capsys.readouterr().out


def test_model_and_url_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        parse("--model", "x", "--url", "http://h")
    assert "not allowed with argument" in capsys.readouterr().err
