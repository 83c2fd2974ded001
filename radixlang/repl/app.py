"""The REPL's loop: read a line, chat or run a /command, draw the result; never end the
session on a mistake.

A message is a chat turn streamed into the terminal; ``/fork N`` streams N replies side by side;
Ctrl-C while anything generates stops it (its requests are aborted and their blocks freed) and
returns to the prompt; Ctrl-D or ``/exit`` leaves with status 0.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from radixlang.lang.function import Function
from radixlang.repl import render
from radixlang.repl.backends import BackendError, ChatBackend, Generation
from radixlang.repl.commands import (
    COMMANDS,
    Command,
    CommandError,
    dispatch,
    is_command,
    parse_assignments,
    parse_count,
)
from radixlang.repl.programs import (
    ProgramError,
    ProgramRun,
    ProgramStopped,
    check_arguments,
    load_programs,
    signature,
    trace,
)
from radixlang.repl.session import Conversation, SessionError, Turn, Usage
from radixlang.repl.settings import SettingError, Settings

MAX_FORK = 16
STOP_WAIT_S = 30.0  # how long a stopped generation may take to release everything
# Mistakes a command can make: printed as one line, and the session goes on.
USER_ERRORS = (CommandError, SessionError, SettingError, ProgramError, BackendError)


class Repl:
    def __init__(self, backend: ChatBackend, console: Console, settings: Settings) -> None:
        self.backend = backend
        self.console = console
        self.settings = settings
        self.conversation = Conversation(settings.system)
        self.programs: dict[str, Function] = {}
        self.handlers: dict[str, Callable[[Command], bool | None]] = {
            "help": self.help,
            "fork": self.fork,
            "pick": self.pick,
            "back": self.back,
            "branches": self.branches,
            "tree": self.tree,
            "stats": self.stats,
            "flush": self.flush,
            "load": self.load,
            "programs": self.list_programs,
            "run": self.run_program,
            "graph": self.graph,
            "save": self.save,
            "set": self.set,
            "exit": lambda command: False,
        }

    # ---- the loop ----------------------------------------------------------------------------
    def banner(self) -> None:
        self.console.print(
            Text.assemble(
                ("radixlang repl", "bold"),
                f" · {self.backend.name} ({self.backend.where})",
                (" · /help for commands, Ctrl-D to leave", "dim"),
            )
        )

    def loop(self, read_line: Callable[[], str]) -> int:
        """Run until Ctrl-D or /exit; ``read_line`` raises EOFError at the end of input and
        KeyboardInterrupt for a Ctrl-C at the prompt (which only clears the line)."""
        while True:
            try:
                line = read_line()
            except KeyboardInterrupt:
                continue
            except EOFError:
                return 0
            if not self.handle(line):
                return 0

    def handle(self, line: str) -> bool:
        """One input line; False when the session should end."""
        text = line.strip()
        if not text:
            return True
        try:
            if is_command(text):
                return dispatch(text, self.handlers)
            self.chat(text[1:] if text.startswith("//") else text)
        except USER_ERRORS as e:
            self.error(str(e))
        except KeyboardInterrupt:
            self.error("interrupted")
        except Exception as e:  # a fault of ours must not end the user's session
            self.error(f"{type(e).__name__}: {e}")
        return True

    def error(self, message: str) -> None:
        self.console.print(Text(message, style="red"))

    def note(self, message: str) -> None:
        self.console.print(Text(message, style="dim"))

    # ---- chat --------------------------------------------------------------------------------
    def chat(self, message: str) -> None:
        user = self.conversation.add_user(message)
        replies = self._sample(user, 1, new_user=True)
        if replies:
            self.conversation.select(replies[0])

    def fork(self, command: Command) -> None:
        n = parse_count(command.args[0], "N", 1, MAX_FORK)
        message = command.rest.split(maxsplit=1)[1] if len(command.args) > 1 else ""
        if message:
            user = self.conversation.add_user(message)
        else:
            user = self.conversation.last_user()
            if user is None:
                raise SessionError("nothing to fork: send a message first, or /fork N MESSAGE")
        replies = self._sample(user, n, new_user=bool(message))
        if replies:
            self.conversation.select(replies[0])
            first = self.conversation.branch_number(replies[0])
            self.note(f"continuing from [{first}]; /pick K takes another, /branches lists them")

    def _sample(self, user: Turn, n: int, new_user: bool) -> list[Turn]:
        """Stream ``n`` replies to ``user`` and keep them (a stopped one with its text so far);
        a new user turn that got no reply is dropped again."""
        replies: list[Turn] = []
        try:
            self.conversation.system = self.settings.system
            messages = self.conversation.messages(upto=user)
            first = len(user.replies())  # the replies it has; the new ones are numbered on
            generation = self.backend.chat(messages, self.settings.sampling(), n, first)
            numbers = list(range(first + 1, first + n + 1))
            texts, results, stopped = self._stream(generation, numbers)
            for text, (usage, error) in zip(texts, results, strict=True):
                if error is None and (text or not stopped):
                    replies.append(self.conversation.add_reply(user, text, usage))
            if stopped:
                self.note("stopped: the requests were aborted and their blocks released")
        finally:
            if new_user and not user.children:
                self.conversation.discard(user)
        return replies

    def _stream(
        self, generation: Generation, numbers: list[int]
    ) -> tuple[list[str], list[tuple[Usage | None, str | None]], bool]:
        n = generation.n
        view: render.ReplyView | render.ForkView = (
            render.ReplyView(self.console)
            if n == 1
            else render.ForkView(self.console, [f"[{k}]" for k in numbers])
        )
        texts = [""] * n
        results: list[tuple[Usage | None, str | None] | None] = [None] * n
        stopped = False

        def take(timeout: float) -> None:
            piece = generation.next_piece(timeout)
            if piece is None:
                return
            if piece.done:
                results[piece.branch] = (piece.usage, piece.error)
                view.done(piece.branch, piece.usage, piece.error)
            else:
                texts[piece.branch] += piece.text
                view.add(piece.branch, piece.text)

        try:
            try:
                while any(r is None for r in results):
                    take(0.1)
            except KeyboardInterrupt:
                stopped = True
                generation.cancel()
                deadline = time.monotonic() + STOP_WAIT_S
                while any(r is None for r in results) and time.monotonic() < deadline:
                    take(0.1)
                generation.join(timeout=5.0)
        finally:
            view.close()
        done = [r if r is not None else (Usage(finish_reason="abort"), None) for r in results]
        return texts, done, stopped

    def pick(self, command: Command) -> None:
        number = parse_count(command.args[0], "K")
        reply = self.conversation.pick(number)
        self.note(f"continuing from [{number}]: {render.turn_label(reply)}")

    def back(self, command: Command) -> None:
        user = self.conversation.back()
        left = len(self.conversation.path())
        self.note(f"undid {render.turn_label(user)} ({left} turns left on the active path)")

    def branches(self, command: Command) -> None:
        self.console.print(render.branches_view(self.conversation))

    # ---- the cache ---------------------------------------------------------------------------
    def tree(self, command: Command) -> None:
        described = self.backend.cache_tree()
        if described is None:
            raise BackendError(
                f"/tree is not available over --url ({self.backend.where}): the server has no "
                "route for the radix tree; /stats works"
            )
        tree, decode = described
        self.console.print(render.cache_tree(tree, decode, self.console.width))

    def stats(self, command: Command) -> None:
        self.console.print(render.stats_table(self.backend.stats()))

    def flush(self, command: Command) -> None:
        self.backend.flush()
        self.note("the prefix cache is empty")

    # ---- programs ----------------------------------------------------------------------------
    def load(self, command: Command) -> None:
        found = load_programs(command.args[0])
        self.programs.update(found)
        names = ", ".join(signature(f) for f in found.values())
        self.note(f"loaded {names} from {command.args[0]}")

    def list_programs(self, command: Command) -> None:
        if not self.programs:
            self.note("no programs loaded: /load FILE.py")
            return
        for name, function in self.programs.items():
            self.console.print(Text.assemble((name, "bold cyan"), f"  {signature(function)}"))

    def _program(self, name: str) -> Function:
        function = self.programs.get(name)
        if function is None:
            known = ", ".join(self.programs) or "none loaded: /load FILE.py first"
            raise ProgramError(f"no program {name!r} (programs: {known})")
        return function

    def run_program(self, command: Command) -> None:
        function = self._program(command.args[0])
        arguments = parse_assignments(command.args[1:])
        check_arguments(function, arguments)
        before = self._counters()
        try:
            run = ProgramRun(
                function, arguments, self.backend.program_backend(), self.settings.sampling()
            )
        except TypeError as e:
            raise ProgramError(str(e)) from None
        view = render.ProgramView(self.console)
        stopped = False
        try:
            try:
                while not run.wait(0.05):
                    for piece in run.new_pieces():
                        view.add(piece.label, piece.var, piece.text)
            except KeyboardInterrupt:
                stopped = True
                if not run.stop(STOP_WAIT_S):
                    self.error("the program is still finishing in the background")
            for piece in run.new_pieces():
                view.add(piece.label, piece.var, piece.text)
        finally:
            view.close()
        if stopped or isinstance(run.error, ProgramStopped):
            self.note("stopped: the program's requests were aborted")
        elif run.error is not None:
            self.error(f"{function.__name__} failed: {type(run.error).__name__}: {run.error}")
        else:
            streamed = {var for _, var in view.rows}  # already on screen
            variables = {k: v for k, v in run.variables().items() if k not in streamed}
            if variables:
                self.console.print(render.variables_table(variables))
        self._report_counters(before)

    def _counters(self) -> dict[str, Any] | None:
        try:
            return self.backend.stats()
        except BackendError:
            return None

    def _report_counters(self, before: dict[str, Any] | None) -> None:
        after = self._counters()
        if before is None or after is None:
            return
        reused = after["prompt_tokens_reused"] - before["prompt_tokens_reused"]
        computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        generated = after["generated_tokens"] - before["generated_tokens"]
        self.note(
            f"prompt tokens: {reused} from the cache, {computed} computed; "
            f"{generated} tokens generated"
        )

    def graph(self, command: Command) -> None:
        function = self._program(command.args[0])
        arguments = parse_assignments(command.args[1:])
        try:
            graph = trace(function, arguments, self.backend.program_backend())
        except ProgramError:
            raise
        except Exception as e:  # TracingError and what the program's Python raised
            hint = "" if command.args[1:] else " (give what its Python needs: key=value ...)"
            raise ProgramError(f"{type(e).__name__}: {e}{hint}") from None
        self.console.print(render.graph_tree(graph))

    # ---- the session -------------------------------------------------------------------------
    def save(self, command: Command) -> None:
        path = Path(command.args[0]).expanduser()
        data = self.conversation.to_json()
        data["model"] = self.backend.name
        data["settings"] = self.settings.as_dict()
        try:
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        except OSError as e:
            raise CommandError(f"cannot write {path}: {e.strerror or e}") from None
        turns = len(self.conversation.all_turns()) - 1
        self.note(f"saved {turns} turns ({len(data['messages'])} active messages) to {path}")

    def set(self, command: Command) -> None:
        if not command.args:
            table = Table(show_header=False, box=None, padding=(0, 2))
            for key, value in self.settings.as_dict().items():
                table.add_row(Text(key, style="bold"), Text(repr(value)))
            self.console.print(table)
            return
        key, _, raw = command.rest.partition(" ")
        if not raw.strip() and key != "system":
            raise CommandError(f"usage: /set {key} VALUE")
        value = self.settings.set(key, raw.strip().strip("'\"") if key != "system" else raw)
        if key == "system":
            self.conversation.system = value
        self.note(f"{key} = {value!r}")

    def help(self, command: Command) -> None:
        self.console.print(render.help_table(COMMANDS))


def read_plain_line() -> str:
    """A line from a stdin that is not a terminal (a pipe, a file): no editing, no history."""
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")
