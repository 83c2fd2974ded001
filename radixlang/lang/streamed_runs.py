"""A streamed run's failure that nobody read: reported on stderr, never lost.

``f.run(stream=True)`` returns at once and runs the program on a thread of its own. Its failure
(the program's own exception, else the first error among its states, as ``await state`` raises
it) is raised to whoever reads the stream or the state. One raised to nobody goes to
``threading.excepthook``, as an exception that ends a thread does (on stderr: ``Exception in
thread radixlang-program:NAME:`` and the traceback): when the run's state is garbage-collected
after the run ended, or at exit for a state still alive then. At exit the runs still going get
up to ``EXIT_WAIT_S`` seconds to end first (the local backend's exit hook, which runs before,
has stopped its engines by then, so its runs end at once).

A run cut short because its backend was shut down under it (an error in ``SHUTDOWN_ERRORS``,
which backends extend) did not fail: that is not reported.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixlang.lang.interpreter import StateExecutor

EXIT_WAIT_S = 5.0
# Errors that mean a run's backend was shut down while the run went on (the local backend adds
# the engine's EngineClosedError).
SHUTDOWN_ERRORS: list[type[BaseException]] = []

# The runs whose states are alive and that were not reported yet.
_runs: weakref.WeakSet[StreamedRun] = weakref.WeakSet()


class StreamedRun:
    """One streamed run, held by its state (a failed state is in a reference cycle with its
    error's traceback, which holds the program's frame, so the cycle collector finalizes it)."""

    def __init__(self, executor: StateExecutor) -> None:
        self.executor = executor
        self.thread: threading.Thread | None = None  # the program's thread, once it ended
        self.program_error: BaseException | None = None  # what the program body raised
        # The body returned or raised, and every state of the run settled.
        self.ended = threading.Event()
        self.closed = False
        _runs.add(self)

    def end(self, program_error: BaseException | None) -> None:
        """On the program's thread, once the run is over."""
        self.thread = threading.current_thread()
        self.program_error = program_error
        self.ended.set()

    def close(self) -> None:
        """Report the run's failure if it ended and no reader got it; then never again."""
        if self.closed:
            return
        self.closed = True
        _runs.discard(self)
        if not self.ended.is_set():
            return
        error = self.executor.unread_failure(self.program_error)
        if error is not None and not isinstance(error, tuple(SHUTDOWN_ERRORS)):
            args = (type(error), error, error.__traceback__, self.thread)
            threading.excepthook(threading.ExceptHookArgs(args))

    def __del__(self) -> None:
        self.close()


def report_unread_failures(wait: float = EXIT_WAIT_S) -> None:
    """Wait up to ``wait`` seconds in all for the streamed runs still going to end, then report
    each ended run's failure that no reader got, and stop watching every run. Runs at exit."""
    deadline = time.monotonic() + wait
    runs = list(_runs)
    for run in runs:
        run.ended.wait(max(0.0, deadline - time.monotonic()))
    for run in runs:
        run.close()


atexit.register(report_unread_failures)
