"""What the REPL talks to: a local engine or a running server, behind one interface.

A chat turn is a :class:`Generation`: ``n`` requests over the same messages (``n`` > 1 for
``/fork``), each streamed by a worker thread into one queue of :class:`Piece` s, so the
terminal shows every branch as it grows, and ``cancel()`` (Ctrl-C) stops them all. The local
backend (``local.py``) submits token ids made with the tokenizer's chat template; the remote
one (``remote.py``) streams the server's OpenAI ``/v1/chat/completions``, which applies the
same template on the server, so both send the model the same prompt.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from radixlang.repl.session import Usage


class BackendError(RuntimeError):
    """The engine or server refused or failed a request; the message says why."""


@dataclass(frozen=True)
class Piece:
    """Text from branch ``branch``; its last piece has ``done`` with its usage (or error)."""

    branch: int
    text: str = ""
    done: bool = False
    usage: Usage | None = None
    error: str | None = None


def branch_sampling(sampling: dict[str, Any], index: int) -> dict[str, Any]:
    """The sampling of a message's reply number ``index + 1``: a set seed becomes
    ``seed + index``, so a fork's branches differ from each other and from the replies before
    them (one seed for all would sample the same reply again), and repeat run to run."""
    if sampling.get("seed") is None:
        return sampling
    return {**sampling, "seed": sampling["seed"] + index}


# One branch's stream: called on its worker thread with the cancel event, yields its pieces.
BranchSource = Callable[[int, threading.Event], Iterator[Piece]]


class Generation:
    """``n`` streamed requests: ``next_piece()`` gives their pieces as they come."""

    def __init__(self, n: int, source: BranchSource, on_cancel: Callable[[], None] = lambda: None):
        self.n = n
        self.cancelled = threading.Event()
        self._on_cancel = on_cancel
        self._queue: queue.Queue[Piece] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._pump, args=(i, source), daemon=True, name="repl-stream")
            for i in range(n)
        ]
        for t in self._threads:
            t.start()

    def _pump(self, branch: int, source: BranchSource) -> None:
        ended = False
        try:
            for piece in source(branch, self.cancelled):
                ended = ended or piece.done
                self._queue.put(piece)
        except Exception as e:  # a failed stream is one branch's error, never a crash
            if not ended:
                ended = True
                if self.cancelled.is_set():  # its connection was closed to stop it
                    self._queue.put(Piece(branch, done=True, usage=Usage(finish_reason="abort")))
                else:
                    self._queue.put(Piece(branch, done=True, error=f"{type(e).__name__}: {e}"))
        if not ended:
            self._queue.put(Piece(branch, done=True, usage=Usage(finish_reason="abort")))

    def next_piece(self, timeout: float = 0.1) -> Piece | None:
        """The next piece of any branch, or None if none came within ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def cancel(self) -> None:
        """Stop every branch; their requests are aborted (the engine frees their blocks)."""
        self.cancelled.set()
        self._on_cancel()

    def join(self, timeout: float = 30.0) -> bool:
        """Wait until every branch's stream has ended; False if one is still going."""
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)


class ChatBackend(ABC):
    """One session's model: chat turns, the cache's figures, programs' backend."""

    name: str  # the model's name, for the banner
    where: str  # "local" or the server's URL

    @abstractmethod
    def chat(
        self, messages: list[dict[str, str]], sampling: dict[str, Any], n: int, first: int = 0
    ) -> Generation:
        """Start ``n`` replies to ``messages``, the message's replies number ``first + 1`` on
        (see :func:`branch_sampling`); raises :class:`BackendError` if refused."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """The engine's figures (``Engine.stats()`` names), plus what this backend adds."""

    def cache_tree(self) -> tuple[dict[str, Any], Callable[[list[int]], str]] | None:
        """The radix tree (``RadixCache.describe()``) and a token decoder; None where the
        backend cannot see it (a server has no route for it)."""
        return None

    @abstractmethod
    def flush(self) -> None:
        """Empty the prefix cache; raises :class:`BackendError` while requests run."""

    @abstractmethod
    def program_backend(self) -> Any:
        """A ``radixlang.lang`` backend on the same model, for ``/run``."""

    def close(self) -> None:  # noqa: B027
        """Release the engine or connection."""
