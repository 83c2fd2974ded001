"""The input line: prompt_toolkit with history across sessions, completion of /commands (and
of their arguments: settings, loaded programs, file paths) and multi-line messages.

Multi-line: Esc then Enter (Alt+Enter in most terminals) inserts a new line; so does Enter on
a line that ends in a backslash (the backslash is dropped). History lives in
``$XDG_CACHE_HOME/radixlang/repl_history`` (default ``~/.cache/radixlang/repl_history``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document
from prompt_toolkit.filters import Condition
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

from radixlang.repl.commands import ALIASES, SPECS
from radixlang.repl.settings import SETTING_NAMES

PROMPT = "radixlang> "
CONTINUATION = "......... "


def history_path() -> Path:
    """Where input history is kept: the user's cache folder (``XDG_CACHE_HOME`` honoured)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixlang" / "repl_history"


def open_history(path: Path | None) -> History:
    """A file history at ``path``; in memory when ``path`` is None or cannot be written."""
    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    except OSError:
        return InMemoryHistory()
    return FileHistory(str(path))


class CommandCompleter(Completer):
    """Completes a /command's name, then its first argument where that has known values."""

    def __init__(self, program_names: Callable[[], Iterable[str]]) -> None:
        self.program_names = program_names
        self.paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, complete_event: CompleteEvent):
        text = document.text_before_cursor
        if not text.startswith("/") or "\n" in text:
            return
        if " " not in text:
            word = text[1:].lower()
            for name in [*SPECS, *ALIASES]:
                if name.startswith(word):
                    yield Completion("/" + name, start_position=-len(text))
            return
        command, _, arg = text[1:].partition(" ")
        command = ALIASES.get(command.lower(), command.lower())
        if " " in arg.lstrip():
            return  # past the first argument
        arg = arg.lstrip()
        if command == "set":
            choices: Iterable[str] = SETTING_NAMES
        elif command in ("run", "graph"):
            choices = self.program_names()
        elif command in ("load", "save"):
            yield from self.paths.get_completions(Document(arg), complete_event)
            return
        else:
            return
        for choice in choices:
            if choice.startswith(arg):
                yield Completion(choice, start_position=-len(arg))


def key_bindings() -> KeyBindings:
    bindings = KeyBindings()

    @bindings.add("escape", "enter")
    def _(event: KeyPressEvent) -> None:
        event.current_buffer.insert_text("\n")

    ends_in_backslash = Condition(
        lambda: _current_text().endswith("\\") and not _current_text().endswith("\\\\")
    )

    @bindings.add("enter", filter=ends_in_backslash)
    def _(event: KeyPressEvent) -> None:
        buffer = event.current_buffer
        buffer.delete_before_cursor(1)
        buffer.insert_text("\n")

    return bindings


def _current_text() -> str:
    from prompt_toolkit.application.current import get_app

    buffer = get_app().current_buffer
    return buffer.document.text_before_cursor if buffer.document.is_cursor_at_the_end else ""


def _continuation(width: int, line_number: int, wrap_count: int) -> str:
    return CONTINUATION[:width].rjust(width)


def new_prompt_session(
    program_names: Callable[[], Iterable[str]], history: Path | None
) -> PromptSession[str]:
    return PromptSession(
        history=open_history(history),
        completer=CommandCompleter(program_names),
        complete_while_typing=True,
        key_bindings=key_bindings(),
        prompt_continuation=_continuation,
        multiline=False,
    )
