"""Grammar masks for a step's constrained rows, optionally filled while the forward pass runs.

A row's mask depends only on the tokens before the step (its constraint has already taken
them, jump-forward included), so it can be computed beside the forward that produces the step's
logits. The engine calls :meth:`MaskFiller.prefetch` just before the forward and
:meth:`MaskFiller.fill` after it; with ``overlap`` off (or when the batch changed in between)
``fill`` computes inline. The compiled library releases the GIL while it fills, so the worker
thread does not hold up the forward's Python.

A constraint's matcher is not thread-safe: :meth:`MaskFiller.settle` waits for every pending
fill before the engine advances constraints, so the worker never runs beside the engine's own
use of them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

WINDOW = 2048  # steps kept for the percentiles


@dataclass
class _Pending:
    key: tuple[int, ...]  # ids of the constraints, in row order
    width: int
    future: concurrent.futures.Future[tuple[torch.Tensor, float]]


def _timed_fill(kind: Any, constraints: Sequence[Any], width: int) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    masks = kind.batch_allowed_masks(constraints, width)
    return masks, time.perf_counter() - started


class MaskFiller:
    """Fills ``kind.batch_allowed_masks(constraints, width)`` per constraint class and step.

    Records the time spent filling per call (``compute``) and, per step, the time the step
    waited for masks after its forward (``wait``: the fill time inline, near zero when the
    fill finished beside the forward).
    """

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap  # may be switched between steps
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[Any, _Pending] = {}
        self.compute_seconds: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.wait_seconds: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._step_wait, self._step_used = 0.0, False

    def prefetch(self, kind: Any, constraints: Sequence[Any], width: int) -> None:
        """Start filling these rows' masks on the worker (no-op without overlap)."""
        if not self.overlap or not constraints:
            return
        self._discard(kind)
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="radixlang-masks"
            )
        future = self._worker.submit(_timed_fill, kind, list(constraints), width)
        self._pending[kind] = _Pending(tuple(map(id, constraints)), width, future)

    def wait(self) -> None:
        """Block until every prefetched fill is done: only then may the engine thread touch
        the constraints again (even to ask whether they are finished)."""
        if not self._pending:
            return
        started = time.perf_counter()
        concurrent.futures.wait([p.future for p in self._pending.values()])
        self._step_wait += time.perf_counter() - started
        self._step_used = True

    def fill(self, kind: Any, constraints: Sequence[Any], width: int) -> torch.Tensor:
        """Bool ``[len(constraints), width]``: the prefetched masks when they are for exactly
        these constraints, else computed now. Raises what ``batch_allowed_masks`` raises."""
        pending = self._pending.pop(kind, None)
        if pending is not None:
            _wait_quietly(pending)  # the matchers are the caller's again only once it ends
            if pending.key == tuple(map(id, constraints)) and pending.width == width:
                masks, seconds = pending.future.result()
                self.compute_seconds.append(seconds)
                return masks
        started = time.perf_counter()
        try:
            masks, seconds = _timed_fill(kind, constraints, width)
            self.compute_seconds.append(seconds)
            return masks
        finally:
            self._step_wait += time.perf_counter() - started
            self._step_used = True

    def settle(self) -> None:
        """End of a step: wait for (and drop) every fill not taken, since the engine is about
        to advance the constraints, and record how long the step waited for masks."""
        for kind in list(self._pending):
            self._discard(kind)
        if self._step_used:
            self.wait_seconds.append(self._step_wait)
        self._step_wait, self._step_used = 0.0, False

    def close(self) -> None:
        self.settle()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def reset(self) -> None:
        """Forget the recorded times (a benchmark measuring one run)."""
        self.compute_seconds.clear()
        self.wait_seconds.clear()

    def percentiles_ms(self) -> dict[str, float | int]:
        """p50/p99 of the fill time and of the step's wait for it, in milliseconds."""
        out: dict[str, float | int] = {"grammar_mask_steps": len(self.compute_seconds)}
        for name, values in (("", self.compute_seconds), ("_wait", self.wait_seconds)):
            ordered = sorted(values)
            for q in (50, 99):
                at = min(len(ordered) - 1, int(q / 100 * len(ordered)))
                out[f"grammar_mask{name}_ms_p{q}"] = 1e3 * ordered[at] if ordered else 0.0
        return out

    def _discard(self, kind: Any) -> None:
        pending = self._pending.pop(kind, None)
        if pending is not None:
            _wait_quietly(pending)


def _wait_quietly(pending: _Pending) -> None:
    # The rows it was for are filled (and fail) on the engine thread instead.
    with contextlib.suppress(Exception):
        pending.future.result()
