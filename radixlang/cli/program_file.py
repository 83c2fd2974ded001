"""``radixlang run FILE.py``: a program file run as ``__main__`` with a default backend set.

The default backend is lazy: the local engine (or the server connection) is made the first time
the program needs the default backend, so a file of ``@function`` programs and calls needs no
backend boilerplate, and a file that makes and sets its own backend (as the examples do) loads
no second model. Every ``Runtime()`` the program makes takes the command's engine settings for
what it does not pass itself (``runtime_defaults``). At the end each backend used reports what
its prompt cache did, and every Runtime made is shut down.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixlang.cli import cache_report
from radixlang.lang.backends.base import Backend
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod
from radixlang.lang.run_options import get_default_backend, runtime_defaults, set_default_backend


class LazyBackend(Backend):
    """A backend made by ``make()`` on first use (from whichever thread gets there first).

    Both backends it stands for (``Runtime``, ``RuntimeEndpoint``) are completion backends, so
    ``is_chat_model`` is known without making one. Other attributes (``stats()``, ``engine``)
    are the made backend's."""

    is_chat_model = False

    def __init__(self, make: Callable[[], Backend]) -> None:
        self._make = make
        self._backend: Backend | None = None
        self._lock = threading.Lock()

    @property
    def made(self) -> Backend | None:
        return self._backend

    @property
    def backend(self) -> Backend:
        with self._lock:
            if self._backend is None:
                self._backend = self._make()
            return self._backend

    def get_chat_template(self) -> Any:
        return self.backend.get_chat_template()

    def generate(self, prompt: str, sampling: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return self.backend.generate(prompt, sampling)

    def generate_stream(
        self, prompt: str, sampling: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        return self.backend.generate_stream(prompt, sampling)

    def generate_chat(
        self, messages: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        return self.backend.generate_chat(messages, sampling)

    def generate_chat_stream(
        self, messages: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        return self.backend.generate_chat_stream(messages, sampling)

    def select(
        self,
        prompt: str,
        choices: Sequence[str],
        temperature: float,
        method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        return self.backend.select(prompt, choices, temperature, method)

    def cache_prefix(self, prompt: str, wait: bool = False) -> None:
        self.backend.cache_prefix(prompt, wait)

    def flush_cache(self) -> bool:
        made = self.made
        return True if made is None else made.flush_cache()  # nothing cached yet

    def shutdown(self) -> None:
        if self._backend is not None:
            self._backend.shutdown()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.backend, name)


@dataclass
class EndpointUse:
    """A server's stats when the program first reached it, to report this run's share."""

    endpoint: Any  # RuntimeEndpoint
    before: dict[str, Any] | None = None


def make_endpoint(url: str, api_key: str | None, uses: list[EndpointUse]) -> Callable[[], Backend]:
    def make() -> Backend:
        from radixlang.lang.backends.endpoint import RuntimeEndpoint

        endpoint = RuntimeEndpoint(url, api_key=api_key)
        uses.append(EndpointUse(endpoint, server_stats(endpoint)))
        return endpoint

    return make


def make_runtime(engine_args: dict[str, Any]) -> Callable[[], Backend]:
    def make() -> Backend:
        from radixlang.lang.backends.local import Runtime

        return Runtime(**engine_args)

    return make


def server_stats(endpoint: Any) -> dict[str, Any] | None:
    """The server's engine stats (a radixlang server's ``/get_server_info``), or None."""
    try:
        stats = endpoint.get_server_info().get("stats")
    except Exception:  # a server without the route, or gone: nothing to report
        return None
    return stats if isinstance(stats, dict) and "prompt_tokens" in stats else None


@dataclass
class ProgramRun:
    """What ``run_program_file`` found: the exit code and the backends the program used."""

    exit_code: int
    runtimes: list[Backend] = field(default_factory=list)
    endpoints: list[EndpointUse] = field(default_factory=list)

    def cache_summary(self) -> str:
        """The prompt cache's work, per backend used."""
        parts = []
        for rt in self.runtimes:
            engine = rt.engine  # type: ignore[attr-defined]
            runner = engine.runner
            dtype = str(runner.dtype).removeprefix("torch.")
            head = f"cache of {engine.files.name} (local engine, {dtype}, {runner.device}):"
            parts.append(head + "\n" + _indent(cache_report.format_stats(engine.stats())))
        for use in self.endpoints:
            head = f"cache of the server at {use.endpoint.base_url}"
            after = server_stats(use.endpoint)
            if use.before is None or after is None:
                parts.append(head + ": the server reports no cache statistics")
                continue
            change = cache_report.stats_change(use.before, after)
            body = [
                cache_report.format_prompt_tokens(change),
                f"generated     {change['generated_tokens']} tokens in "
                f"{change['finished_requests']} requests",
                cache_report.format_blocks(after),
            ]
            parts.append(head + " (this run's share; blocks now):\n" + _indent("\n".join(body)))
        return "\n".join(parts) if parts else "no model was used"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def run_program_file(
    path: Path,
    argv: Sequence[str],
    default_backend: LazyBackend,
    engine_defaults: dict[str, Any],
    endpoint_uses: list[EndpointUse] | None = None,
) -> ProgramRun:
    """Run ``path`` as ``__main__`` with ``sys.argv = [path, *argv]`` and ``default_backend`` as
    the default backend; every Runtime it makes takes ``engine_defaults`` for what it does not
    pass. Afterwards the Runtimes made are shut down and the default backend is restored."""
    saved = sys.argv, list(sys.path), get_default_backend()
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.resolve().parent))  # as `python FILE` does: sibling imports
    set_default_backend(default_backend)
    with runtime_defaults(engine_defaults) as runtimes:
        try:
            code = _run(path)
        finally:
            sys.argv, sys.path[:] = saved[0], saved[1]
            set_default_backend(saved[2])
            made = list(dict.fromkeys(runtimes))  # in order, once each
            for rt in made:
                rt.shutdown()
    return ProgramRun(code, made, list(endpoint_uses or []))


def _run(path: Path) -> int:
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        return _exit_code(e)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", file=sys.stderr)
        return 130
    except Exception as e:
        _print_program_traceback(e, path)
        return 1
    return 0


def _exit_code(e: SystemExit) -> int:
    """As the interpreter reads ``sys.exit(code)``: None is 0, an int itself, else printed, 1."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _print_program_traceback(e: BaseException, path: Path) -> None:
    """The traceback from the program's own first frame on (runpy's frames are noise)."""
    target = os.path.realpath(path)
    tb = e.__traceback__
    while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != target:
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb, file=sys.stderr)
