"""What a program sees as ``s``: its text, messages and variables, and how to branch it.

``ProgramState`` wraps a :class:`~radixlang.lang.interpreter.StateExecutor`; ``fork(n)`` makes a
``ProgramStateGroup`` of states that start from the same text and run concurrently, and
``join()`` brings their results back (new variables as lists, or their text appended).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from radixlang.lang.interpreter import StateExecutor
from radixlang.lang.ir import Expr, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd

if TYPE_CHECKING:
    from radixlang.lang.streamed_runs import StreamedRun


class ProgramState:
    def __init__(self, executor: StateExecutor) -> None:
        self.executor = executor
        self.ret_value: Any = None
        # run(stream=True)'s: reports the run's failure if nobody reads it (streamed_runs.py).
        self.streamed_run: StreamedRun | None = None

    # SGLang's name for the executor.
    @property
    def stream_executor(self) -> StateExecutor:
        return self.executor

    def __iadd__(self, other: object) -> ProgramState:
        self.executor.submit(other)
        return self

    def __getitem__(self, name: str) -> Any:
        return self.executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.assign(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.executor.variables

    def get_var(self, name: str) -> Any:
        return self.executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.executor.assign(name, value)

    async def aget(self, name: str) -> Any:
        """``s[name]`` for async programs: waits without blocking the event loop."""
        return await self.executor.get_var_async(name)

    def __await__(self):
        """``await s``: wait (without blocking the loop) until all submitted work has run."""
        return self._settle().__await__()

    async def _settle(self) -> ProgramState:
        await self.executor.settle_async()
        return self

    def tool_calls(self, name: str) -> list[Any]:
        r"""The tool calls gen ``name`` wrote (``gen(name, tools=...)``), as
        :class:`~radixlang.lang.tools.ToolCall`\s (name, arguments, id), in order; empty when
        it answered in text. After a join, one list per fork."""
        return self.executor.calls_of(name)

    def tool_results(self, name: str) -> list[Any]:
        r"""What ``run_tools(name)`` gave, as :class:`~radixlang.lang.tools.ToolResult`\s
        (waits until everything submitted so far has run)."""
        self.executor.sync()
        self.executor.raise_error()
        return list(self.executor.tool_results.get(name, []))

    def parsed(self, name: str) -> Any:
        """Variable ``name`` as a value, read by the gen that made it (``s[name]`` is its text):

        - ``gen(json_schema=Model)`` with a pydantic model class: ``Model.model_validate_json``
          of the text, a ``Model`` instance;
        - ``gen(json_schema=...)`` with a dict or JSON text: the ``json.loads`` value, validated
          against the schema;
        - ``gen(dtype=...)``, ``gen_int``, ``gen_string``: the ``int``, ``float``, ``bool`` or
          ``str`` (the string without its quotes);
        - a list of these for a list of outputs (``n`` > 1, or gathered from forked branches).

        Raises :class:`~radixlang.lang.structured.StructuredOutputError` (a ``ValueError``) when
        the output does not parse (e.g. JSON cut off by ``max_tokens``) or when ``name``'s gen has
        neither a schema nor a dtype (a plain, regex, grammar or ebnf gen, a select, a scope):
        there is nothing to parse it by, and its text is ``s[name]``."""
        return self.executor.parsed_var(name)

    def get_meta_info(self, name: str) -> Any:
        self.executor.get_var(name)
        return self.executor.meta_info.get(name)

    def text(self) -> str:
        self.executor.sync()
        return self.executor.text

    def messages(self) -> list[dict[str, Any]]:
        self.executor.sync()
        return list(self.executor.messages)

    def sync(self) -> None:
        self.executor.sync()

    def error(self) -> BaseException | None:
        self.executor.sync()
        if self.executor.error is not None:
            self.executor.error_read = True  # the caller has it: a streamed run reports nothing
        return self.executor.error

    # ---- roles and scopes ------------------------------------------------------------------
    def _role(self, role: str, expr: object | None) -> Any:
        if expr is not None:
            self.executor.submit(RoleBegin(role) + expr + RoleEnd(role))
            return None
        return self._role_scope(role)

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.executor.submit(RoleBegin(role))
        yield
        self.executor.submit(RoleEnd(role))

    def system(self, expr: object | None = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: object | None = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: object | None = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes variable ``name`` too."""
        self.executor.submit(VarScopeBegin(name))
        yield
        self.executor.submit(VarScopeEnd(name))

    # ---- branching -------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be a positive int, got {size!r}")
        states = [ProgramState(e) for e in self.executor.fork(size)]
        return ProgramStateGroup(states, self)

    @contextlib.contextmanager
    def copy(self) -> Iterator[ProgramState]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- streaming -------------------------------------------------------------------------
    def text_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> Iterator[Any]:
        """The text (or variable ``var_name``) piece by piece as it is generated; all at once
        when the program was not run with ``stream=True``.

        ``return_meta_data=True`` (with a ``var_name``) yields ``(piece, meta_info)`` pairs, as
        SGLang's ``text_async_iter`` does: each piece's meta_info has ``prompt_tokens``,
        ``cached_tokens`` and ``completion_tokens`` so far and, when the gen asked for
        log-probabilities (``return_logprob=True``), the piece's own ``output_token_logprobs``
        (``(logprob, token_id, text or None)`` per token) and the running
        ``output_token_logprobs_length``. Tokens that carry no text yet join the next piece's
        meta_info; ones after the last text (e.g. the end-of-text token) are only in
        ``s.get_meta_info(var_name)``, the whole generation's. Without ``stream=True`` there is
        one pair: the value and that whole meta_info."""
        if return_meta_data:
            if var_name is None:
                raise ValueError(
                    "text_iter(return_meta_data=True) needs a var_name: meta_info belongs to one "
                    "gen's output, not to the whole text"
                )
            yield from self._pieces_with_meta(var_name)
            return
        ex = self.executor
        if not ex.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        sent = 0
        while True:
            seen = ex._progress(var_name)
            current = ex.text if var_name is None else ex.variables.get(var_name)
            if isinstance(current, str) and len(current) > sent:
                yield current[sent:]
                sent = len(current)
                continue
            if ex._quiet(var_name):
                current = ex.text if var_name is None else ex.variables.get(var_name)
                if isinstance(current, str) and len(current) > sent:
                    yield current[sent:]
                ex.raise_error()
                return
            ex.wait_change(seen, var_name)

    def _pieces_with_meta(self, name: str) -> Iterator[tuple[Any, dict[str, Any] | None]]:
        ex = self.executor
        if not ex.stream:
            yield self.get_var(name), self.get_meta_info(name)
            return
        from radixlang.lang.backends.base import merge_pieces

        chunks: list[tuple[str, dict[str, Any]]] | None = None
        taken = 0
        text, metas = "", []  # pieces taken but not yet yielded (no text so far)
        while True:
            seen = ex._progress(name)
            quiet = ex._quiet(name)  # read before the chunks: none can come after it is seen
            if chunks is None:
                chunks = ex.stream_chunks.get(name)
            if chunks is not None and len(chunks) > taken:
                new = chunks[taken:]
                taken += len(new)
                text += "".join(piece for piece, _ in new)
                metas += [meta for _, meta in new]
                if text:
                    yield text, merge_pieces(metas)
                    text, metas = "", []
                continue
            if quiet:
                ex.raise_error()
                if chunks is None and name in ex.variables:
                    # Made without streaming (a select, a scope, n > 1): one pair.
                    yield ex.variables[name], ex.meta_info.get(name)
                return
            ex.wait_change(seen, name)

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """:meth:`text_iter` for event loops (it waits without blocking the loop)."""
        import asyncio

        iterator = self.text_iter(var_name, return_meta_data)
        done = object()
        while True:
            piece = await asyncio.to_thread(next, iterator, done)
            if piece is done:
                return
            yield piece  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The states of one ``fork``: ``group += lambda i: ...`` appends to each."""

    def __init__(self, states: list[ProgramState], source: ProgramState) -> None:
        self.states = states
        self.src_state = source

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise ValueError("a fork's states cannot be replaced")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Callable[[int], object] | Sequence[object] | Expr | str):
        if callable(other) and not isinstance(other, Expr):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, list | tuple):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} values for {len(self.states)} forked states")
            for state, value in zip(self.states, other, strict=True):
                state += value
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch. ``gather_variable``: each variable a branch made becomes a list
        in the parent; ``concate_and_append``: the branches' new text is appended in order.

        A variable the parent already holds keeps the parent's value, as in SGLang; when the
        branches assigned that name themselves (their values are then dropped), a
        ``UserWarning`` names it. A warning, not an error: SGLang programs that do this run
        unchanged, and the fix (another name for the branches' variable) is the program's."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"unknown join mode {mode!r}: gather_variable or concate_and_append")
        children = [s.executor for s in self.states]
        self.src_state.executor.join(children, mode)

    async def ajoin(self, mode: str = "gather_variable") -> None:
        for state in self.states:
            await state
        self.join(mode)
