"""Tracing: run a program's Python once without a model, recording what it appends.

The tracer's state is an ordinary :class:`ProgramState` over a :class:`TracingExecutor`, so
roles, forks, joins, var scopes and nested calls behave as in a real run; generation is not
done but recorded. Arguments left out and generated values are *symbolic strings*: ``str``s
holding a marker, so ``"Q: " + question`` and ``f"{s['answer']}"`` still work and the tracer
sees where each value flows (a ``data`` edge). Python that inspects a generated value (``if
s["x"] == ...``, ``int(s["n"])``) cannot be traced, and says so.

The recording serves three uses:

- :func:`trace_program` returns the :class:`~radixlang.lang.graph.CallGraph`;
- :class:`CompiledFunction` replays it on real states (forks included) without re-running
  the Python, substituting the arguments and generated values;
- :func:`shared_prompt_prefix` traces each ``run_batch`` item up to its first generation and
  returns the prompt text they all share, which ``run_batch`` caches once before the items run.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass
from typing import Any

from radixlang.lang.backends.base import Backend
from radixlang.lang.chat_template import PLAIN
from radixlang.lang.graph import CallGraph, _short
from radixlang.lang.interpreter import StateExecutor
from radixlang.lang.ir import (
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    RunTools,
    SamplingDefaults,
    Select,
    Text,
    Variable,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
)
from radixlang.lang.run_graph import report_run, start_recording
from radixlang.lang.run_options import resolve_backend, split_run_kwargs
from radixlang.lang.state import ProgramState

_MARK = "\x1f"
_MARKER = re.compile(_MARK + r"(arg|var):(\d+):([^" + _MARK + r"]*)" + _MARK)


class TracingError(RuntimeError):
    """The program cannot be traced (its Python depends on a generated value)."""


class Symbolic(str):
    """A value unknown at trace time: a string holding its marker."""

    def __int__(self) -> int:
        raise TracingError(_unknown(self))

    def __float__(self) -> float:
        raise TracingError(_unknown(self))

    def __bool__(self) -> bool:
        raise TracingError(_unknown(self))

    def __eq__(self, other: object) -> bool:
        raise TracingError(_unknown(self))

    __hash__ = str.__hash__


def _unknown(value: str) -> str:
    m = _MARKER.search(value)
    what = f"{m.group(1)} {m.group(3)!r}" if m else "a symbolic value"
    return (
        f"the program's Python inspects {what}, which is unknown when tracing: trace() and "
        "compile() need control flow that does not depend on generated values or omitted "
        "arguments (pass the argument, or run the program instead)"
    )


def _arg_marker(name: str) -> Symbolic:
    return Symbolic(f"{_MARK}arg:0:{name}{_MARK}")


def _var_marker(chain: int, name: str | None) -> Symbolic:
    return Symbolic(f"{_MARK}var:{chain}:{name or ''}{_MARK}")


class _FirstCall(Exception):
    """Raised in prefix mode at the program's first generation: carries its prompt."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt


@dataclass
class _Op:
    kind: str  # append | fork | join
    chain: int
    expr: Expr | None = None
    children: tuple[int, ...] = ()
    mode: str = ""


class _Recording:
    """What one trace saw: the graph and the ops to replay, shared by all its chains."""

    def __init__(self, name: str, prefix_mode: bool) -> None:
        self.graph = CallGraph(name)
        self.ops: list[_Op] = []
        self.prefix_mode = prefix_mode
        self.chains = itertools.count()
        self.var_nodes: dict[tuple[int, str | None], int] = {}  # (chain, var) -> producing node


