"""Overlapped scheduling: the device runs step N while the engine thread schedules step N+1
and turns step N-1's tokens into text.

The engine thread hands each step's device work (the forward pass and the sampling) to a
:class:`DeviceWorker`, one thread that runs such work strictly in submission order, the way a
GPU stream does; the engine thread does not wait for it. A request decoding in step N+1 needs
the token step N samples before that token is known on the host: its slot in ``Req.tokens``
holds a *placeholder*, ``-(row + 1)`` for row ``row`` of the previous step's samples. The
engine thread packs the step's batch on the host with a stand-in token there, and the worker
writes the real ids into the packed inputs before the forward (:func:`resolve_placeholders`).
When step N's tokens come back, the engine thread writes them over their placeholders,
detokenizes them and checks stops. A request that stopped in step N was already scheduled in
step N+1: that row's token is dropped when it comes back, as SGLang's overlap scheduler does.

Everything that writes device memory from the engine thread (copy-on-write of a block) goes
through the worker too, so it lands after the steps already submitted, as on a stream.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def placeholder(row: int) -> int:
    """The token standing for row ``row`` of the previous step's samples."""
    return -(row + 1)


def placeholder_row(token: int) -> int:
    """The sample row a placeholder stands for."""
    return -token - 1


class PreviousStepFailed(RuntimeError):
    """A step's inputs named tokens of a step that failed: they will never exist."""


class DeviceWorker:
    """One thread running device work in submission order; results come back as futures."""

    def __init__(self, name: str = "radixlang-device") -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future] | None]
        self._tasks = queue.SimpleQueue()
        self.last_tokens: list[int] | None = None  # the previous step's samples (worker-only)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._tasks.put((fn, future))
        return future

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the worker after everything submitted before it; wait for it."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result()

    def close(self) -> None:
        if self._thread.is_alive():
            self._tasks.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)


def resolve_placeholders(placeholders: Sequence[int], previous: list[int] | None) -> list[int]:
    """The previous step's samples that ``placeholders`` stand for. Raises
    :class:`PreviousStepFailed` when that step failed (and so has none)."""
    if not placeholders:
        return []
    if previous is None:
        raise PreviousStepFailed("the step before this one failed; its tokens never came")
    return [previous[placeholder_row(token)] for token in placeholders]


@dataclass
class InflightStep:
    """A step submitted to the worker whose tokens the engine thread has not read yet."""

    future: concurrent.futures.Future
    chunks: list[Any]  # the step's chunks (every one a plain decode)
    sampled: list[Any]  # the requests sampled, in sample-row order
    positions: list[int]  # where each one's placeholder sits in its ``tokens``
