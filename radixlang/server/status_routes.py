"""The server's status routes: ``/health``, ``/health_generate``, ``/get_model_info``,
``/get_server_info`` (and ``/server_info``), ``/memory`` and ``/metrics`` (Prometheus text)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, PlainTextResponse

from radixlang.runtime.engine import Engine
from radixlang.runtime.request import FinishReason, GenerateRequest
from radixlang.server import metrics
from radixlang.server.api_schema import route_docs
from radixlang.server.common import APIError, submit_all
from radixlang.server.template_check import TemplateCheck, check_template
from radixlang.version import __version__


def router(
    engine: Engine,
    model_name: str,
    counters: metrics.HTTPCounters,
    docs: Callable[..., dict[str, Any]],
    template: TemplateCheck | None = None,
) -> APIRouter:
    """The routes over ``engine``; ``docs(ok, **kw)`` gives a keyed route's OpenAPI answers
    (``/health`` and ``/metrics`` are open: their docs name no 401); ``template`` is the chat
    template's check (made here if not given)."""
    routes = APIRouter()
    template = template or check_template(engine.tokenizer)

    @routes.get("/health", **route_docs("Status", errors=(503,)))  # open: no key needed
    async def health() -> JSONResponse:
        if not engine.is_running:
            raise APIError(503, "the engine is not running", kind="server_error")
        return JSONResponse({"status": "ok"})

    @routes.get("/health_generate", **docs("Status", errors=(503,)))
    async def health_generate() -> JSONResponse:
        """One real token through the whole engine."""
        probe = GenerateRequest(input_ids=[0], sampling={"max_new_tokens": 1, "temperature": 0})
        (handle,) = await submit_all(engine, [probe], [None])
        result = await handle.wait(raise_on_error=False)
        if result.finish_reason is FinishReason.ERROR:
            raise APIError(503, f"the engine failed a probe: {result.error}", kind="server_error")
        return JSONResponse({"status": "ok"})

    @routes.get("/get_model_info", **docs("ModelInfo"))
    async def model_info() -> JSONResponse:
        tok = engine.tokenizer
        tool_format = getattr(engine, "tool_format", None)
        return JSONResponse(
            {
                "model_path": str(engine.files.path),
                "tokenizer_path": str(engine.files.path),
                "served_model_name": model_name,
                "is_generation": True,
                "max_context_length": engine.max_context,
                "vocab_size": engine.runner.vocab_size,
                "chat_template": getattr(tok, "chat_template", None) if tok else None,
                "bos_token": getattr(tok, "bos_token", None) if tok else None,
                "eos_token": getattr(tok, "eos_token", None) if tok else None,
                # How the model writes tool calls (RuntimeEndpoint programs write its calls).
                "tool_call_format": tool_format.as_json() if tool_format else None,
            }
        )

    async def server_info() -> JSONResponse:
        stats = await run_in_threadpool(engine.stats)
        sched = engine.scheduler
        return JSONResponse(
            {
                "version": __version__,
                "model_path": str(engine.files.path),
                "served_model_name": model_name,
                "dtype": str(engine.runner.dtype).removeprefix("torch."),
                "device": str(engine.runner.device),
                "deterministic": engine.deterministic,
                "block_size": engine.pool.block_size,
                "num_blocks": engine.pool.num_blocks,
                "max_context_length": engine.max_context,
                "max_batch_tokens": sched.max_batch_tokens,
                "max_running_requests": sched.max_running_requests,
                "schedule_policy": sched.policy.value,
                # Whether a conversation's next turn extends its last prompt (see
                # template_check.py): if not, the cache loses it from where they differ.
                "chat_template": template.as_json(),
                "stats": stats,
            }
        )

    for path in ("/get_server_info", "/server_info"):
        routes.add_api_route(path, server_info, methods=["GET"], **docs("ServerInfo"),
                             operation_id=path.strip("/") + "_get")  # fmt: skip

    @routes.get("/memory", **docs("MemoryReport"))
    async def memory() -> JSONResponse:
        report = await run_in_threadpool(engine.memory_report)
        return JSONResponse(report.to_dict())

    @routes.get("/metrics", response_class=PlainTextResponse, **route_docs(None, text=True))
    async def prometheus() -> PlainTextResponse:
        stats = await run_in_threadpool(engine.stats)
        return PlainTextResponse(metrics.render(stats, counters), media_type="text/plain")

    return routes
