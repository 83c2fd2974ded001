"""The input line's pieces that need no terminal: completion and where history lives."""

from __future__ import annotations

from pathlib import Path

from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, InMemoryHistory

from radixlang.repl.prompt import CommandCompleter, history_path, open_history


def complete(text: str, programs: list[str] = ()) -> list[str]:
    completer = CommandCompleter(lambda: programs)
    return [c.text for c in completer.get_completions(Document(text), CompleteEvent())]


def test_commands_settings_and_programs_complete():
    assert complete("/fo") == ["/fork"]
    assert set(complete("/b")) == {"/back", "/branches"}
    assert complete("/set te") == ["temperature"]
    assert complete("/set max") == ["max_tokens"]
    assert complete("/run t", ["tips", "other"]) == ["tips"]
    assert complete("/graph ", ["tips"]) == ["tips"]
    assert complete("hello /fo") == [] and complete("/run tips to", ["tips"]) == []


def test_load_completes_paths(tmp_path, monkeypatch):
    (tmp_path / "programs.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert complete("/load prog") == ["rams.py"]


def test_history_lives_in_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert history_path() == tmp_path / "xdg" / "radixlang" / "repl_history"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert history_path() == Path.home() / ".cache" / "radixlang" / "repl_history"
    history = open_history(tmp_path / "xdg" / "radixlang" / "repl_history")
    assert isinstance(history, FileHistory) and (tmp_path / "xdg" / "radixlang").is_dir()
    assert isinstance(open_history(None), InMemoryHistory)
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert isinstance(open_history(blocked / "sub" / "history"), InMemoryHistory)
