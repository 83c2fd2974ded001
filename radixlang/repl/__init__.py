"""``radixlang repl``: an interactive session on the local runtime or a running server.

Chat turns stream with the model's chat template; ``/fork`` samples replies side by side from
one cached prefix; ``/tree`` and ``/stats`` show the radix cache at work; ``/load`` and
``/run`` run ``@function`` programs with every gen streaming. ``add_arguments`` and ``main``
are what the ``radixlang`` command wires in; ``python -m radixlang.repl`` runs it alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The REPL's own options (the engine's, such as --dtype, come from the caller)."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--model", default=None, help="model name or folder for a local engine (default model)"
    )
    where.add_argument(
        "--url",
        default=None,
        help="a running server instead (radixlang serve), e.g. http://127.0.0.1:30000",
    )
    parser.add_argument("--api-key", default=None, help="the server's API key, with --url")
    parser.add_argument("--system", default=None, help="the system message")
    parser.add_argument("--temperature", type=float, default=None, help="default 0.7")
    parser.add_argument("--max-tokens", type=int, default=None, help="per reply; default 256")
    parser.add_argument(
        "--history-file",
        type=Path,
        default=None,
        help="input history (default: $XDG_CACHE_HOME/radixlang/repl_history)",
    )
    parser.add_argument("--no-history", action="store_true", help="keep no input history")


def main(args: argparse.Namespace, config: Any = None) -> int:
    """Run the session; ``config.engine_kwargs()`` (a dict) sizes a local engine, ``None``
    takes the engine's defaults. Returns the exit status (0 after Ctrl-D or /exit)."""
    from rich.console import Console

    from radixlang.repl.app import Repl, read_plain_line
    from radixlang.repl.backends import BackendError
    from radixlang.repl.connect import open_backend
    from radixlang.repl.prompt import PROMPT, history_path, new_prompt_session
    from radixlang.repl.settings import SettingError, Settings

    console = Console(highlight=False)
    settings = Settings()
    try:
        for key, value in (
            ("temperature", getattr(args, "temperature", None)),
            ("max_tokens", getattr(args, "max_tokens", None)),
            ("system", getattr(args, "system", None)),
        ):
            if value is not None:
                settings.set(key, str(value))
    except SettingError as e:
        console.print(f"[red]{e}[/red]")
        return 2
    where = getattr(args, "url", None) or getattr(args, "model", None) or "the default model"
    console.print(f"[dim]starting on {where} …[/dim]")
    try:
        backend = open_backend(args, config)
    except KeyboardInterrupt:
        return 130
    except BackendError as e:
        console.print(f"[red]{e}[/red]")
        return 1
    except Exception as e:  # a model that cannot load: say which and why
        console.print(f"[red]cannot start on {where}: {type(e).__name__}: {e}[/red]")
        return 1
    repl = Repl(backend, console, settings)
    try:
        repl.banner()
        if sys.stdin.isatty():
            history = None if args.no_history else (args.history_file or history_path())
            session = new_prompt_session(lambda: list(repl.programs), history)
            return repl.loop(lambda: session.prompt(PROMPT))
        return repl.loop(read_plain_line)
    finally:
        backend.close()
