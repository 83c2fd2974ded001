"""The server's cache routes: ``/flush_cache`` (GET or POST, ``?timeout=``), ``/kv_events``
(``?after=``; docs/scale-out.md), ``/save_cache`` and ``/release_program`` (a program ended:
the paths its calls asked to retain can go)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from radixlang.runtime.engine import CacheBusyError, Engine
from radixlang.server.api_schema import BODY_ERRORS
from radixlang.server.common import (
    MAX_ROUTING_KEY_CHARS,
    ROUTING_KEY_HEADER,
    APIError,
    read_body,
    routing_key,
)

TIMEOUT_QUERY = {"name": "timeout", "in": "query", "required": False,
                 "description": "Seconds to wait for requests in flight to finish (default 0).",
                 "schema": {"type": "number", "minimum": 0}}  # fmt: skip
AFTER_QUERY = {"name": "after", "in": "query", "required": False,
               "description": "The last event number already read (default 0: from the start).",
               "schema": {"type": "integer", "minimum": 0}}  # fmt: skip


class ReleaseProgramBody(BaseModel):
    """``POST /release_program``: the program whose retentions end, by the routing key its
    calls carried (else the ``X-Routing-Key`` header names it)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    routing_key: str | None = Field(default=None, min_length=1, max_length=MAX_ROUTING_KEY_CHARS)


BODIES = [("ReleaseProgramBody", ReleaseProgramBody)]


def router(engine: Engine, docs: Callable[..., dict[str, Any]]) -> APIRouter:
    """The routes over ``engine``; ``docs(ok, **kw)`` gives a route's OpenAPI answers."""
    routes = APIRouter()

    async def flush_cache(request: Request) -> JSONResponse:
        """SGLang's contract: 200 once flushed, 400 while requests are in flight after waiting
        up to ``?timeout=`` seconds (default 0) for them to finish."""
        timeout = flush_timeout(request.query_params.get("timeout"))
        try:
            await run_in_threadpool(engine.flush_cache, timeout)
        except CacheBusyError as e:
            raise APIError(400, str(e), kind="cache_busy") from None
        return JSONResponse({"success": True, "message": "Cache flushed."})

    flush_docs = docs("FlushResult", errors=(400,), query=[TIMEOUT_QUERY])
    for method in ("GET", "POST"):
        operation = f"flush_cache_{method.lower()}"
        routes.add_api_route(
            "/flush_cache", flush_cache, methods=[method], operation_id=operation, **flush_docs
        )

    @routes.get("/kv_events", **docs("KvEvents", errors=(400,), query=[AFTER_QUERY]))
    async def kv_events(request: Request) -> JSONResponse:
        """The KV events after number ``?after=`` (docs/scale-out.md); where the log no longer
        holds them all, ``gap`` and a ``snapshot`` of every cached block's hash instead."""
        if not getattr(engine, "kv_events_enabled", False):
            raise APIError(400, "the server was started without --kv-events", kind="no_kv_events")
        seq = after_number(request.query_params.get("after"))
        events, gap = await run_in_threadpool(engine.kv_events_since, seq)
        body: dict[str, Any] = {"gap": gap, "block_size": engine.pool.block_size}
        if gap:
            last, nodes = await run_in_threadpool(engine.kv_block_media)
            body |= {"last_seq": last, "events": [], "snapshot": [
                {"salt_seed": s, "hashes": h, "medium": m} for s, h, m in nodes]}  # fmt: skip
        else:
            body |= {"last_seq": events[-1].seq if events else seq,
                     "events": [e.to_dict() for e in events]}  # fmt: skip
        return JSONResponse(body)

    @routes.post("/save_cache", **docs("SaveCacheResult", errors=(400,)))
    async def save_cache() -> JSONResponse:
        """Save the radix cache to the engine's ``cache_dir`` now (it is also saved at
        shutdown); 400 when the server was started without one."""
        if engine.cache_dir is None:
            raise APIError(400, "the server was started without --cache-dir", kind="no_cache_dir")
        saved = await run_in_threadpool(engine.save_cache)
        return JSONResponse({"success": True, **saved})

    @routes.post(
        "/release_program",
        **docs("ReleaseResult", body="ReleaseProgramBody", errors=BODY_ERRORS),
    )
    async def release_program(request: Request) -> JSONResponse:
        """A program ended: end the retentions of the paths its calls asked to keep
        (``retain_s``) rather than wait for their deadline. ``released``: how many paths were
        retained for it (0 for a key unknown or already released: not an error)."""
        body = await read_body(request, ReleaseProgramBody)
        # The same scoping as the calls' own keys: a tenant releases only its own programs.
        key = routing_key(request, body.routing_key)
        if key is None:
            raise APIError(400, f"routing_key is required (in the body, or the "
                           f"{ROUTING_KEY_HEADER} header)", param="routing_key")  # fmt: skip
        released = await run_in_threadpool(engine.release_retained, key)
        return JSONResponse({"success": True, "released": released})

    return routes


def after_number(value: str | None) -> int:
    """``/kv_events``' ``after`` query parameter: an event number >= 0."""
    if value is None:
        return 0
    if not (value.isascii() and value.isdigit()):
        raise APIError(400, f"after must be an event number >= 0, got {value!r}", param="after")
    return int(value)


def flush_timeout(value: str | None) -> float:
    """``/flush_cache``'s ``timeout`` query parameter: seconds to wait, finite and >= 0."""
    if value is None:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise APIError(400, f"timeout must be seconds >= 0, got {value!r}", param="timeout")
    return seconds
