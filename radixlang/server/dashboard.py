"""The live dashboard: ``GET /dashboard`` (a static page from ``dashboard_static/``) and the JSON
API it draws from, ``/dashboard/api/...`` (documented in ``docs/dashboard.md``).

Cost to the engine: one :meth:`Engine.view` per interval while anyone watches the event stream,
whatever the number of watchers (a single sampler takes it and fans it out), and one
:meth:`Engine.stats` per interval otherwise, for the history. Decoding token text, run-length
coding the block map and JSON all happen here, off the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, StreamingResponse

from radixlang.runtime.engine import Engine
from radixlang.runtime.engine_view import BLOCK_STATES, FREE
from radixlang.server import metrics
from radixlang.server.api_schema import BODY_ERRORS, snapshot_events
from radixlang.server.common import read_body

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "dashboard_static"
PAGE = "/dashboard"
API = "/dashboard/api"
HISTORY_POINTS = 600
MAP_CELLS = 4096  # larger pools are drawn with several blocks per cell
NODE_TEXT_CHARS = 200
OUTPUT_TEXT_CHARS = 400
_TEXT_CACHE_SIZE = 4096


# ---- reported programs ---------------------------------------------------------------------
class ProgramNode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int = Field(ge=0)
    kind: Literal["text", "role", "gen", "select", "fork", "join", "call", "return",
                  "argument", "scope"]  # fmt: skip
    label: str = Field(max_length=1000)
    chain: int = Field(ge=0)
    prompt_tokens: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)


class ProgramEdge(BaseModel):
    model_config = ConfigDict(extra="forbid")
    src: int = Field(ge=0)
    dst: int = Field(ge=0)
    kind: Literal["prefix", "fork", "join", "data"]


class ProgramGraph(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nodes: list[ProgramNode] = Field(max_length=5000)
    edges: list[ProgramEdge] = Field(default_factory=list, max_length=20000)


class ProgramReport(BaseModel):
    """``POST /dashboard/api/programs``: one program run's call graph."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=200)
    status: str = Field(default="finished", max_length=500)
    graph: ProgramGraph


