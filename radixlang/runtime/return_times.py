"""When a paused program comes back: its tools' observed latencies, per program.

A program that stops at a tool call (a call that asked for retention, ``retain_s``) is
*paused*; its next call with the same routing key *resumes* it. The gap between the two is
its tool's latency plus the client's own time. From those gaps the engine predicts when each
paused program will return, and uses the prediction twice:

- eviction among retained paths goes furthest return first (the path needed last is the one
  to lose: Belady's rule, as KVFlow does with steps to next use);
- a retained path in the host tier is loaded back shortly before its program's predicted
  return (``tier_prefetch.py``), so the call finds it resident.

The prediction for a program with gaps of its own is the median of its last few; before it has
any, the median of every program's recent gaps; before any program has returned, a default.
A prefetch starts ``lead`` seconds early: the predicted copy time plus a step. Programs
return earlier than predicted about half the time; those loads start when their call arrives.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict, deque

# Gaps kept per program and across programs (recent ones: tools and load change).
PER_PROGRAM = 8
GLOBAL = 256
DEFAULT_GAP_S = 1.0
# Paused programs tracked at most (the least recently paused are forgotten past this).
MAX_PROGRAMS = 65536


class ReturnTimes:
    def __init__(self, clock: object = time.monotonic) -> None:
        self._clock = clock
        self._gaps: dict[str, deque[float]] = {}
        self._recent: deque[float] = deque(maxlen=GLOBAL)
        self._paused: OrderedDict[str, float] = OrderedDict()  # program -> when it paused
        self._prefetched: set[str] = set()  # paused programs whose prefetch was tried

    def now(self) -> float:
        return self._clock()  # type: ignore[operator]

    def paused(self, program: str, at: float | None = None) -> None:
        """``program``'s call ended at a tool call (its path is retained)."""
        self._paused[program] = self.now() if at is None else at
        self._paused.move_to_end(program)
        self._prefetched.discard(program)
        while len(self._paused) > MAX_PROGRAMS:
            old, _ = self._paused.popitem(last=False)
            self._prefetched.discard(old)

    def resumed(self, program: str, at: float | None = None) -> None:
        """``program`` made its next call: the gap since it paused is an observation."""
        since = self._paused.pop(program, None)
        self._prefetched.discard(program)
        if since is None:
            return
        gap = max(0.0, (self.now() if at is None else at) - since)
        self._gaps.setdefault(program, deque(maxlen=PER_PROGRAM)).append(gap)
        self._recent.append(gap)
        if len(self._gaps) > MAX_PROGRAMS:
            self._gaps.pop(next(iter(self._gaps)))

    def ended(self, program: str) -> None:
        """``program`` is done (its retentions were released): forget it."""
        self._paused.pop(program, None)
        self._prefetched.discard(program)
        self._gaps.pop(program, None)

    def expected_gap(self, program: str) -> float:
        own = self._gaps.get(program)
        if own:
            return statistics.median(own)
        if self._recent:
            return statistics.median(self._recent)
        return DEFAULT_GAP_S

    def expected_return(self, program: str, paused_at: float | None = None) -> float:
        """When ``program`` is predicted to call again (on this clock)."""
        start = self._paused.get(program, self.now()) if paused_at is None else paused_at
        return start + self.expected_gap(program)

    def due(self, lead: float) -> list[str]:
        """Paused programs predicted back within ``lead`` seconds, not prefetched yet; each is
        returned once per pause (soonest first)."""
        now = self.now()
        due = [
            (self.expected_return(p, t), p)
            for p, t in self._paused.items()
            if p not in self._prefetched and t + self.expected_gap(p) - lead <= now
        ]
        due.sort()
        for _, p in due:
            self._prefetched.add(p)
        return [p for _, p in due]

    def next_due(self, lead: float) -> float | None:
        """The earliest time (on this clock) a paused program not yet prefetched falls due."""
        times = [
            t + self.expected_gap(p) - lead
            for p, t in self._paused.items()
            if p not in self._prefetched
        ]
        return min(times, default=None)

    def stats(self) -> dict[str, float | int]:
        return {
            "paused_programs": len(self._paused),
            "return_gap_median_s": round(statistics.median(self._recent), 4)
            if self._recent
            else 0.0,
        }
