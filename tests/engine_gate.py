"""Hold a background engine's steps, so that a request a test needs in flight stays in flight
for as long as the test looks, on a fast machine as on a loaded one.

A long request (``max_new_tokens=900``) is not enough: a fast machine finishes it before the
test has looked, and a request that must be gone by then races the other way. Inside
``with hold_steps(engine, after_tokens=n) as gate:`` the engine runs its steps until it has
generated ``n`` tokens (counted from the ``with``), and then runs none until the block ends
(or ``gate.release()``): every request in flight stays where it is. ``gate.wait_holding()``
returns once the engine is held (it fails, rather than hangs, if it never is).

The hold is *between* steps, not inside a forward pass: the engine thread keeps taking
submissions, aborts, ``stats()``, ``flush_cache``'s checks, ``check_integrity`` and shutdown,
which all run on it between steps, so a test can watch and stop what it holds. (A forward
blocked on an Event would block all of those too.) With ``overlap`` the step already handed to
the device thread finishes there; its tokens are taken once the hold ends, or by an abort.

The gate patches the engine instance's ``step``, which the engine thread's loop calls each
time round; nothing in the runtime knows of it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

# How long a held step waits before it hands the engine thread back to its loop (which then
# serves its inbox and comes back): the latency of a call to a held engine.
POLL_S = 0.005


class StepGate:
    def __init__(self, engine: Any, after_tokens: int) -> None:
        self.engine = engine
        self.after_tokens = after_tokens
        self.holding = threading.Event()  # set once a step has been held
        self._released = threading.Event()
        self._start = engine._generated_tokens
        self._real_step = engine.step

    def _step(self) -> bool:
        if self._released.is_set():
            return self._real_step()
        if not self.holding.is_set():
            if self.engine._generated_tokens - self._start < self.after_tokens:
                return self._real_step()
            self.holding.set()
        self._released.wait(POLL_S)  # back to the loop: it serves calls, then steps again
        return False

    def wait_holding(self, timeout: float = 60.0) -> None:
        """Until the engine is held (a hang guard: only a broken engine takes the timeout)."""
        assert self.holding.wait(timeout), (
            f"the engine never generated {self.after_tokens} tokens to be held after"
        )

    def release(self) -> None:
        self._released.set()


def wait_until_idle(engine: Any, timeout: float = 60.0) -> None:
    """Until no request is running or waiting (what an earlier test left, finishing)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats["running_requests"] == 0 and stats["waiting_requests"] == 0:
            return
        assert time.monotonic() < deadline, f"the engine did not go idle: {stats}"
        time.sleep(0.01)


@contextlib.contextmanager
def hold_steps(engine: Any, after_tokens: int = 0) -> Iterator[StepGate]:
    """Hold ``engine`` (a background engine) once it has generated ``after_tokens`` tokens
    from now; release it on leaving. It starts from an idle engine, so that the tokens counted
    are the test's own."""
    assert engine._thread is not None, "hold_steps holds an engine thread's loop"
    wait_until_idle(engine)
    gate = StepGate(engine, after_tokens)
    engine.step = gate._step  # the loop calls self.step(): the instance's, from now on
    try:
        yield gate
    finally:
        gate.release()
        vars(engine).pop("step", None)
