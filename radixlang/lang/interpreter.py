"""Executes a program state's expressions on a backend, in order, off the program's thread.

``s += gen(...)`` returns at once: the expression joins the state's queue and a worker thread
runs it (one at a time per state, in submission order). The program only waits when it reads a
value (``s["x"]``), so forked branches run at the same time and reach the engine together,
where they are batched. A failure stops the state: every waiter wakes and raises it, the next
``s += ...`` raises it, and ``run()`` raises it to its caller.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NoReturn

from radixlang.config import TOOL_CALL_RETAIN_S
from radixlang.constrain.reasoning import split_reasoning
from radixlang.constrain.tool_calls import (
    call_grammar,
    format_calls,
    parse_calls,
    parse_output,
    tools_prompt,
)
from radixlang.constrain.tool_formats import ToolFormat
from radixlang.lang.backends.base import Backend, StreamMeta
from radixlang.lang.chat_template import ChatTemplate
from radixlang.lang.ir import (
    ConcatenateAndAppend,
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
from radixlang.lang.routing import in_scope, new_program_key, routing_scope
from radixlang.lang.tools import ToolCall, ToolResult, new_call_id, run_tool_calls

if TYPE_CHECKING:
    from radixlang.lang.run_graph import RunRecorder


class ProgramError(RuntimeError):
    """A program's expression could not run (e.g. nested roles)."""


# The programs' own threads (state workers, streamed runs' bodies): daemon threads, so a
# program left running never holds the process open; joined at exit by ``join_program_threads``.
_program_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def start_program_thread(target: Any, *args: Any, name: str = "radixlang-state") -> None:
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    _program_threads.add(thread)
    thread.start()


def join_program_threads(timeout: float) -> None:
    """Wait up to ``timeout`` seconds in all for the programs' threads to end (at exit, once
    the engines are shut down: their requests then end at once and their states fail)."""
    deadline = time.monotonic() + timeout
    for thread in list(_program_threads):
        if thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


