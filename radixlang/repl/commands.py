"""The /commands: their names and usage, parsing a line into one, and dispatching it.

A line that starts with ``/`` is a command (``//`` sends a message that starts with ``/``).
Arguments split like a shell's (quotes group words). Every mistake — an unknown name, a wrong
number of arguments, a bad count or ``key=value`` — is a :class:`CommandError` whose message
says what was expected; the session prints it and goes on.
"""

from __future__ import annotations

import ast
import difflib
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class CommandError(ValueError):
    """A command line that cannot run as typed; the message says what is expected."""


@dataclass(frozen=True)
class CommandSpec:
    name: str
    usage: str
    summary: str
    min_args: int = 0
    max_args: int | None = 0  # None: any number


COMMANDS: tuple[CommandSpec, ...] = (
    CommandSpec("help", "/help", "list the commands"),
    CommandSpec(
        "fork",
        "/fork N [MESSAGE]",
        "sample N replies to the last message (or to MESSAGE) side by side",
        1,
        None,
    ),
    CommandSpec("pick", "/pick K", "continue from reply K of the last message", 1, 1),
    CommandSpec("back", "/back", "undo the last turn (it stays in the saved transcript)"),
    CommandSpec("branches", "/branches", "list the replies of the last message"),
    CommandSpec("tree", "/tree", "draw the radix cache (token text on edges)"),
    CommandSpec("stats", "/stats", "cache hit rate, blocks used/free/evictable, requests"),
    CommandSpec("flush", "/flush", "empty the prefix cache"),
    CommandSpec("load", "/load FILE.py", "import a file's @function programs", 1, 1),
    CommandSpec("programs", "/programs", "list the loaded programs and their arguments"),
    CommandSpec(
        "run", "/run NAME [key=value ...]", "run a loaded program, streaming every gen", 1, None
    ),
    CommandSpec(
        "graph", "/graph NAME [key=value ...]", "print a program's traced call graph", 1, None
    ),
    CommandSpec("save", "/save FILE", "write the transcript: JSON, messages and branches", 1, 1),
    CommandSpec(
        "set",
        "/set [KEY VALUE]",
        "show or change temperature, max_tokens, top_p, top_k, seed, system, ignore_eos",
        0,
        None,
    ),
    CommandSpec("exit", "/exit", "leave the session (also Ctrl-D)"),
)
SPECS: dict[str, CommandSpec] = {spec.name: spec for spec in COMMANDS}
ALIASES = {"quit": "exit", "q": "exit", "?": "help", "h": "help"}


@dataclass(frozen=True)
class Command:
    spec: CommandSpec
    args: list[str]  # shell-split
    rest: str  # the raw text after the name (for values that keep their spacing)

    @property
    def name(self) -> str:
        return self.spec.name


def is_command(line: str) -> bool:
    return line.startswith("/") and not line.startswith("//")


def parse_command(line: str) -> Command:
    """``/name args...`` as a :class:`Command`; raises :class:`CommandError` if it is not one."""
    body = line.strip()
    if not body.startswith("/"):
        raise CommandError(f"not a command: {line!r}")
    parts = body[1:].split(maxsplit=1)
    if not parts:
        raise CommandError("an empty command: /help lists them")
    word, rest = parts[0], parts[1] if len(parts) > 1 else ""
    name = ALIASES.get(word.lower(), word.lower())
    spec = SPECS.get(name)
    if spec is None:
        close = difflib.get_close_matches(name, list(SPECS), n=1)
        hint = f" (did you mean /{close[0]}?)" if close else ""
        raise CommandError(f"unknown command /{word}{hint}: /help lists them")
    try:
        args = shlex.split(rest)
    except ValueError as e:
        raise CommandError(f"/{name}: {e} (usage: {spec.usage})") from None
    if len(args) < spec.min_args or (spec.max_args is not None and len(args) > spec.max_args):
        raise CommandError(f"usage: {spec.usage}")
    return Command(spec, args, rest.strip())


def parse_count(text: str, what: str, minimum: int = 1, maximum: int | None = None) -> int:
    """A whole number in ``[minimum, maximum]``, named ``what`` in the error."""
    try:
        value = int(text)
    except ValueError:
        raise CommandError(f"{what} must be a whole number, got {text!r}") from None
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise CommandError(f"{what} must be at least {minimum}{upper}, got {value}")
    return value


def parse_assignments(args: list[str]) -> dict[str, Any]:
    """``key=value`` words as a dict: values are Python literals where they parse (``3``,
    ``0.5``, ``True``, ``[1, 2]``, ``'x'``), else the text as typed."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or not key.isidentifier():
            raise CommandError(f"expected key=value, got {arg!r}")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            out[key] = raw
    return out


Handler = Callable[[Command], bool | None]


def dispatch(line: str, handlers: Mapping[str, Handler]) -> bool:
    """Parse ``line`` and run its handler; False when the session should end."""
    command = parse_command(line)
    handler = handlers.get(command.name)
    if handler is None:  # a command listed but not served by this session
        raise CommandError(f"/{command.name} is not available here")
    return handler(command) is not False
