"""One engine inside a Ray actor: what ``replica_set.py`` starts N of.

The actor is threaded: ``submit``, ``abort`` and the other calls run beside a ``poll`` that
waits for output. Outputs (stream events, results) and KV events leave in batches through
``poll``, one actor call for everything that happened since the last one, so the cost of the
Ray hop is paid per engine step, not per token per request.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any

from radixlang.runtime.engine import Engine
from radixlang.runtime.request import GenerateRequest, GenerationResult, StreamEvent

Output = tuple[str, StreamEvent | GenerationResult]


class EngineReplica:
    def __init__(self, index: int, model: Any, engine_kwargs: dict[str, Any]) -> None:
        self.index = index
        self.incarnation = uuid.uuid4().hex  # a restarted actor is a new engine
        self.engine = Engine(model, **{**engine_kwargs, "kv_events": True})
        self._cond = threading.Condition()
        self._outbox: list[Output] = []

    def info(self) -> dict[str, Any]:
        import ray

        e = self.engine
        return {
            "index": self.index,
            "incarnation": self.incarnation,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "model": e.files.name,
            "block_size": e.pool.block_size,
            "num_blocks": e.pool.num_blocks,
            "max_context": e.max_context,
            "vocab_size": e.runner.vocab_size,
            "dtype": e.dtype,
            "deterministic": e.deterministic,
            "device": str(e.runner.device),
            "max_batch_tokens": e.scheduler.max_batch_tokens,
            "max_running_requests": e.scheduler.max_running_requests,
            "schedule_policy": e.scheduler.policy.value,
            "threads": e.threads,
            "retain_max_s": e.config.retain_max_s,
        }

    def submit(self, request: GenerateRequest) -> None:
        """Queue a request (its ``request_id`` set by the caller); a bad one raises the
        engine's ``RequestError`` here."""
        rid = request.request_id
        assert rid is not None
        self.engine.submit(
            request,
            on_event=lambda event: self._put(rid, event),
            on_result=lambda result: self._put(rid, result),
        )

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def poll(self, kv_seq: int, timeout: float) -> dict[str, Any]:
        """Wait up to ``timeout`` seconds for output; then every output since the last poll,
        the KV events after number ``kv_seq``, and, when the log no longer holds them all, a
        snapshot to rebuild from (``kv_snapshot``: the last event's number and, per node, the
        salt seed, hashes and medium)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._outbox:
                left = deadline - time.monotonic()
                if left <= 0 or self.engine.cache.kv_events.last_seq > kv_seq:
                    break
                self._cond.wait(min(left, 0.05))  # KV events do not notify: look now and then
            outputs, self._outbox = self._outbox, []
        events, gap = self.engine.kv_events_since(kv_seq)
        reply: dict[str, Any] = {"outputs": outputs, "kv_events": events}
        if gap:
            reply["kv_snapshot"] = self.engine.kv_block_media()
        return reply

    def stats(self) -> dict[str, float | int]:
        return self.engine.stats()

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def flush_cache(self, wait: float | None) -> bool:
        return self.engine.flush_cache(wait)

    def release_retained(self, program: str) -> int:
        return self.engine.release_retained(program)

    def memory_report(self) -> dict[str, Any]:
        return self.engine.memory_report().to_dict()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def stall(self, seconds: float) -> None:
        """Hold the engine thread for ``seconds`` (failure drills: requests queue up here
        without producing anything, as behind a long prefill). Returns once the engine thread
        is held, so that the caller knows nothing runs here from then on."""
        held = threading.Event()

        def hold() -> None:
            held.set()
            time.sleep(seconds)

        threading.Thread(target=self.engine._call, args=(hold,), daemon=True).start()
        held.wait()

    def shutdown(self) -> None:
        self.engine.shutdown(True)

    def _put(self, rid: str, item: StreamEvent | GenerationResult) -> None:
        with self._cond:
            self._outbox.append((rid, item))
            self._cond.notify_all()
