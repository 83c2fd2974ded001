"""The call graphs that programs report about themselves, for viewers (the dashboard).

A program whose backend reports (``report_programs=True``) hands its run's graph here when it
ends: a local backend directly, a remote one through ``POST /dashboard/api/programs``. The
engine keeps the log only as a meeting point: nothing in the engine reads it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

PROGRAM_LOG_SIZE = 20


class ProgramLog:
    """The latest reported programs (plain JSON-ready dicts), newest last; thread-safe."""

    def __init__(self, size: int = PROGRAM_LOG_SIZE) -> None:
        self._lock = threading.Lock()
        self._programs: deque[dict[str, Any]] = deque(maxlen=size)
        self._next_id = 1
        self.version = 0  # bumped by every add: viewers refetch when it changes

    def add(self, name: str, graph: dict[str, Any], status: str = "finished") -> int:
        """Keep one program's graph; returns the id it is listed under."""
        with self._lock:
            program_id = self._next_id
            self._next_id += 1
            self._programs.append(
                {"id": program_id, "name": name, "time": time.time(), "status": status,
                 "graph": graph}
            )  # fmt: skip
            self.version += 1
            return program_id

    def programs(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._programs)
