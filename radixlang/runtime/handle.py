"""A submitted request's handle: stream its tokens (iterator, async iterator, callback) and
wait for its result, from any thread or event loop. The engine thread feeds it."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from radixlang.runtime.request import FinishReason, GenerationResult, StreamEvent

log = logging.getLogger(__name__)

EventCallback = Callable[[StreamEvent], None]
ResultCallback = Callable[[GenerationResult], None]


class GenerationError(RuntimeError):
    """The engine failed while running this request (the engine itself keeps serving)."""


class RequestHandle:
    def __init__(
        self,
        request_id: str,
        abort: Callable[[str], None],
        on_event: EventCallback | None = None,
        on_result: ResultCallback | None = None,
    ) -> None:
        self.request_id = request_id
        self._abort = abort
        self._on_event = on_event
        self._on_result = on_result
        self._events: list[StreamEvent] = []
        self._result: GenerationResult | None = None
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads inside a wait on _cond (read and changed under it)
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # ---- engine side ---------------------------------------------------------------------
    def push(self, event: StreamEvent) -> None:
        with self._lock:  # _cond's lock, entered without Condition's Python-level wrapper
            self._events.append(event)
            self._wake()
        if self._on_event is not None:
            try:
                self._on_event(event)
            except Exception:  # a caller's callback must not stop the engine
                log.exception("on_event callback of request %s failed", self.request_id)

    def set_result(self, result: GenerationResult) -> None:
        with self._lock:
            self._result = result
            self._wake()
        if self._on_result is not None:
            try:
                self._on_result(result)
            except Exception:
                log.exception("on_result callback of request %s failed", self.request_id)

    def _wake(self) -> None:
        if self._waiting:  # notify_all costs a few microseconds even with nobody waiting
            self._cond.notify_all()
        for loop, future in self._async_waiters:
            loop.call_soon_threadsafe(_resolve, future)
        self._async_waiters.clear()

    @property
    def saw_finish(self) -> bool:
        """Whether a finished event has been pushed."""
        return bool(self._events) and self._events[-1].finished

    def _wait_for(self, ready: Callable[[], bool], timeout: float | None = None) -> bool:
        """``Condition.wait_for`` (the caller holds ``_cond``), counted in ``_waiting``."""
        if ready():
            return True
        self._waiting += 1
        try:
            return self._cond.wait_for(ready, timeout)
        finally:
            self._waiting -= 1

    # ---- caller side ---------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._result is not None

    def abort(self) -> None:
        self._abort(self.request_id)

    def result(self, timeout: float | None = None, raise_on_error: bool = True) -> GenerationResult:
        """Block until the request finishes; raises ``GenerationError`` if the engine failed it."""
        with self._cond:
            if not self._wait_for(lambda: self._result is not None, timeout):
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
        return self._checked(raise_on_error)

    def __iter__(self) -> Iterator[StreamEvent]:
        """Every event of the request, from the first, until it finishes."""
        seen = 0
        while True:
            with self._cond:
                self._wait_for(
                    lambda seen=seen: len(self._events) > seen or self._result is not None
                )
                new = self._events[seen:]
                finished = self._result is not None and len(self._events) == seen + len(new)
            yield from new
            seen += len(new)
            if finished:
                return

    async def stream(self) -> AsyncIterator[StreamEvent]:
        """The async form of iterating the handle."""
        seen = 0
        while True:
            await self._until(
                lambda seen=seen: len(self._events) > seen or self._result is not None
            )
            with self._cond:
                new = self._events[seen:]
                finished = self._result is not None and len(self._events) == seen + len(new)
            for event in new:
                yield event
            seen += len(new)
            if finished:
                return

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self.stream()

    async def wait(self, raise_on_error: bool = True) -> GenerationResult:
        await self._until(lambda: self._result is not None)
        return self._checked(raise_on_error)

    def __await__(self):
        return self.wait().__await__()

    async def _until(self, ready: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if ready():
                    return
                future: asyncio.Future[None] = loop.create_future()
                self._async_waiters.append((loop, future))
            await future

    def _checked(self, raise_on_error: bool) -> GenerationResult:
        result = self._result
        assert result is not None
        if raise_on_error and result.finish_reason is FinishReason.ERROR:
            raise GenerationError(f"request {self.request_id} failed: {result.error}")
        return result

    def __repr__(self) -> str:
        state = self._result.finish_reason.value if self._result else "running"
        return f"RequestHandle({self.request_id!r}, {state}, {len(self._events)} events)"


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
