"""Programs in the REPL: ``/load`` a file's ``@function`` programs, ``/run`` one with every gen
streamed as it happens (forked branches labelled), ``/graph`` its traced call graph.

A run is ``f.run(stream=True)`` on the session's backend. Its state's executor and the ones it
forked hold each streamed gen's pieces (``stream_chunks``); a poll walks that tree and reports
the new pieces, labelled ``main`` or ``fork 2`` (``fork 2.1`` for a fork of a fork). Ctrl-C
sets a flag that the backend wrapper checks between pieces and before every call: the stream
in progress is closed (the engine aborts its request) and the program stops with
:class:`ProgramStopped`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import itertools
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixlang.lang.backends.base import Backend
from radixlang.lang.function import Function
from radixlang.lang.ir import SamplingDefaults

_module_ids = itertools.count()
_SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingDefaults)}


class ProgramError(ValueError):
    """A file or program that cannot be loaded or run as asked; the message says why."""


class ProgramStopped(RuntimeError):
    """The run was stopped with Ctrl-C."""


def load_programs(path: str | Path) -> dict[str, Function]:
    """Import the Python file at ``path`` and return its ``@function`` programs by name."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ProgramError(f"no such file: {path}")
    if file.suffix != ".py":
        raise ProgramError(f"{path} is not a Python file (.py)")
    name = f"radixlang_repl_programs_{next(_module_ids)}_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ProgramError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        sys.modules.pop(name, None)
        raise ProgramError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    found = {key: value for key, value in vars(module).items() if isinstance(value, Function)}
    if not found:
        raise ProgramError(f"{path} defines no @function programs")
    return found


def signature(function: Function) -> str:
    return f"{function.__name__}({', '.join(function.arg_names)})"


def check_arguments(function: Function, arguments: dict[str, Any], tracing: bool = False) -> None:
    """Unknown keys are an error; so are missing arguments, except when tracing (they stay
    symbolic there). Sampling keys (temperature, max_new_tokens, ...) are run defaults."""
    accepted = set(function.arg_names) | (set() if tracing else _SAMPLING_KEYS)
    unknown = sorted(set(arguments) - accepted)
    if unknown:
        raise ProgramError(
            f"{function.__name__} has no argument {', '.join(unknown)}: it takes "
            f"{', '.join(function.arg_names) or 'none'}"
        )
    if tracing:
        return
    params = list(inspect.signature(function.func).parameters.values())[1:]
    given = set(arguments) | set(function.bind_arguments)
    missing = [p.name for p in params if p.default is p.empty and p.name not in given]
    if missing:
        raise ProgramError(f"{function.__name__} needs {', '.join(f'{m}=...' for m in missing)}")


@dataclass(frozen=True)
class ProgramPiece:
    label: str  # "main", "fork 2", "fork 2.1"
    var: str  # the gen's variable ("gen" for an unnamed one)
    text: str


class ProgramRun:
    """One streamed run of a program; poll it with :meth:`wait` and :meth:`new_pieces`."""

    def __init__(
        self,
        function: Function,
        arguments: dict[str, Any],
        backend: Backend,
        defaults: dict[str, Any],
    ) -> None:
        self.function = function
        self.stop_flag = threading.Event()
        run_kwargs = {**defaults, **arguments}  # the program's own keywords win
        self.state = function.run(
            stream=True, backend=StoppableBackend(backend, self.stop_flag), **run_kwargs
        )
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._taken: dict[tuple[int, str | None], int] = {}
        threading.Thread(target=self._settle, daemon=True, name="repl-program").start()

    def _settle(self) -> None:
        executor = self.state.executor
        try:
            executor.program_done.wait()
            executor.settle()
        except BaseException as e:
            self.error = e
        finally:
            self._done.set()

    def wait(self, timeout: float) -> bool:
        """Whether the run (its body and every branch) has ended, waiting up to ``timeout``."""
        return self._done.wait(timeout)

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop at the next piece or call; True once everything has ended."""
        self.stop_flag.set()
        return self._done.wait(timeout)

    def new_pieces(self) -> list[ProgramPiece]:
        """Every gen's text that arrived since the last call, in the states' tree order."""
        out = []
        for label, executor in _labelled(self.state.executor):
            for var, chunks in list(executor.stream_chunks.items()):
                key = (id(executor), var)
                taken = self._taken.get(key, 0)
                count = len(chunks)
                if count > taken:
                    text = "".join(piece for piece, _ in chunks[taken:count])
                    self._taken[key] = count
                    if text:
                        out.append(ProgramPiece(label, var or "gen", text))
        return out

    def variables(self) -> dict[Any, Any]:
        """The root state's variables (a fork's gathered as lists)."""
        return {k: v for k, v in self.state.executor.variables.items() if k is not None}


def _labelled(root: Any) -> Iterator[tuple[str, Any]]:
    stack: list[tuple[str, Any]] = [("main", root)]
    while stack:
        label, executor = stack.pop()
        yield label, executor
        prefix = "fork " if label == "main" else f"{label}."
        children = list(executor.children)
        stack.extend((f"{prefix}{i}", c) for i, c in reversed(list(enumerate(children, 1))))


class StoppableBackend(Backend):
    """A program backend that stops when ``stop_flag`` is set: before any call, and between
    a stream's pieces (closing the stream aborts its request)."""

    def __init__(self, inner: Backend, stop_flag: threading.Event) -> None:
        self.inner = inner
        self.stop_flag = stop_flag
        self.is_chat_model = inner.is_chat_model

    def _check(self) -> None:
        if self.stop_flag.is_set():
            raise ProgramStopped("stopped (Ctrl-C)")

    def _stream(self, stream: Iterator[Any]) -> Iterator[Any]:
        try:
            for piece in stream:
                self._check()
                yield piece
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    def get_chat_template(self) -> Any:
        return self.inner.get_chat_template()

    def generate(self, prompt: str, sampling: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._check()
        return self.inner.generate(prompt, sampling)

    def generate_stream(self, prompt: str, sampling: dict[str, Any]) -> Iterator[Any]:
        self._check()
        return self._stream(self.inner.generate_stream(prompt, sampling))

    def generate_chat(self, messages: list[dict[str, Any]], sampling: dict[str, Any]) -> Any:
        self._check()
        return self.inner.generate_chat(messages, sampling)

    def generate_chat_stream(
        self, messages: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> Iterator[Any]:
        self._check()
        return self._stream(self.inner.generate_chat_stream(messages, sampling))

    def select(self, prompt: str, choices: Sequence[str], temperature: float, method: Any) -> Any:
        self._check()
        return self.inner.select(prompt, choices, temperature, method)

    def cache_prefix(self, prompt: str, wait: bool = False) -> None:
        self._check()
        self.inner.cache_prefix(prompt, wait)

    def flush_cache(self) -> bool:
        return self.inner.flush_cache()


def trace(function: Function, arguments: dict[str, Any], backend: Backend | None) -> Any:
    """The program's call graph (arguments not given stay symbolic)."""
    check_arguments(function, arguments, tracing=True)
    return function.trace(backend=backend, **arguments)
