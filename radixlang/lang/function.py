"""``@function``: a Python function over a program state, run on a backend.

``f.run(**args)`` runs it once (returning its :class:`ProgramState` when all its generation has
finished, or at once with ``stream=True``); ``f.run_batch([...])`` runs many concurrently after
pre-caching the prompt prefix they all share; ``await f.run_async(...)`` runs it from an event
loop (``async def`` programs too); ``f.trace()`` records its call graph and ``f.compile()``
replays that graph without re-running the Python. Inside a program, ``g(s, ...)`` runs program
``g``'s body on the same state.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any

from radixlang.lang.backends.base import Backend
from radixlang.lang.interpreter import StateExecutor, start_program_thread
from radixlang.lang.ir import SamplingDefaults
from radixlang.lang.run_graph import report_run, start_recording
from radixlang.lang.run_options import get_default_backend, resolve_backend, split_run_kwargs
from radixlang.lang.state import ProgramState
from radixlang.lang.streamed_runs import StreamedRun

if TYPE_CHECKING:
    from radixlang.lang.graph import CallGraph
    from radixlang.lang.tracer import CompiledFunction


def end_retention(executor: StateExecutor) -> None:
    """The run is over (settled, or failed): the paths its tool calls kept cached for it can
    go. Never waits: a failed run's states may still be stopping."""
    executor.backend.release_program(executor.routing_key)