class Signal:
    """A one-shot event that threads wait on and event loops await."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def set(self) -> None:
        with self._lock:
            self._event.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    async def wait_async(self) -> None:
        if self._event.is_set():
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._event.is_set():
                return
            self._waiters.append((loop, future))
        await future


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set() -> Signal:
    signal = Signal()
    signal.set()
    return signal


class StateExecutor:
    def __init__(
        self,
        backend: Backend,
        defaults: SamplingDefaults,
        stream: bool = False,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.chat_template = chat_template or backend.get_chat_template()
        self.text = ""
        self.messages: list[dict[str, Any]] = []
        self.variables: dict[str | None, Any] = {}
        self.meta_info: dict[str | None, Any] = {}
        # The gen that made each variable (what s.parsed reads it by).
        self.gens: dict[str | None, Gen] = {}
        # A streamed gen's pieces: (text, chunk meta_info), appended as they come.
        self.stream_chunks: dict[str | None, list[tuple[str, dict[str, Any]]]] = {}
        self.cur_role: str | None = None
        self.cur_role_begin = 0
        self.cur_role_attrs: dict[str, Any] = {}  # a tool turn's call id and tool name
        # Tools: the calls each tools gen wrote, what run_tools gave for them, the calls of the
        # open assistant turn (its message's tool_calls), the tool descriptions the system
        # message shows, and where the system message's content ends in the text.
        self.tool_calls: dict[str | None, Any] = {}
        self.tool_results: dict[str | None, list[ToolResult]] = {}
        self.turn_calls: list[ToolCall] = []
        self.shown_tools: set[str] = set()
        self.system_end: int | None = None
        self.fork_start: int | None = None
        self.error: BaseException | None = None
        # The error was raised outside the programs' threads (to a reader of the state or its
        # stream): a streamed run reports a failure nobody read (streamed_runs.py).
        self.error_read = False
        self.program_done = Signal()  # the program body returned (streamed runs)
        self._signals: dict[str | None, Signal] = {}
        self._failed: set[str | None] = set()  # variables that an error left without a value
        self.children: list[StateExecutor] = []  # forked states, joined or not
        self.inherited_vars: set[str | None] = set()  # a fork's variables from its parent
        self.made_vars: set[str | None] = set()  # variables this state assigned itself
        self._inherited = _set()  # a fork's: set once it holds its parent's state
        self._queue: collections.deque[Expr] = collections.deque()
        self._cond = threading.Condition()  # guards the queue; notified when anything changes
        self._idle = _set()  # set while no expression is queued or running
        # The run's call graph, when the backend reports programs (run_graph.py): this state is
        # one chain of it.
        self.recorder: RunRecorder | None = None
        self.chain = 0
        self._call_nodes: dict[str | None, int] = {}  # a gen/select's variable -> its node
        # What a multi-replica server routes this program's requests by (forks share it).
        self.routing_key = new_program_key()

    # ---- the program's side --------------------------------------------------------------
    def submit(self, value: object) -> None:
        expr = as_expr(value)
        if self.error is not None:
            self._raise_error()
        self._declare(expr)
        with self._cond:
            self._queue.append(expr)
            if self._idle.is_set():
                self._idle = Signal()
                start_program_thread(self._work)

    def sync(self) -> None:
        """Wait until everything submitted so far has run."""
        self._idle.wait()

    async def sync_async(self) -> None:
        await self._idle.wait_async()

    def settle(self) -> None:
        """Wait for this state and every state forked from it, then raise the first error
        among them (this state's first)."""
        self.sync_all()
        for ex in self._tree():
            ex.raise_error()

    def sync_all(self) -> None:
        """Wait for this state and every state forked from it."""
        for ex in self._tree():
            ex.sync()

    async def settle_async(self) -> None:
        for ex in self._tree():
            await ex.sync_async()
        for ex in self._tree():
            ex.raise_error()

    def _tree(self) -> list[StateExecutor]:
        out, stack = [], [self]
        while stack:
            ex = stack.pop()
            out.append(ex)
            stack.extend(reversed(ex.children))
        return out

    def raise_error(self) -> None:
        if self.error is not None:
            self._raise_error()

    def _raise_error(self) -> NoReturn:
        if threading.current_thread() not in _program_threads:
            self.error_read = True
        raise self.error  # type: ignore[misc]

    def unread_failure(self, program_error: BaseException | None) -> BaseException | None:
        """A run's failure that was never raised outside the programs' threads: the program's
        own exception (``program_error``), else the first error among this state and its
        forks (what ``settle`` raises); None if there is none or a reader got it."""
        tree = self._tree()
        error = program_error or next((ex.error for ex in tree if ex.error is not None), None)
        if error is None or any(ex.error is error and ex.error_read for ex in tree):
            return None
        return error

    def get_var(self, name: str | None) -> Any:
        self._inherited.wait()
        signal = self._signals.get(name)
        if signal is not None:
            signal.wait()
        return self._value(name)

    async def get_var_async(self, name: str | None) -> Any:
        await self._inherited.wait_async()
        signal = self._signals.get(name)
        if signal is not None:
            await signal.wait_async()
        return self._value(name)

    def parsed_var(self, name: str | None) -> Any:
        """Variable ``name`` read by the gen that made it (see ``ProgramState.parsed``)."""
        from radixlang.lang.structured import StructuredOutputError, parse_output

        value = self.get_var(name)
        gen = self.gens.get(name)
        if gen is None:
            raise StructuredOutputError(
                f"s.parsed({name!r}): {name!r} was not made by a gen (a select or var_scope "
                f"holds plain text): read s[{name!r}]"
            )
        return parse_output(name, gen, value)

    def calls_of(self, name: str | None) -> list[Any]:
        """The tool calls gen ``name`` wrote (``ProgramState.tool_calls``)."""
        self.get_var(name)
        return list(self.tool_calls.get(name, []))

    def _value(self, name: str | None) -> Any:
        if name in self._failed:
            self._raise_error()
        if name in self.variables:
            return self.variables[name]
        if self.error is not None:
            self._raise_error()
        raise KeyError(f"no variable {name!r} in this program state")

    def fork(self, size: int) -> list[StateExecutor]:
        """``size`` states that start from this one's state once everything submitted so far
        has run. Returns at once: a program can fork a whole tree level without waiting, and
        each branch's own expressions queue until its parent reaches the fork point."""
        self.raise_error()
        children = []
        for _ in range(size):
            child = StateExecutor(self.backend, self.defaults, self.stream, self.chat_template)
            child._idle = Signal()  # busy until it inherits the parent's state
            child._inherited = Signal()
            child.routing_key = self.routing_key
            if self.recorder is not None:
                child.recorder, child.chain = self.recorder, self.recorder.new_chain()
            children.append(child)
        self.children.extend(children)
        try:
            self.submit(_ForkPoint(children))
        except BaseException as e:  # this state failed meanwhile: so do the branches
            for child in children:
                child._fail(e)
                child._resume()
            raise
        return children

    def _inherit(self, parent: StateExecutor) -> None:
        """Take ``parent``'s state at the fork point (on the parent's worker), then run what the
        program already queued here."""
        self.text = parent.text
        self.messages = list(parent.messages)
        self.variables = dict(parent.variables)
        self.meta_info = dict(parent.meta_info)
        self.gens = dict(parent.gens)
        self.inherited_vars = set(parent.variables)
        self.cur_role = parent.cur_role
        self.cur_role_begin = parent.cur_role_begin
        self.cur_role_attrs = parent.cur_role_attrs
        self.tool_calls = dict(parent.tool_calls)
        self.tool_results = dict(parent.tool_results)
        self.turn_calls = list(parent.turn_calls)
        self.shown_tools = set(parent.shown_tools)
        self.system_end = parent.system_end
        self.fork_start = len(parent.text)
        self._resume()

    def _resume(self) -> None:
        self._inherited.set()
        with self._cond:
            if self._queue or self.error is not None:
                start_program_thread(self._work)
            else:
                self._idle.set()
                self._cond.notify_all()

    def _fail_forks(self, error: BaseException, pending: list[Expr]) -> None:
        """The parent failed before these fork points: their branches fail with its error."""
        for expr in pending:
            if isinstance(expr, _ForkPoint):
                for child in expr.children:
                    if not child._inherited.is_set():
                        child._fail(error)
                        child._resume()

    def _fail(self, error: BaseException) -> None:
        """Stop this state: waiters on values it has not made wake and raise ``error``."""
        self.error = error
        for name, signal in list(self._signals.items()):
            if not signal.is_set():
                self._failed.add(name)
                signal.set()

    def join(self, children: list[StateExecutor], mode: str) -> None:
        """Wait for forked ``children`` and bring their results back (see ``ProgramStateGroup``):
        a variable a child made (one it did not inherit) becomes a list here.

        A variable this state holds is never replaced (SGLang's rule). Where a child assigned a
        variable of that name itself, its value would vanish without a trace, so each such name
        gets a ``UserWarning``; a child that only inherited the variable is no news."""
        for child in children:
            child.sync()
            child.raise_error()
        if mode == "concate_and_append":
            self.submit(ConcatenateAndAppend(children))
            self.sync()
            self.raise_error()
            return
        self.sync()
        if self.recorder is not None:
            self.recorder.join(self.chain, [c.chain for c in children], mode)
        gathered: dict[str | None, list[Any]] = {}
        metas: dict[str | None, list[Any]] = {}
        gens: dict[str | None, Gen] = {}
        shadowed: set[str | None] = set()
        for child in children:
            for name, value in child.variables.items():
                if name in self.variables:
                    if name in child.made_vars:
                        shadowed.add(name)
                elif name not in child.inherited_vars:
                    gathered.setdefault(name, []).append(value)
                    metas.setdefault(name, []).append(child.meta_info.get(name))
                    if name in child.gens:
                        gens[name] = child.gens[name]
        for name in sorted(shadowed, key=str):
            warnings.warn(
                f"join() dropped the forks' values of variable {name!r}: the state already "
                f"holds {name!r}, and a join never replaces a variable the state holds (as in "
                f"SGLang). Give the forks' variable another name to gather their values",
                UserWarning,
                stacklevel=3,  # the program's forks.join()
            )
        for name in gathered:  # a tools gen's calls and results: one list per fork
            for mine, theirs in (
                (self.tool_calls, "tool_calls"),
                (self.tool_results, "tool_results"),
            ):
                lists = [getattr(c, theirs)[name] for c in children if name in getattr(c, theirs)]
                if lists:
                    mine[name] = lists
        for name, values in gathered.items():
            if name in gens:
                self.gens[name] = gens[name]
            else:
                self.gens.pop(name, None)
            self._set_var(name, values, metas[name])

    def end_program(self) -> None:
        """The program body returned: nothing more will be submitted (streams may end)."""
        self.program_done.set()
        self._changed()

    def enter_call(self, name: str) -> None:
        """A nested program call begins on this state (the tracer records it)."""

    def exit_call(self, name: str) -> None:
        """A nested program call ends."""

    # ---- streaming ---------------------------------------------------------------------------
    def wait_change(self, seen: tuple[int, int], name: str | None) -> None:
        """Block until the text or ``name``'s value grew past ``seen`` or nothing more comes."""
        with self._cond:
            self._cond.wait_for(lambda: self._progress(name) != seen or self._quiet(name), 1.0)

    def _progress(self, name: str | None) -> tuple[int, int]:
        value = self.variables.get(name)
        return len(self.text), len(value) if isinstance(value, str) else 0

    def _quiet(self, name: str | None) -> bool:
        if self.error is not None:
            return True
        if name is None:
            return self.program_done.is_set() and self._idle.is_set()
        signal = self._signals.get(name)
        if signal is None:
            return self.program_done.is_set() and self._idle.is_set()
        return signal.is_set()

    def _changed(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---- the worker --------------------------------------------------------------------------
    def _declare(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.items:
                self._declare(item)
        elif isinstance(expr, Gen | Select | VarScopeBegin):
            self._signals[expr.name] = Signal()

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue or self.error is not None:
                    if self._queue:
                        self._fail_forks(self.error, list(self._queue))  # type: ignore[arg-type]
                    self._queue.clear()
                    self._idle.set()
                    self._cond.notify_all()
                    return
                expr = self._queue.popleft()
            try:
                with routing_scope(self.routing_key):
                    self._execute(expr)
            except BaseException as e:  # the state stops; waiters wake and raise it
                self._fail(e)
                self._fail_forks(e, [expr])
            self._changed()

    def _execute(self, expr: Expr) -> None:
        if self.recorder is not None and not isinstance(expr, ExprList):
            self._record(expr)
        if isinstance(expr, Text):
            self.text += expr.value
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role, expr.attrs)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, RunTools):
            self._run_tools(expr)
        elif isinstance(expr, VarScopeBegin):
            self.variables[expr.name] = len(self.text)
        elif isinstance(expr, VarScopeEnd):
            start = self.variables.get(expr.name)
            if not isinstance(start, int):
                raise ProgramError(f"var_scope {expr.name!r} ended but never began")
            self.gens.pop(expr.name, None)
            self._set_var(expr.name, self.text[start:], None)
        elif isinstance(expr, Variable):
            self.text += str(expr.source.get_var(expr.name))
        elif isinstance(expr, ConcatenateAndAppend):
            for child in expr.states:
                child.sync()
                child.raise_error()
                self.text += child.text[child.fork_start :]
        elif isinstance(expr, _ForkPoint):
            if len(expr.children) > 1 and self.text:
                # Prefill the shared prefix once; the branches' requests then all hit it. Only
                # a hint: a prompt the backend refuses fails in the branches' own calls.
                with contextlib.suppress(Exception):
                    self.backend.cache_prefix(self.text)
            for child in expr.children:
                child._inherit(self)
        else:
            raise ProgramError(f"cannot execute {expr!r}")

    def _record(self, expr: Expr) -> None:
        """Add ``expr``'s step to the run's graph (before it runs; a call's cache figures are
        attached when its variable is set)."""
        recorder = self.recorder
        assert recorder is not None
        if isinstance(expr, Text):
            recorder.step(self.chain, "text", expr.value)
        elif isinstance(expr, RoleBegin | RoleEnd):
            end = "begin" if isinstance(expr, RoleBegin) else "end"
            recorder.step(self.chain, "role", f"{expr.role} {end}")
        elif isinstance(expr, Gen):
            constraint = expr.constraint_kind
            label = (expr.name or "") + (f" [{constraint}]" if constraint else "")
            self._call_nodes[expr.name] = recorder.step(self.chain, "gen", label)
        elif isinstance(expr, Select):
            label = f"{expr.name} {expr.choices}"
            self._call_nodes[expr.name] = recorder.step(self.chain, "select", label)
        elif isinstance(expr, VarScopeBegin | VarScopeEnd):
            end = "begin" if isinstance(expr, VarScopeBegin) else "end"
            recorder.step(self.chain, "scope", f"{expr.name} {end}")
        elif isinstance(expr, Variable):
            recorder.step(self.chain, "text", f"${expr.name}")
        elif isinstance(expr, ConcatenateAndAppend):
            chains = [child.chain for child in expr.states]
            recorder.join(self.chain, chains, "concate_and_append")
        elif isinstance(expr, _ForkPoint):
            chains = [child.chain for child in expr.children]
            recorder.fork(self.chain, len(chains), chains)

    def assign(self, name: str | None, value: Any) -> None:
        """The program sets a variable itself (``s[name] = value``). A fork first takes its
        parent's state, which would otherwise replace the value."""
        self._inherited.wait()
        self.variables[name] = value
        self.made_vars.add(name)

    def _set_var(self, name: str | None, value: Any, meta: Any) -> None:
        self.variables[name] = value
        self.made_vars.add(name)
        if meta is not None:
            self.meta_info[name] = meta
            node = self._call_nodes.pop(name, None)
            if node is not None and self.recorder is not None:
                self.recorder.counts(node, meta)
        signal = self._signals.get(name)
        if signal is None:
            signal = self._signals[name] = Signal()
        signal.set()

    def _sampling(self, expr: Gen) -> dict[str, Any]:
        sampling = self.defaults.resolve(expr.sampling, self.chat_template.stop_str)
        regex = expr.regex
        if regex is None and expr.dtype is not None:
            from radixlang.constrain.dtypes import dtype_regex

            regex = dtype_regex(expr.dtype)
        if regex is not None:
            sampling["regex"] = regex
        elif expr.json_schema is not None:
            sampling["json_schema"] = expr.json_schema  # its JSON text, as SGLang sends it
        elif expr.grammar is not None:
            sampling["grammar"] = expr.grammar
        elif expr.ebnf is not None:
            sampling["ebnf"] = expr.ebnf
        return sampling

    def _gen(self, expr: Gen) -> None:
        sampling = self._sampling(expr)
        chat = self.backend.is_chat_model
        if expr.calls_tools:
            self._offer_tools(expr, sampling, chat)
        prompt: Any = self.text
        generate, generate_stream = self.backend.generate, self.backend.generate_stream
        if chat:
            self._check_chat_gen(expr)
            prompt = list(self.messages)  # the turns before the open assistant turn
            generate, generate_stream = (
                self.backend.generate_chat,
                self.backend.generate_chat_stream,
            )
        self.gens[expr.name] = expr
        if expr.n > 1:
            with ThreadPoolExecutor(expr.n) as pool:
                calls = [pool.submit(in_scope(generate), prompt, sampling) for _ in range(expr.n)]
                outs = [call.result() for call in calls]
            opened = self._thinking_open()
            self.text += outs[0][0]
            answers = [self._answer(t, m, opened) for t, m in outs]
            self._set_var(expr.name, answers, [m for _, m in outs])
        elif self.stream and not (chat and expr.calls_tools):  # a chat's calls come whole
            chunks: list[tuple[str, dict[str, Any]]] = []
            tracker = StreamMeta()
            meta: dict[str, Any] = {}
            opened = self._thinking_open()
            with self._cond:
                self.stream_chunks[expr.name] = chunks
                self.variables[expr.name] = ""
            for piece, meta in generate_stream(prompt, sampling):
                chunk_meta = tracker.piece(meta)
                with self._cond:
                    self.text += piece
                    self.variables[expr.name] += piece
                    chunks.append((piece, chunk_meta))
                    self._cond.notify_all()
            final = tracker.final(meta)
            answer = self._answer(self.variables[expr.name], final, opened)
            self._take_calls(expr, answer, meta)
            self._set_var(expr.name, answer, final)
        else:
            opened = self._thinking_open()
            text, meta = generate(prompt, sampling)
            # The calls are the answer's; the text keeps the thinking (a chat service's calls,
            # whose models do not think here, come back written as a call block).
            answer = self._take_calls(expr, self._answer(text, meta, opened), meta)
            if not self.backend.thinks:
                text = answer
            self.text += text
            self._set_var(expr.name, answer, meta)

    def _thinking_open(self) -> bool:
        """Whether the text so far ends inside a thinking block (the template opened it)."""
        opening, closing = self.backend.thinking_markers
        return self.backend.thinks and self.text.rfind(opening) > self.text.rfind(closing)

    def _answer(self, text: str, meta: dict[str, Any], opened: bool) -> str:
        """A gen's answer: on a reasoning model, the text after its thinking, the thinking
        going into ``meta["reasoning"]`` (None when it did not think)."""
        if not self.backend.thinks:
            return text
        reasoning, answer = split_reasoning(text, opened, self.backend.thinking_markers)
        meta["reasoning"] = reasoning
        return answer

    # ---- tools -------------------------------------------------------------------------------
    @property
    def tool_format(self) -> ToolFormat:
        """How the model writes tool calls (its chat template's format)."""
        return self.chat_template.tool_format

    def _offer_tools(self, expr: Gen, sampling: dict[str, Any], chat: bool) -> None:
        """Let a gen call its tools: a chat service is sent them (OpenAI's ``tools``); on a
        text backend the system message describes them and a grammar holds the output to a
        reply or valid calls."""
        if chat:
            sampling["tools"] = [t.openai() for t in expr.tools]
            named = expr.tool_mode == "required" and len(expr.tools) < len(expr.shown_tools)
            sampling["tool_choice"] = (
                {"type": "function", "function": {"name": expr.tools[0].name}}
                if named
                else expr.tool_mode
            )
            sampling["parallel_tool_calls"] = expr.parallel_tool_calls
            return
        self._show_tools(expr)
        # The program will be back with this path and the tools' results: keep it cached.
        sampling["retain_s"] = TOOL_CALL_RETAIN_S
        reply_schema = sampling.pop("json_schema", None)
        tools = [(t.name, t.parameters) for t in expr.tools]
        sampling["grammar"] = call_grammar(
            expr.tool_mode, tools, expr.parallel_tool_calls, reply_schema, self.tool_format
        )
        if self.tool_format.special:  # marker tokens are the calls' text: keep them in it
            sampling["skip_special_tokens"] = False

    def _show_tools(self, expr: Gen) -> None:
        """Describe the gen's tools (all it was given, so the text is the same whatever its
        ``tool_choice``) once, at the end of the chat's system message: the prompt's prefix
        then stays the same from step to step of an agent, and across agents with the same
        system prompt and tools. A chat without a system message gets one first; a program
        without roles gets the description as its first paragraph."""
        text = tools_prompt("auto", [t.openai() for t in expr.shown_tools], self.tool_format)
        if text in self.shown_tools or text in self.text:
            return
        self.shown_tools.add(text)
        template = self.chat_template
        if self.system_end is not None:  # after the system message's content
            at, head = self.system_end, "\n\n" if self.messages[0]["content"] else ""
            self._insert(at, at, head + text)
            self.messages[0] = {
                **self.messages[0],
                "content": self.messages[0]["content"] + head + text,
            }
            return
        first = self.messages[0]["role"] if self.messages else self.cur_role
        if first is None:  # no roles: a first paragraph
            self._insert(0, 0, text + "\n\n")
            return
        prefix, suffix = template.get_prefix_and_suffix("system", [])
        opening = template.first_prefix.get(first)
        replaced = len(opening) if opening and self.text.startswith(opening) else 0
        after = template.prefix[first] if replaced else ""
        self._insert(0, replaced, prefix + text + suffix + after)
        self.system_end = len(prefix) + len(text)
        self.messages.insert(0, {"role": "system", "content": text})

    def _insert(self, start: int, end: int, new: str) -> None:
        """Replace ``text[start:end]`` with ``new``, moving the positions that lie after it."""
        shift = len(new) - (end - start)
        self.text = self.text[:start] + new + self.text[end:]
        if self.system_end is not None and self.system_end >= end:
            self.system_end += shift
        if self.cur_role is not None and self.cur_role_begin >= end:
            self.cur_role_begin += shift
        if self.fork_start is not None and self.fork_start >= end:
            self.fork_start += shift

    def _take_calls(self, expr: Gen, text: str, meta: dict[str, Any]) -> str:
        """Read the calls a tools gen wrote (a chat service's ``tool_calls``, else the call
        block in its text) into ``tool_calls``; returns the gen's text (a chat service's calls
        written as a call block, so every backend shows them alike)."""
        if not expr.calls_tools:
            return text
        if meta.get("tool_calls"):
            calls = [_chat_call(c) for c in meta["tool_calls"]]
            fmt = self.tool_format
            joint = fmt.text_before if fmt.text_before is not None else "\n"
            text = (text + joint if text else "") + format_calls(
                [(c.name, c.arguments) for c in calls], fmt
            )
        else:
            calls = [
                ToolCall(name, args, new_call_id())
                for name, args in parse_calls(text, self.tool_format)
            ]
        self.tool_calls[expr.name] = calls
        self.turn_calls.extend(calls)
        return text

    def _run_tools(self, expr: RunTools) -> None:
        if self.cur_role is not None:
            raise ProgramError(
                f"run_tools({expr.name!r}) is inside a {self.cur_role!r} turn: tool results "
                "are turns of their own, so run the tools after the assistant turn ends"
            )
        gen = self.gens.get(expr.name)
        calls = self.tool_calls.get(expr.name)
        if gen is None or calls is None or not gen.shown_tools:
            raise ProgramError(
                f"run_tools({expr.name!r}): no gen({expr.name!r}, tools=...) ran in this state"
            )
        if calls and isinstance(calls[0], list):
            raise ProgramError(
                f"run_tools({expr.name!r}): {expr.name!r} holds the calls of several forks; run "
                "each fork's tools in the fork"
            )
        started = time.perf_counter()
        results = run_tool_calls(calls, gen.shown_tools, expr.timeout)
        seconds = time.perf_counter() - started
        self.tool_results[expr.name] = results
        if self.recorder is not None and calls:
            label = ", ".join(c.name for c in calls)
            node = self.recorder.step(self.chain, "tool", label)
            self.recorder.latency(node, seconds)
        for result in results:
            attrs = {"tool_call_id": result.call_id, "name": result.name}
            self._role_begin("tool", attrs)
            self.text += result.content
            self._role_end("tool")

    def _check_chat_gen(self, expr: Gen) -> None:
        """A chat service writes a whole assistant message from the messages before it: a gen
        anywhere else would need text the service never sees."""
        if self.cur_role == "assistant" and not self.text[self.cur_role_begin :]:
            return
        if self.cur_role != "assistant":
            where = f"inside a {self.cur_role!r} turn" if self.cur_role else "outside any role"
        else:
            where = f"after {self.text[self.cur_role_begin :][:40]!r} in the assistant turn"
        raise ProgramError(
            f"gen({expr.name!r}) is {where}, but {type(self.backend).__name__} is a chat-model "
            "backend: chat services generate whole assistant messages, so a gen must come first "
            "in an assistant turn, e.g. s += assistant(gen('answer'))"
        )

    def _select(self, expr: Select) -> None:
        decision = self.backend.select(self.text, expr.choices, expr.temperature, expr.method)
        self.gens.pop(expr.name, None)
        self.text += decision.decision
        self._set_var(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str, attrs: dict[str, Any] | None = None) -> None:
        if self.cur_role is not None:
            raise ProgramError(
                f"role {role!r} begins inside role {self.cur_role!r}: roles do not nest"
            )
        template = self.chat_template
        if not self.messages and role != "system" and template.default_system_prompt:
            self._role_begin("system")
            self.text += template.default_system_prompt
            self._role_end("system")
        prefix, _ = template.get_prefix_and_suffix(role, self.messages)
        self.text += prefix
        self.cur_role = role
        self.cur_role_begin = len(self.text)
        self.cur_role_attrs = dict(attrs or {})
        if role == "assistant":
            self.turn_calls = []

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ProgramError(f"role {role!r} ends but the open role is {self.cur_role!r}")
        content = self.text[self.cur_role_begin :].lstrip()
        if role == "system" and not self.messages:
            self.system_end = len(self.text)
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages)
        self.text += suffix
        self.cur_role = None
        message: dict[str, Any] = {"role": role, "content": content, **self.cur_role_attrs}
        if role == "assistant" and self.turn_calls:  # the calls as a chat message holds them
            message["content"] = parse_output(content, self.tool_format)[0].rstrip()
            message["tool_calls"] = [call.openai() for call in self.turn_calls]
            self.turn_calls = []
        self.messages.append(message)


def _chat_call(item: dict[str, Any]) -> ToolCall:
    """A chat service's ``tool_calls`` item as a ToolCall (arguments that are not a JSON
    object are kept as their text: running the call then gives an error result)."""
    function = item.get("function") or {}
    arguments: Any = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if arguments.strip() else {}
    return ToolCall(str(function.get("name")), arguments, item.get("id") or new_call_id())


class _ForkPoint(Expr):
    """Where a state forks: its branches take its state when its worker gets here."""

    def __init__(self, children: list[StateExecutor]) -> None:
        super().__init__()
        self.children = children
