"""How many CPU threads the forward passes use when other processes share the cores.

torch's OpenMP team splits every op across its threads and waits for all of them at the op's
end. When another busy process holds one of the cores, the thread scheduled there runs only in
the time slices the kernel gives it, and every op waits for it: a step that took 2 ms took
130 ms, small matmuls ran 10-50x slower. With one thread fewer than the free cores no op waits
on a descheduled thread, and a step costs about the share of the CPU that was taken.

``ThreadGovernor`` watches what the rest of the machine uses (``/proc/stat`` minus this
process's own ``/proc/self/stat``) and, between steps, sets torch's thread count to the cores
left free, rounded, at least one; with nothing else running it keeps every core. It reads two
small files every ``interval_s`` (default half a second) and does nothing on systems without
them.

Whether an engine adapts by default (``adapt_by_default``): on a CPU without a fixed thread
count, unless ``$RADIXLANG_ADAPT_THREADS`` says otherwise ("0" or "1"). The test suite sets it
to "0": torch's thread count is process-wide, so a governor reacting to the machine's load
would change the threads under comparisons of outputs between engines (and the rounding
that follows from the split of a sum).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

PROC_STAT = Path("/proc/stat")
PROC_SELF_STAT = Path("/proc/self/stat")
ADAPT_ENV = "RADIXLANG_ADAPT_THREADS"


def adapt_by_default(threads: int | None, device_type: str) -> bool:
    """Whether an engine whose ``adapt_threads`` is not given runs a governor."""
    forced = os.environ.get(ADAPT_ENV, "").strip()
    if forced:
        if forced not in ("0", "1"):
            raise ValueError(f"{ADAPT_ENV} must be 0 or 1; got {forced!r}")
        return forced == "1" and device_type == "cpu"
    return threads is None and device_type == "cpu"


def machine_busy_ticks(stat_text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs from ``/proc/stat``'s first line."""
    fields = [int(v) for v in stat_text.splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def process_busy_ticks(self_stat_text: str) -> int:
    """This process's user + system clock ticks from ``/proc/self/stat``."""
    # The command name (field 2) may hold spaces; the fields after its ')' are fixed.
    rest = self_stat_text.rsplit(")", 1)[1].split()
    return int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15)


def threads_for(other_cores_busy: float, cores: int, max_threads: int) -> int:
    """Threads to use when other processes keep ``other_cores_busy`` cores busy."""
    free = cores - other_cores_busy
    return max(1, min(max_threads, int(free + 0.5)))


class ThreadGovernor:
    """Adapts torch's intra-op threads, between steps, to the cores other processes leave."""

    def __init__(
        self,
        max_threads: int | None = None,
        interval_s: float = 0.5,
        cores: int | None = None,
        read: Callable[[Path], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores = cores or os.cpu_count() or 1
        self.max_threads = max_threads or torch.get_num_threads()
        self.interval_s = interval_s
        self._read = read or (lambda path: path.read_text())
        self._clock = clock
        self._last: tuple[float, int, int, int] | None = None
        self.threads = self.max_threads
        self.other_cores_busy = 0.0
        self.changes = 0
        self.enabled = True
        try:
            self._sample()
        except (OSError, ValueError, IndexError):
            self.enabled = False  # no /proc here: keep the configured count

    def _sample(self) -> tuple[float, int, int, int]:
        busy, total = machine_busy_ticks(self._read(PROC_STAT))
        own = process_busy_ticks(self._read(PROC_SELF_STAT))
        sample = (self._clock(), busy, total, own)
        if self._last is None:
            self._last = sample
        return sample

    def update(self) -> int:
        """Call between steps on the thread that runs them; returns the thread count in use."""
        if not self.enabled or self._last is None:
            return self.threads
        if self._clock() - self._last[0] < self.interval_s:
            return self.threads
        now = self._sample()
        _, busy0, total0, own0 = self._last
        _, busy1, total1, own1 = now
        self._last = now
        if total1 <= total0:
            return self.threads
        # Shares of all the machine's CPU time in the interval, times the cores.
        others = max(0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0) * self.cores
        self.other_cores_busy = others
        wanted = threads_for(others, self.cores, self.max_threads)
        if wanted != self.threads:
            self.threads = wanted
            self.changes += 1
            torch.set_num_threads(wanted)
        return self.threads
