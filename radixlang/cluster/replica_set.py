"""N engines as Ray actors behind one engine-like front, for the HTTP server or a program.

``ReplicaSet`` answers what the server asks an :class:`~radixlang.runtime.engine.Engine`
(``submit`` returning a :class:`RequestHandle`, ``abort``, ``stats``, ``flush_cache``,
``release_retained``, the tokenizer and model facts), so ``radixlang serve --replicas N`` is
the same server over it. Each request goes to the replica the :class:`Router` picks; the router
follows every replica's KV events to know what each has cached (and where: on the device or
in the host tier), and which routing keys hold retained paths where (a request with
``retain_s``), so that a paused program's next call finds its context.

One thread per replica long-polls it (``EngineReplica.poll``) and feeds the handles. When a
replica dies its poll fails: it leaves the rotation, its requests that have streamed nothing
yet go to another replica, the rest fail with an error naming the replica, and once Ray has
restarted it (a fresh engine, an empty cache) it comes back into rotation.

Ray is set up to stay on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``) unless the caller
joins a cluster with ``ray_address``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

from radixlang.cluster.replica import EngineReplica
from radixlang.cluster.router import (
    BALANCE_ABS,
    BALANCE_REL,
    REASONS,
    NoReplicaError,
    Route,
    Router,
)
from radixlang.constrain.tool_formats import format_for
from radixlang.model_files import DEFAULT_MODEL, ModelFiles, load_model_files
from radixlang.runtime.admission import retain_seconds
from radixlang.runtime.engine import (
    CacheBusyError,
    EngineClosedError,
    RequestError,
    load_tokenizer,
)
from radixlang.runtime.handle import EventCallback, RequestHandle, ResultCallback
from radixlang.runtime.program_log import ProgramLog
from radixlang.runtime.request import (
    FinishReason,
    GenerateRequest,
    GenerationResult,
    StreamEvent,
    as_request,
)

log = logging.getLogger(__name__)

# Seconds a poll waits for output before it returns empty (and reads KV events anyway).
POLL_SECONDS = 0.2
# The finishes after which an engine retains a request's path (when it asked: retain_s).
_RETAINING = (FinishReason.STOP, FinishReason.LENGTH)
# Stats that are not sums over the replicas: taken as the largest.
_MAX_STATS = ("grammar_mask_ms_", "grammar_mask_wait_ms_", "other_cores_busy")


def init_ray(address: str | None = None) -> bool:
    """Connect to Ray (``address``: an existing cluster), or start a local instance bound to
    loopback; returns whether this call started or joined it (and so should shut it down)."""
    # Both must be set before ray is imported: without the first, Ray binds to the machine's
    # outward address.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return False
    options: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    if address:
        ray.init(address=address, **options)
    else:
        # "local": a new instance, never one an earlier process left its address for.
        ray.init(address="local", include_dashboard=False, **options)
    return True


@dataclass
class _Flight:
    """A request in flight, as the front knows it."""

    handle: RequestHandle
    request: GenerateRequest
    prompt_ids: list[int] | None
    replica: int
    submitted: float
    streamed: bool = False  # an event has reached the handle: it can no longer move
    attempts: int = 1
    retain_s: float = 0.0  # as the replicas will take it (cut to their retain_max_s)


class ReplicaSet:
    """``replicas`` engines of ``model`` on Ray, routed by ``routing`` (``cache_aware`` or
    ``round_robin``). ``engine_kwargs`` go to every replica's Engine.

    Each replica is an actor taking ``cpus_per_replica`` CPUs (by default the cluster's CPUs
    shared out; its engine's torch threads set to match) and, on ``device="cuda"``, one GPU.
    Replicas are spread over the cluster's nodes where they can be. ``max_restarts``: how
    often Ray restarts a replica that died (-1: always). A request that a dying replica had
    not started streaming is sent again up to ``retries`` times. ``balance_abs``,
    ``balance_rel`` and ``retained_balance_abs`` (None: 4 x ``balance_abs``): the router's
    overload limits (``cluster/router.py``)."""

    def __init__(
        self,
        model: str | ModelFiles | None = None,
        replicas: int = 2,
        *,
        routing: str = "cache_aware",
        ray_address: str | None = None,
        cpus_per_replica: int | None = None,
        max_restarts: int = -1,
        retries: int = 1,
        balance_abs: int = BALANCE_ABS,
        balance_rel: float = BALANCE_REL,
        retained_balance_abs: int | None = None,
        **engine_kwargs: Any,
    ) -> None:
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
        model = DEFAULT_MODEL if model is None else model
        self.files = model if isinstance(model, ModelFiles) else load_model_files(model)
        self.tokenizer = load_tokenizer(self.files)
        self.tool_format = format_for(self.tokenizer, engine_kwargs.get("tool_call_format"))
        self._owns_ray = init_ray(ray_address)
        import ray

        self._ray = ray
        self.retries = retries
        self.cache_dir = None  # each replica's cache is its own; /save_cache does not apply
        self.programs = ProgramLog()
        self._lock = threading.Lock()
        self._flights: dict[str, _Flight] = {}
        self._closed = False
        self.retried_requests = 0
        self.failed_requests = 0
        device = str(engine_kwargs.get("device", "cpu"))
        gpus = 1 if device.startswith("cuda") else 0
        if cpus_per_replica is None:
            total = int(ray.cluster_resources().get("CPU", 1))
            cpus_per_replica = max(1, total // replicas) if not gpus else 1
        if not gpus:
            engine_kwargs.setdefault("threads", cpus_per_replica)
        self.cpus_per_replica = cpus_per_replica
        actor = ray.remote(EngineReplica).options(
            num_cpus=cpus_per_replica,
            num_gpus=gpus,
            max_restarts=max_restarts,
            max_concurrency=16,
            scheduling_strategy="SPREAD",
        )
        # The replicas load the model from the same path (or name) the front resolved.
        source = str(self.files.path) if isinstance(model, ModelFiles) else model
        self._actors = [actor.remote(i, source, engine_kwargs) for i in range(replicas)]
        try:
            self.replica_info = ray.get([a.info.remote() for a in self._actors])
        except Exception as e:
            self._kill_actors()
            if self._owns_ray:
                ray.shutdown()
            raise RuntimeError(f"a replica failed to start: {_cause(e)}") from None
        first = self.replica_info[0]
        self.router = Router(
            replicas,
            first["block_size"],
            routing,
            balance_abs,
            balance_rel,
            retained_balance_abs=retained_balance_abs,
        )
        self.retain_max_s = min(i["retain_max_s"] for i in self.replica_info)
        self.max_context = min(i["max_context"] for i in self.replica_info)
        self.deterministic = first["deterministic"]
        self.runner = SimpleNamespace(
            vocab_size=first["vocab_size"], dtype=first["dtype"], device=first["device"]
        )
        self.pool = SimpleNamespace(
            block_size=first["block_size"],
            num_blocks=sum(i["num_blocks"] for i in self.replica_info),
        )
        self.scheduler = SimpleNamespace(
            max_batch_tokens=first["max_batch_tokens"],
            max_running_requests=first["max_running_requests"],
            policy=SimpleNamespace(value=first["schedule_policy"]),
        )
        self._pollers = [
            threading.Thread(target=self._poll_loop, args=(r,), name=f"radixlang-replica-{r}",
                             daemon=True)
            for r in range(replicas)
        ]  # fmt: skip
        for t in self._pollers:
            t.start()

    # ---- what the server asks of an engine ----------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return len(self._actors)

    @property
    def dtype(self) -> str:
        return self.runner.dtype

    @property
    def num_waiting(self) -> int:
        """Requests that have not produced anything yet, over all replicas (an estimate)."""
        with self._lock:
            return sum(not f.streamed for f in self._flights.values())

    @property
    def is_running(self) -> bool:
        return not self._closed and any(self.router.healthy)

    def submit(
        self,
        request: GenerateRequest | str | Sequence[int],
        sampling: Any = None,
        *,
        request_id: str | None = None,
        on_event: EventCallback | None = None,
        cache_salt: str | None = None,
        on_result: ResultCallback | None = None,
        routing_key: str | None = None,
    ) -> RequestHandle:
        """Route and queue a request (as ``Engine.submit``); a request the replica refuses
        raises its ``RequestError`` here. ``routing_key`` (else ``request.routing_key``): the
        requests of one program or chat, kept on one replica (and, with ``retain_s``, on the
        replica that retains its path)."""
        request = as_request(request, sampling, request_id)
        retain_s = min(retain_seconds(request.retain_s), self.retain_max_s)
        rid = request.request_id or uuid.uuid4().hex
        salt = request.cache_salt if cache_salt is None else cache_salt
        key = routing_key if routing_key is not None else request.routing_key
        request = replace(request, request_id=rid, cache_salt=salt, routing_key=key)
        prompt_ids = self._prompt_ids(request)
        handle = RequestHandle(rid, self.abort, on_event, on_result)
        flight = _Flight(handle, request, prompt_ids, -1, time.perf_counter(), retain_s=retain_s)
        with self._lock:
            if self._closed:
                raise EngineClosedError("the replica set is shut down")
            if rid in self._flights:
                raise RequestError(f"request_id {rid!r} is already in use by a live request")
        self._send(flight, frozenset())
        return handle

    def abort(self, request_id: str) -> None:
        with self._lock:
            flight = self._flights.get(request_id)
        if flight is not None and flight.replica >= 0:
            self._actors[flight.replica].abort.remote(request_id)

    def stats(self) -> dict[str, float | int]:
        """The replicas' stats summed (throughputs, counts, blocks), the hit rate recomputed
        over all of them, and the router's: ``replicas``, ``replicas_up``, ``routed_<reason>``
        (retained, key, prefix, load, round_robin), ``retried_requests``, ``failed_requests``."""
        per = self.replica_stats()
        total: dict[str, float | int] = {}
        for s in per:
            for k, v in s.items():
                if k.startswith(_MAX_STATS):
                    total[k] = max(total.get(k, v), v)
                else:
                    total[k] = total.get(k, 0) + v
        prompt = total.get("prompt_tokens", 0)
        total["cache_hit_rate"] = total.get("prompt_tokens_reused", 0) / prompt if prompt else 0.0
        total["replicas"] = self.num_replicas
        total["replicas_up"] = sum(self.router.healthy)
        for reason in REASONS:
            total[f"routed_{reason}"] = self.router.decisions[reason]
        total["retried_requests"] = self.retried_requests
        total["failed_requests"] = self.failed_requests
        return total

    def replica_stats(self) -> list[dict[str, float | int]]:
        """Each replica's own ``Engine.stats()`` (those up; the rest are left out)."""
        up = [r for r in range(self.num_replicas) if self.router.healthy[r]]
        results = []
        for r, ref in [(r, self._actors[r].stats.remote()) for r in up]:
            try:
                results.append(self._ray.get(ref, timeout=30))
            except Exception as e:
                log.warning("replica %d gave no stats: %s", r, _cause(e))
        return results

    def reset_stats(self) -> None:
        self._ray.get([a.reset_stats.remote() for a in self._up_actors()])
        self.router.decisions.clear()

    def flush_cache(self, wait: float | None = 0.0) -> bool:
        """Flush every replica's cache (as ``Engine.flush_cache``: raises ``CacheBusyError``
        if requests are still running after ``wait`` seconds)."""
        try:
            self._ray.get([a.flush_cache.remote(wait) for a in self._up_actors()])
        except Exception as e:
            cause = _cause(e)
            if isinstance(cause, CacheBusyError):
                raise CacheBusyError(str(cause)) from None
            raise
        return True

    def release_retained(self, program: str) -> int:
        """End ``program``'s retentions on every replica up (as ``Engine.release_retained``);
        returns how many paths they had retained. Every replica, not only the key's: the
        router moves a key off a replica that is down or overloaded, so its earlier calls'
        paths may be retained on another. A replica that fails meanwhile is skipped: it comes
        back with an empty cache, nothing retained. The router stops keeping the key on the
        replica that retained it (it routes as a plain key from then on)."""
        with self._lock:
            self.router.release_retained(program)
            up = [r for r in range(self.num_replicas) if self.router.healthy[r]]
        released = 0
        for r, ref in [(r, self._actors[r].release_retained.remote(program)) for r in up]:
            try:
                released += self._ray.get(ref, timeout=30)
            except Exception as e:
                log.warning("replica %d released nothing: %s", r, _cause(e))
        return released

    def check_integrity(self) -> None:
        """Each replica's ``Engine.check_integrity`` (raises the first fault)."""
        self._ray.get([a.check_integrity.remote() for a in self._up_actors()])

    def memory_report(self) -> Any:
        reports = self._ray.get([a.memory_report.remote() for a in self._up_actors()])
        return SimpleNamespace(to_dict=lambda: {"replicas": reports})

    def view(self, max_nodes: int = 150) -> dict[str, Any]:
        raise NotImplementedError("the dashboard shows one engine; it is off with replicas")

    def kill_replica(self, replica: int) -> None:
        """Kill one replica's process (Ray restarts it within ``max_restarts``): for tests
        and drills of the failure path."""
        self._ray.kill(self._actors[replica], no_restart=False)

    def shutdown(self, free_cache: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            flights = list(self._flights.values())
            self._flights.clear()
        for flight in flights:
            _finish(flight, FinishReason.ABORT, "the replica set shut down")
        try:
            self._ray.get([a.shutdown.remote() for a in self._up_actors()], timeout=60)
        except Exception as e:
            log.warning("a replica did not shut down cleanly: %s", _cause(e))
        self._kill_actors()
        for t in self._pollers:
            t.join(timeout=5)
        if self._owns_ray:
            self._ray.shutdown()

    def __enter__(self) -> ReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- routing and delivery -----------------------------------------------------------------
    def _prompt_ids(self, request: GenerateRequest) -> list[int] | None:
        """The prompt's tokens for routing (the replica tokenizes and checks it again)."""
        if request.input_ids is not None:
            return list(request.input_ids)
        if isinstance(request.text, str) and self.tokenizer is not None:
            return list(self.tokenizer.encode(request.text))
        return None

    def _send(self, flight: _Flight, exclude: frozenset[int]) -> None:
        """Route ``flight`` and submit it, trying other replicas while the chosen one is down;
        raises the replica's ``RequestError`` for a bad request."""
        request = flight.request
        rid = request.request_id
        assert rid is not None
        while True:
            with self._lock:
                try:
                    route: Route = self.router.choose(
                        flight.prompt_ids,
                        request.cache_salt,
                        request.routing_key,
                        exclude,
                        retain_s=flight.retain_s,
                    )
                except NoReplicaError:
                    self._flights.pop(rid, None)
                    raise EngineClosedError("no replica is up to take the request") from None
                flight.replica = route.replica
                self._flights[rid] = flight
                self.router.started(route.replica)
            try:
                self._ray.get(self._actors[route.replica].submit.remote(request))
                return
            except Exception as e:
                cause = _cause(e)
                with self._lock:
                    mine = self._flights.get(rid) is flight and flight.replica == route.replica
                    if mine:
                        del self._flights[rid]
                        self.router.finished(route.replica)
                if not mine:
                    return  # the replica died meanwhile and its poller moved the request
                if isinstance(cause, RequestError | EngineClosedError):
                    raise type(cause)(str(cause)) from None
                if not _is_replica_failure(e):
                    raise
                log.warning("replica %d could not take a request: %s", route.replica, cause)
                exclude = exclude | {route.replica}

    def _poll_loop(self, replica: int) -> None:
        ray = self._ray
        actor = self._actors[replica]
        incarnation = self.replica_info[replica]["incarnation"]
        kv_seq = 0
        while not self._closed:
            try:
                reply = ray.get(actor.poll.remote(kv_seq, POLL_SECONDS))
            except Exception as e:
                if self._closed:
                    return
                if not _is_replica_failure(e):
                    log.exception("polling replica %d failed", replica)
                    time.sleep(0.5)
                    continue
                self._replica_down(replica, _cause(e))
                info = self._await_restart(replica)
                if info is None:
                    return
                with self._lock:
                    self.replica_info[replica] = info
                    self.router.set_healthy(replica, True)
                log.warning("replica %d is back (incarnation %s, was %s)", replica,
                            info["incarnation"][:8], incarnation[:8])  # fmt: skip
                incarnation, kv_seq = info["incarnation"], 0
                continue
            self._deliver(replica, reply["outputs"])
            index = self.router.indexes[replica]
            with self._lock:
                snapshot = reply.get("kv_snapshot")
                if snapshot is not None:
                    kv_seq, nodes = snapshot
                    index.reset({h: medium for _, hashes, medium in nodes for h in hashes})
                else:
                    for event in reply["kv_events"]:
                        index.apply(event)
                        kv_seq = event.seq

    def _deliver(self, replica: int, outputs: list[tuple[str, Any]]) -> None:
        for rid, item in outputs:
            with self._lock:
                flight = self._flights.get(rid)
                if flight is None or flight.replica != replica:
                    continue  # aborted and gone, or from an attempt that moved
                if isinstance(item, GenerationResult):
                    del self._flights[rid]
                    self.router.finished(replica)
                    key = flight.request.routing_key
                    if key is not None and item.finish_reason in _RETAINING:
                        # The replica retains the path from now (runtime/scheduler.py finish).
                        self.router.extend_retention(key, replica, flight.retain_s)
                else:
                    flight.streamed = True
            if isinstance(item, StreamEvent):
                flight.handle.push(item)
            else:
                flight.handle.set_result(item)

    def _replica_down(self, replica: int, error: BaseException) -> None:
        """Out of rotation; its requests move (nothing streamed yet) or fail."""
        log.error("replica %d is down: %s", replica, error)
        with self._lock:
            self.router.set_healthy(replica, False)
            victims = [f for f in self._flights.values() if f.replica == replica]
            for f in victims:
                del self._flights[f.request.request_id]  # type: ignore[arg-type]
        for flight in victims:
            if not flight.streamed and flight.attempts <= self.retries and not self._closed:
                flight.attempts += 1
                try:
                    self._send(flight, frozenset({replica}))
                    self.retried_requests += 1
                    continue
                except Exception as e:
                    error = e
            self.failed_requests += 1
            _finish(flight, FinishReason.ERROR, f"replica {replica} failed: {error}")

    def _await_restart(self, replica: int) -> dict[str, Any] | None:
        """Wait for Ray to bring the replica back; its new info, or None once shut down."""
        while not self._closed:
            try:
                return self._ray.get(self._actors[replica].info.remote(), timeout=10)
            except Exception as e:
                if self._closed:
                    return None
                log.info("replica %d not back yet: %s", replica, _cause(e))
                time.sleep(0.5)
        return None

    def _up_actors(self) -> list[Any]:
        return [a for r, a in enumerate(self._actors) if self.router.healthy[r]]

    def _kill_actors(self) -> None:
        for a in self._actors:
            with contextlib.suppress(Exception):
                self._ray.kill(a, no_restart=True)


def _finish(flight: _Flight, reason: FinishReason, error: str) -> None:
    """End a request the replicas will not answer: a last event and an error result."""
    request = flight.request
    rid = request.request_id
    assert rid is not None
    prompt = flight.prompt_ids or []
    flight.handle.push(StreamEvent(rid, [], "", [], [], True, reason, len(prompt), 0))
    flight.handle.set_result(
        GenerationResult(
            request_id=rid,
            text="",
            output_ids=[],
            prompt_ids=prompt,
            finish_reason=reason,
            matched_stop=None,
            prompt_tokens=len(prompt),
            completion_tokens=0,
            cached_tokens=0,
            output_logprobs=[],
            output_top_logprobs=[],
            prompt_logprobs=[],
            prompt_top_logprobs=[],
            time_to_first_token=None,
            latency=time.perf_counter() - flight.submitted,
            error=error if reason is FinishReason.ERROR else None,
        )
    )


def _cause(error: BaseException) -> BaseException:
    """The exception a Ray task raised, out of Ray's wrapper."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


def _is_replica_failure(error: BaseException) -> bool:
    """Whether ``error`` says the replica's process is gone (or restarting)."""
    from ray import exceptions as rx

    return isinstance(error, rx.RayActorError | rx.ActorUnavailableError)
