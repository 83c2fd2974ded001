"""The routing key of the program whose state runs on this thread.

Every program run gets a key, and its forks share it; a backend that talks to a server with
several replicas sends it along (``X-Routing-Key``), so the server's router keeps a program's
branches and turns on one replica, where their shared prefix is cached. A thread-local, set by
the state's worker thread around the expressions it runs.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

# The header a radixlang server reads the key from (server/common.py ROUTING_KEY_HEADER);
# other servers ignore it.
ROUTING_KEY_HEADER = "x-routing-key"
T = TypeVar("T")
_local = threading.local()


def new_program_key() -> str:
    return "program-" + uuid.uuid4().hex[:16]


def current_routing_key() -> str | None:
    return getattr(_local, "key", None)


@contextlib.contextmanager
def routing_scope(key: str | None) -> Iterator[None]:
    """Requests sent from this thread inside the block carry ``key``."""
    previous = current_routing_key()
    _local.key = key
    try:
        yield
    finally:
        _local.key = previous


def in_scope(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` to run on another thread with this thread's routing key."""
    key = current_routing_key()

    def call(*args: Any, **kwargs: Any) -> T:
        with routing_scope(key):
            return fn(*args, **kwargs)

    return call


def add_routing_header(request: Any) -> None:
    """An httpx request hook: the current program's key as ``X-Routing-Key``."""
    key = current_routing_key()
    if key is not None:
        request.headers[ROUTING_KEY_HEADER] = key