class TracingExecutor(StateExecutor):
    def __init__(self, recording: _Recording, chain: int, backend: Backend | None) -> None:
        template = backend.get_chat_template() if backend is not None else PLAIN
        super().__init__(backend, SamplingDefaults(), chat_template=template)  # type: ignore[arg-type]
        self.recording = recording
        self.chain = chain
        self.last: int | None = None  # the chain's latest node
        self.edge_kind = "prefix"  # how the next node follows it ("fork" right after a fork)

    # Everything runs at once, on the program's thread: there is no model to wait for.
    def submit(self, value: object) -> None:
        expr = as_expr(value)
        self.recording.ops.append(_Op("append", self.chain, expr))
        self._trace(expr)

    def sync(self) -> None:
        pass

    async def sync_async(self) -> None:
        pass

    def get_var(self, name: str | None) -> Any:
        if name not in self.variables:
            raise KeyError(f"no variable {name!r} in this program state")
        value = self.variables[name]
        if isinstance(value, int) and not isinstance(value, bool):
            raise TracingError(f"var_scope {name!r} is read before it ends")
        return value  # a marker (or a list of them, gathered by a join)

    async def get_var_async(self, name: str | None) -> Any:
        return self.get_var(name)

    def parsed_var(self, name: str | None) -> Any:
        self.get_var(name)
        raise TracingError(
            f"the program's Python parses variable {name!r} (s.parsed), which is unknown when "
            "tracing: trace() and compile() need control flow that does not depend on generated "
            "values (run the program instead)"
        )

    def calls_of(self, name: str | None) -> list[Any]:
        self.get_var(name)
        raise TracingError(
            f"the program's Python reads the tool calls of {name!r} (s.tool_calls), which are "
            "unknown when tracing: trace() and compile() need control flow that does not depend "
            "on generated values (run the program instead: its run graph shows its tool calls)"
        )

    def enter_call(self, name: str) -> None:
        self._node("call", name)

    def exit_call(self, name: str) -> None:
        self._node("return", name)

    def fork(self, size: int) -> list[StateExecutor]:
        node = self._node("fork", f"{size} branches")
        children = []
        for _ in range(size):
            child = TracingExecutor(self.recording, next(self.recording.chains), self.backend)
            child._inherit(self)  # at once: a trace has no queue to wait for
            child.last, child.edge_kind = node.id, "fork"
            children.append(child)
        chains = tuple(c.chain for c in children)
        self.recording.ops.append(_Op("fork", self.chain, children=chains))
        return children

    def join(self, children: list[StateExecutor], mode: str) -> None:
        node = self._node("join", mode)
        chains = tuple(c.chain for c in children)  # type: ignore[attr-defined]
        for child in children:
            if child.last is not None:  # type: ignore[attr-defined]
                self.recording.graph.add_edge(child.last, node.id, "join")  # type: ignore[attr-defined]
        if mode == "gather_variable":
            for chain in chains:
                for var_chain, name in self.recording.var_nodes:
                    if var_chain == chain:
                        self.variables.setdefault(name, [])
                        if isinstance(self.variables[name], list):
                            self.variables[name].append(_var_marker(chain, name))
        else:
            for child in children:
                self.text += child.text[child.fork_start :]
        self.recording.ops.append(_Op("join", self.chain, children=chains, mode=mode))

    # ---- recording -------------------------------------------------------------------------
    def _node(self, kind: str, label: str) -> Any:
        graph = self.recording.graph
        node = graph.add_node(kind, label, self.chain)
        if self.last is not None:
            graph.add_edge(self.last, node.id, self.edge_kind)
        self.last, self.edge_kind = node.id, "prefix"
        return node

    def _data_edges(self, text: str, node_id: int) -> None:
        graph = self.recording.graph
        for kind, chain, name in _MARKER.findall(text):
            if kind == "arg":
                src = graph.arguments.get(name)
                if src is None:
                    src = graph.add_node("argument", name, 0).id
                    graph.arguments[name] = src
            else:
                src = self.recording.var_nodes.get((int(chain), name or None))
            if src is not None:
                graph.add_edge(src, node_id, "data")

    def _trace(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.items:
                self._trace(item)
        elif isinstance(expr, Text):
            node = self._node("text", _display(expr.value))
            self._data_edges(expr.value, node.id)
            self.text += expr.value
        elif isinstance(expr, RoleBegin | RoleEnd):
            begin = isinstance(expr, RoleBegin)
            self._node("role", f"{expr.role} {'begin' if begin else 'end'}")
            if begin:
                self._role_begin(expr.role)
            else:
                self._role_end(expr.role)
        elif isinstance(expr, Gen | Select):
            if self.recording.prefix_mode:
                raise _FirstCall(self.text)
            kind = "gen" if isinstance(expr, Gen) else "select"
            if isinstance(expr, Gen):
                constraint = expr.constraint_kind
                label = (expr.name or "") + (f" [{constraint}]" if constraint else "")
            else:
                label = f"{expr.name} {expr.choices}"
            node = self._node(kind, str(label))
            self.recording.var_nodes[(self.chain, expr.name)] = node.id
            self.variables[expr.name] = _var_marker(self.chain, expr.name)
            self.text += _var_marker(self.chain, expr.name)
        elif isinstance(expr, VarScopeBegin):
            self._node("scope", f"{expr.name} begin")
            self.variables[expr.name] = len(self.text)
        elif isinstance(expr, VarScopeEnd):
            node = self._node("scope", f"{expr.name} end")
            self.recording.var_nodes[(self.chain, expr.name)] = node.id
            self.variables[expr.name] = _var_marker(self.chain, expr.name)
        elif isinstance(expr, Variable):
            self._node("text", f"${expr.name}")
            self.text += _var_marker(self.chain, expr.name)
        elif isinstance(expr, RunTools):  # the tool turns' text is known only when they run
            node = self._node("tool", f"run_tools({expr.name})")
            source = self.recording.var_nodes.get((self.chain, expr.name))
            if source is not None:
                self.recording.graph.add_edge(source, node.id, "data")
        else:
            raise TracingError(f"cannot trace {expr!r}")


def _display(text: str) -> str:
    return _short(_MARKER.sub(lambda m: "{" + m.group(3) + "}", text))


def _new_state(recording: _Recording, backend: Backend | None) -> ProgramState:
    return ProgramState(TracingExecutor(recording, next(recording.chains), backend))


# ``function`` below is a radixlang ``Function``; this module does not import it, because
# function.py imports this one (trace, compile and run_batch's pre-caching live here).
def _call(function: Any, state: ProgramState, arguments: dict[str, Any]) -> None:
    import asyncio

    bound = function._arguments(state, (), arguments)
    result = function.func(*bound.args, **bound.kwargs)
    if asyncio.iscoroutine(result):
        asyncio.run(result)


def _record(
    function: Any, arguments: dict[str, Any], backend: Backend | None, prefix_mode: bool
) -> _Recording:
    recording = _Recording(function.__name__, prefix_mode)
    state = _new_state(recording, backend)
    args = {**function.bind_arguments, **arguments}
    for name in function.arg_names:
        if name not in args:
            args[name] = _arg_marker(name)
    _call(function, state, args)
    return recording


def trace_program(function: Any, arguments: dict[str, Any], backend: Backend | None) -> CallGraph:
    """The call graph of ``function``; arguments not in ``arguments`` stay symbolic."""
    try:
        return _record(function, arguments, backend, prefix_mode=False).graph
    except TracingError:
        raise
    except Exception as e:
        raise TracingError(f"tracing {function.__name__} failed: {e!r}") from e


def shared_prompt_prefix(function: Any, items: list[dict[str, Any]], backend: Backend) -> str:
    """The prompt text that every item's first generation call starts with ('' if none)."""
    prompts = []
    for item in items:
        try:
            _record(function, item, backend, prefix_mode=True)
        except _FirstCall as first:
            prompts.append(first.prompt)
        except Exception:  # programs whose Python cannot be traced: no pre-caching
            return ""
        else:
            return ""  # an item generates nothing
    prefix = os.path.commonprefix(prompts)  # noqa: RUF071  (character-wise on purpose)
    if any(len(p) > len(prefix) for p in prompts):
        # Stop before the last whitespace: the items' text goes on, and a cut inside a word (or
        # after a space that BPE joins to the next word) would end in a token their own prompts
        # do not have.
        cut = max(prefix.rfind(c) for c in " \n")
        prefix = prefix[:cut] if cut >= 0 else ""
    return "" if _MARK in prefix else prefix


class CompiledFunction:
    """A program traced once (every argument symbolic) and replayed on real states.

    ``run(**args)`` performs the recorded appends, forks and joins in order, with arguments
    and generated values substituted, so no Python of the program runs again; the states'
    workers run branches concurrently as in an eager run."""

    def __init__(self, function: Any, backend: Backend | None = None) -> None:
        self.function = function
        self.backend = backend
        try:
            self.recording = _record(function, {}, backend, prefix_mode=False)
        except TracingError:
            raise
        except Exception as e:
            raise TracingError(f"compiling {function.__name__} failed: {e!r}") from e

    @property
    def graph(self) -> CallGraph:
        return self.recording.graph

    def run(self, *, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        defaults, arguments = split_run_kwargs(kwargs, self.function.arg_names)
        unknown = set(arguments) - set(self.function.arg_names)
        if unknown:
            raise TypeError(f"{self.function.__name__} has no arguments {sorted(unknown)}")
        arguments = {**self.function.bind_arguments, **arguments}
        missing = set(self.function.arg_names) - set(arguments)
        if missing:
            raise TypeError(f"{self.function.__name__} is missing arguments {sorted(missing)}")
        backend = resolve_backend(backend or self.backend)
        root = ProgramState(StateExecutor(backend, defaults))
        start_recording(root.executor, self.function.__name__)
        states: dict[int, ProgramState] = {0: root}
        groups: dict[tuple[int, ...], Any] = {}
        try:
            for op in self.recording.ops:
                state = states[op.chain]
                if op.kind == "append":
                    state += self._bind(op.expr, arguments, states)
                elif op.kind == "fork":
                    group = state.fork(len(op.children))
                    groups[op.children] = group
                    states.update(zip(op.children, group.states, strict=True))
                else:
                    groups[op.children].join(op.mode)
            root.executor.end_program()
            root.executor.settle()
        finally:
            report_run(root.executor)
        return root

    def run_batch(self, batch_kwargs: list[dict[str, Any]], **kwargs: Any) -> list[ProgramState]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(len(batch_kwargs), 128) or 1) as pool:
            return list(pool.map(lambda item: self.run(**kwargs, **item), batch_kwargs))

    def _bind(self, expr: Expr | None, arguments: dict[str, Any], states: dict) -> Expr:
        if isinstance(expr, ExprList):
            return ExprList([self._bind(e, arguments, states) for e in expr.items])
        if not isinstance(expr, Text) or _MARK not in expr.value:
            return expr  # type: ignore[return-value]
        parts: list[Expr] = []
        pos = 0
        for m in _MARKER.finditer(expr.value):
            if m.start() > pos:
                parts.append(Text(expr.value[pos : m.start()]))
            kind, chain, name = m.groups()
            if kind == "arg":
                parts.append(Text(str(arguments[name])))
            else:
                parts.append(Variable(name or None, states[int(chain)].executor))  # type: ignore[arg-type]
            pos = m.end()
        if pos < len(expr.value):
            parts.append(Text(expr.value[pos:]))
        return ExprList(parts)