# ---- the sampler ---------------------------------------------------------------------------
class Dashboard:
    """The history sampler, the snapshot builder and the fan-out to event-stream watchers."""

    def __init__(
        self, engine: Engine, model_name: str, interval: float = 1.0, max_nodes: int = 150
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.interval = interval
        self.max_nodes = max_nodes
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self.watchers: set[asyncio.Queue[str]] = set()
        self._last: tuple[float, dict[str, float | int]] | None = None
        self._texts: dict[tuple[int, ...], str] = {}
        self._task: asyncio.Task | None = None
        # Whether the server is shutting down (set by serve() and ServerThread to uvicorn's
        # flag): event streams never end by themselves, and a drain would wait for them.
        self.closing: Callable[[], bool] = lambda: False
        self._decode = _decoder(engine.tokenizer)

    # The sampler runs on the server's event loop for the app's life (see app.lifespan).
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sample_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sample_forever(self) -> None:
        while True:
            began = time.monotonic()
            try:
                await self._sample()
            except Exception:  # a failed sample (the engine stopping) must not end the loop
                log.debug("dashboard sample failed", exc_info=True)
            await asyncio.sleep(max(0.0, self.interval - (time.monotonic() - began)))

    async def _sample(self) -> None:
        if not self.watchers:
            self._add_point(await run_in_threadpool(self.engine.stats))
            return
        snapshot = await run_in_threadpool(self._snapshot_and_point)
        payload = json.dumps(snapshot, ensure_ascii=False)
        for queue in list(self.watchers):
            if queue.full():  # a slow watcher gets the newest snapshot, not a backlog
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
            queue.put_nowait(payload)

    def _snapshot_and_point(self) -> dict[str, Any]:
        view = self.engine.view(self.max_nodes)
        snapshot = self._build(view)
        snapshot["point"] = self._add_point(view["stats"])
        return snapshot

    def _add_point(self, stats: dict[str, float | int]) -> dict[str, Any]:
        now = time.time()
        last = self._last
        self._last = (now, stats)

        def delta(key: str) -> int:
            if last is None:
                return 0
            change = int(stats[key]) - int(last[1][key])
            return change if change >= 0 else int(stats[key])  # counters were reset

        reused, computed = delta("prompt_tokens_reused"), delta("prompt_tokens_computed")
        generated = delta("generated_tokens")
        span = now - last[0] if last is not None else 0.0
        point = {
            "time": now,
            "tokens_per_second": generated / span if span > 0 else 0.0,
            "generated_tokens": generated,
            "prompt_tokens_reused": reused,
            "prompt_tokens_computed": computed,
            "cache_hit_rate": reused / (reused + computed) if reused + computed else 0.0,
            "blocks_free": stats["blocks_free"],
            "blocks_used": stats["blocks_used"],
            "blocks_evictable": stats["blocks_evictable"],
            "blocks_held": metrics.blocks_held(stats),
            "running": stats["running_requests"],
            "waiting": stats["waiting_requests"],
        }
        self.history.append(point)
        return point

    # ---- the snapshot ----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The state now (``GET /dashboard/api/snapshot``), read from the engine."""
        return self._build(self.engine.view(self.max_nodes))

    def _build(self, view: dict[str, Any]) -> dict[str, Any]:
        stats = view["stats"]
        return {
            "time": time.time(),
            "model": self.model_name,
            "interval": self.interval,
            "metrics": metrics.engine_samples(stats),
            "stats": stats,
            "tree": self._tree(view["tree"]),
            "pool": self._pool(stats, view["blocks"]),
            "requests": [self._request(r) for r in view["requests"]],
            "programs_version": self.engine.programs.version,
        }

    def _text(self, ids: list[int] | tuple[int, ...], limit: int) -> str:
        key = tuple(ids)
        text = self._texts.get(key)
        if text is None:
            if len(self._texts) >= _TEXT_CACHE_SIZE:
                self._texts.clear()
            text = self._texts[key] = self._decode(list(ids))
        return text if len(text) <= limit else text[: limit - 1] + "…"

    def _tree(self, tree: dict[str, Any]) -> dict[str, Any]:
        nodes = tree["nodes"]
        ages = [n["age"] for n in nodes if n["parent"] is not None]
        young, old = (min(ages), max(ages)) if ages else (0, 0)
        for n in nodes:
            n["text"] = self._text(n.pop("head_ids"), NODE_TEXT_CHARS)
            span = old - young
            fresh = 1.0 if span == 0 else 1.0 - (n["age"] - young) / span
            n["recency"] = round(min(1.0, max(0.0, fresh)), 3)  # roots are outside the range
        evictions = [
            {"time": e.time, "id": e.node_id, "parent": e.parent_id, "start": e.start,
             "end": e.end, "tokens": e.end - e.start, "text": self._text(e.head_tokens, 80),
             "blocks": e.blocks, "to_tier": e.to_tier}
            for e in tree["evictions"]
        ]  # fmt: skip
        return {**tree, "max_nodes": self.max_nodes, "evictions": evictions}

    def _pool(self, stats: dict[str, Any], blocks: dict[str, Any]) -> dict[str, Any]:
        states, owners, names = blocks["states"], blocks["owners"], blocks["names"]
        total = len(states)
        per_cell = max(1, math.ceil(total / MAP_CELLS))
        if per_cell == 1:
            cells: Iterable[tuple[int, int]] = zip(states, owners, strict=True)
        else:
            cells = (_cell(states, owners, first, min(first + per_cell, total))
                     for first in range(0, total, per_cell))  # fmt: skip
        legend = [""]
        index: dict[int, int] = {-1: 0}  # holder -> its legend entry ("" for free cells)
        runs: list[list[Any]] = []
        # Runs of equal cells grouped at C speed: the loop below runs once per run, not per block.
        for (state, owner), run in itertools.groupby(cells):
            where = index.get(owner)
            if where is None:
                where = index[owner] = len(legend)
                legend.append(names[owner])
            count = sum(1 for _ in run)
            name = BLOCK_STATES[state]
            if runs and runs[-1][0] == name and runs[-1][1] == where:
                runs[-1][2] += count
            else:
                runs.append([name, where, count])
        return {
            "total": stats["blocks_total"],
            "free": stats["blocks_free"],
            "used": stats["blocks_used"],
            "evictable": stats["blocks_evictable"],
            "held": metrics.blocks_held(stats),
            "block_size": self.engine.pool.block_size,
            "tier_total": stats.get("tier_blocks_total", 0),
            "tier_used": stats.get("tier_blocks_used", 0),
            "map": {
                "cells": len(range(0, total, per_cell)),
                "blocks_per_cell": per_cell,
                "owners": legend,
                "runs": runs,
            },
        }

    def _request(self, row: dict[str, Any]) -> dict[str, Any]:
        out = self._decode(row.pop("output_tail_ids"))
        row["output_text"] = out[-OUTPUT_TEXT_CHARS:]
        row["prompt_text"] = self._text(row.pop("prompt_tail_ids"), NODE_TEXT_CHARS)
        row["age"] = round(row["age"], 3)
        return row

    # ---- the event stream ------------------------------------------------------------------
    async def events(self, request: Request) -> AsyncIterator[str]:
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=1)
        # The first snapshot at once (a page should not wait a whole interval), then the
        # sampler's: joining the watchers is what turns snapshots on.
        first = await run_in_threadpool(self.snapshot)
        first["point"] = self.history[-1] if self.history else None
        self.watchers.add(queue)
        try:
            yield _event(json.dumps(first, ensure_ascii=False))
            while not self.closing():
                try:
                    payload = await asyncio.wait_for(queue.get(), max(1.0, 2 * self.interval))
                except TimeoutError:
                    continue
                if await request.is_disconnected() or self.closing():
                    return
                yield _event(payload)
        finally:
            self.watchers.discard(queue)


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """Token ids to text for display: the fast tokenizer's own decoder where there is one (it
    skips transformers' per-id type checks, most of a snapshot's decoding time), else
    ``decode``, else the ids themselves."""
    if tokenizer is None:
        return lambda ids: " ".join(map(str, ids))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=False)
    return tokenizer.decode


