"""Stored responses of the Responses API: what ``previous_response_id`` continues, and what
``GET`` / ``DELETE /v1/responses/{id}`` read and remove.

A stored response keeps the conversation through it as chat messages (its instructions left
out: a continuation brings its own, as OpenAI's API does) and the response object answered.
The next turn renders that conversation plus its new input; the chat template writes the same
text for the same messages, so the prompt extends the earlier one token for token and the
radix cache already holds all of it but the new turn.

Bounded: at most ``max_responses`` (the oldest go first) and none older than ``max_age_s``.
Each response belongs to the API-key tenant that made it; another tenant cannot see it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_RESPONSES = 4096
MAX_AGE_S = 3600.0


@dataclass
class StoredResponse:
    tenant: str | None
    messages: list[dict[str, Any]]  # the conversation through this response, as chat messages
    response: dict[str, Any]  # the response object, as answered
    stored_at: float = 0.0


class ResponseStore:
    def __init__(
        self,
        max_responses: int = MAX_RESPONSES,
        max_age_s: float = MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` reads the time in seconds (monotonic); tests pass a fake one."""
        if max_responses < 1 or max_age_s <= 0:
            raise ValueError("a response store holds at least one response for a positive time")
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, stored: StoredResponse) -> None:
        with self._lock:
            stored.stored_at = self._clock()
            self._items[rid] = stored
            self._items.move_to_end(rid)
            self._expire(stored.stored_at)
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def get(self, rid: str, tenant: str | None) -> StoredResponse | None:
        """The response ``rid`` if it is stored, not expired and ``tenant``'s."""
        with self._lock:
            self._expire(self._clock())
            stored = self._items.get(rid)
            return stored if stored is not None and stored.tenant == tenant else None

    def delete(self, rid: str, tenant: str | None) -> bool:
        with self._lock:
            stored = self._items.get(rid)
            if stored is None or stored.tenant != tenant:
                return False
            del self._items[rid]
            return True

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self, now: float) -> None:
        while self._items:
            rid, oldest = next(iter(self._items.items()))
            if now - oldest.stored_at <= self.max_age_s:
                return
            del self._items[rid]