class Function:
    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None):
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"program {func.__name__} must take the state as its first argument")
        self.arg_names = [p.name for p in params[1:]]
        self.is_async = inspect.iscoroutinefunction(func)
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def __repr__(self) -> str:
        return f"<radixlang function {self.__name__}>"

    def bind(self, **kwargs: Any) -> Function:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.__name__} has no arguments {sorted(unknown)}")
        return Function(self.func, {**self.bind_arguments, **kwargs})

    def _arguments(self, state: Any, args: tuple, kwargs: dict[str, Any]) -> inspect.BoundArguments:
        try:
            merged = {**self.bind_arguments, **kwargs}
            return inspect.signature(self.func).bind(state, *args, **merged)
        except TypeError as e:
            raise TypeError(f"{self.__name__}: {e}") from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Inside a program, ``g(s, ...)`` runs ``g``'s body on state ``s``; otherwise it is
        ``g.run(...)``."""
        if args and isinstance(args[0], ProgramState):
            state = args[0]
            bound = self._arguments(state, args[1:], kwargs)
            state.executor.enter_call(self.__name__)
            try:
                return self.func(*bound.args, **bound.kwargs)
            finally:
                state.executor.exit_call(self.__name__)
        return self.run(*args, **kwargs)

    # ---- running -------------------------------------------------------------------------------
    def _new_state(self, backend: Backend | None, defaults: SamplingDefaults, stream: bool):
        executor = StateExecutor(resolve_backend(backend), defaults, stream)
        start_recording(executor, self.__name__)
        return ProgramState(executor)

    def run(self, *args: Any, stream: bool = False, backend: Backend | None = None, **kwargs: Any):
        defaults, kwargs = split_run_kwargs(kwargs, self.arg_names)
        state = self._new_state(backend, defaults, stream)
        bound = self._arguments(state, args, kwargs)
        body: Callable[[], Any] = lambda: self.func(*bound.args, **bound.kwargs)  # noqa: E731
        if self.is_async:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:
                raise RuntimeError(
                    f"{self.__name__} is an async program and an event loop is running here: "
                    "use `await f.run_async(...)`"
                )
            body = lambda: asyncio.run(self.func(*bound.args, **bound.kwargs))  # noqa: E731
        if stream:
            # Held by the state: a failure nobody reads is reported when the state goes, or at
            # exit (streamed_runs.py).
            state.streamed_run = StreamedRun(state.executor)
            name = f"radixlang-program:{self.__name__}"
            start_program_thread(_finish, state, body, False, state.streamed_run, name=name)
            return state
        return _finish(state, body, wait=True)

    async def run_async(
        self, *args: Any, backend: Backend | None = None, **kwargs: Any
    ) -> ProgramState:
        """Run from an event loop: ``async def`` programs run on this loop (their ``await
        s.aget(...)`` never blocks it); plain programs run on a worker thread."""
        if not self.is_async:
            return await asyncio.to_thread(self.run, *args, backend=backend, **kwargs)
        defaults, kwargs = split_run_kwargs(kwargs, self.arg_names)
        state = self._new_state(backend, defaults, False)
        bound = self._arguments(state, args, kwargs)
        failure: BaseException | None = None
        try:
            try:
                state.ret_value = await self.func(*bound.args, **bound.kwargs)
            except BaseException as e:
                failure = e
                raise
            finally:
                state.executor.end_program()
            await state
        finally:
            if state.executor.recorder is not None:
                await asyncio.to_thread(report_run, state.executor, failure)
            await asyncio.to_thread(end_retention, state.executor)
        return state

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        backend: Backend | None = None,
        precache: bool = True,
        **kwargs: Any,
    ) -> list[ProgramState]:
        """Run the program once per item (a dict of arguments, or a list of positional ones),
        concurrently, so the engine batches them. The prompt prefix every item shares (found by
        tracing each item up to its first generation) is computed once, first."""
        backend = resolve_backend(backend)
        items = [
            dict(item) if isinstance(item, dict) else dict(zip(self.arg_names, item, strict=False))
            for item in batch_kwargs
        ]
        if not items:
            return []
        if precache and len(items) > 1:
            from radixlang.lang.tracer import shared_prompt_prefix

            prefix = shared_prompt_prefix(self, items, backend)
            if prefix:
                backend.cache_prefix(prefix, wait=True)
        workers = min(len(items), 128) if num_threads == "auto" else int(num_threads)
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(items), desc=self.__name__)
        states: list[ProgramState | None] = [None] * len(items)
        errors: list[BaseException] = []
        with ThreadPoolExecutor(max(1, workers)) as pool:
            futures = {
                pool.submit(self.run, backend=backend, **kwargs, **item): i
                for i, item in enumerate(items)
            }
            for future in as_completed(futures):
                try:
                    states[futures[future]] = future.result()
                except BaseException as e:
                    errors.append(e)
                if bar is not None:
                    bar.update()
        if bar is not None:
            bar.close()
        if errors:
            raise errors[0]
        return states  # type: ignore[return-value]

    # ---- tracing -------------------------------------------------------------------------------
    def trace(self, *, backend: Backend | None = None, **kwargs: Any) -> CallGraph:
        """The program's call graph; arguments not given are symbolic."""
        from radixlang.lang.tracer import trace_program

        return trace_program(self, kwargs, backend or get_default_backend())

    def compile(self, *, backend: Backend | None = None) -> CompiledFunction:
        from radixlang.lang.tracer import CompiledFunction

        return CompiledFunction(self, backend)


def _finish(
    state: ProgramState,
    body: Callable[[], Any],
    wait: bool = False,
    streamed: StreamedRun | None = None,
) -> ProgramState:
    """Run the program body on ``state``; with ``wait``, wait for its generation and raise what
    failed (the body's own exception first). A reporting backend then gets the run's graph.
    A ``streamed`` run ends once every state of the run has settled."""
    failure: BaseException | None = None
    try:
        try:
            state.ret_value = body()
        except BaseException as e:
            failure = e
            if wait:
                raise
            # A streamed run has no caller to raise to: the state carries the error.
            if state.executor.error is None:
                state.executor.error = e
        finally:
            state.executor.end_program()
        if wait:
            state.executor.settle()
    finally:
        report_run(state.executor, failure)
        if wait:
            end_retention(state.executor)
    if streamed is not None:
        state.executor.sync_all()
        end_retention(state.executor)
        streamed.end(failure)
    return state


def function(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Decorator: ``@function`` or ``@function()`` (SGLang's ``num_api_spec_tokens`` accepted)."""
    unknown = set(options) - {"num_api_spec_tokens"}
    if unknown:
        raise TypeError(f"function() got unexpected options {sorted(unknown)}")
    if func is not None:
        return Function(func)
    return Function