def _cell(states: bytearray, owners: list[int], first: int, end: int) -> tuple[int, int]:
    """A map cell's state (what most of its blocks are) and the holder of its first such block."""
    if end - first == 1:
        return states[first], owners[first]
    state = Counter(states[first:end]).most_common(1)[0][0]
    if state == FREE:
        return FREE, -1
    return state, next(owners[b] for b in range(first, end) if states[b] == state)


def _event(payload: str) -> str:
    return f"data: {payload}\n\n"


# ---- routes --------------------------------------------------------------------------------
def add_routes(app: Any, dashboard: Dashboard, docs: Callable[..., dict[str, Any]]) -> None:
    """The page, its files and its API on ``app`` (the API is keyed like the rest: app.py).
    ``docs(ok, **kw)``: a route's OpenAPI answers (``api_schema.route_docs``, with auth). The
    page and its files are plain routes outside the schema: static files, not the API."""

    async def page(request: Request) -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def static(name: str) -> FileResponse:
        files = {p.name: p for p in STATIC.iterdir() if p.is_file()}
        if name not in files:
            return JSONResponse(  # type: ignore[return-value]
                {"error": {"message": f"no dashboard file {name!r}", "type": "not_found",
                           "param": None, "code": 404}}, status_code=404)  # fmt: skip
        return FileResponse(files[name], headers={"Cache-Control": "no-cache"})

    async def snapshot() -> JSONResponse:
        return JSONResponse(await run_in_threadpool(dashboard.snapshot))

    async def history() -> JSONResponse:
        return JSONResponse({"interval": dashboard.interval, "points": list(dashboard.history)})

    async def programs() -> JSONResponse:
        log_ = dashboard.engine.programs
        return JSONResponse({"version": log_.version, "programs": log_.programs()})

    async def report_program(request: Request) -> JSONResponse:
        body = await read_body(request, ProgramReport)
        program_id = dashboard.engine.programs.add(
            body.name, body.graph.model_dump(exclude_none=True), body.status
        )
        return JSONResponse({"id": program_id})

    async def events(request: Request) -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(
            dashboard.events(request), media_type="text/event-stream", headers=headers
        )

    app.router.add_route(PAGE, page, methods=["GET"], include_in_schema=False)
    app.router.add_route(PAGE + "/static/{name}", _path_arg(static), methods=["GET"],
                         include_in_schema=False)  # fmt: skip
    keyed = (403,) if docs(None)["responses"].get(401) else ()
    app.add_api_route(API + "/snapshot", snapshot, methods=["GET"],
                      **docs("DashboardSnapshot", errors=keyed))  # fmt: skip
    app.add_api_route(API + "/history", history, methods=["GET"],
                      **docs("DashboardHistory", errors=keyed))  # fmt: skip
    app.add_api_route(API + "/programs", programs, methods=["GET"],
                      **docs("ProgramList", errors=keyed))  # fmt: skip
    app.add_api_route(API + "/programs", report_program, methods=["POST"],
                      **docs("ProgramId", body="ProgramReport",
                             errors=(*keyed, *BODY_ERRORS)))  # fmt: skip
    app.add_api_route(API + "/events", events, methods=["GET"],
                      **docs(None, events=snapshot_events(), errors=keyed))  # fmt: skip


def _path_arg(endpoint: Callable[[str], Any]) -> Callable[[Request], Any]:
    """A plain route's endpoint takes the request: hand ``endpoint`` its ``name``."""

    async def call(request: Request) -> Any:
        return await endpoint(request.path_params["name"])

    return call
