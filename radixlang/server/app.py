"""The HTTP server over one :class:`~radixlang.runtime.engine.Engine` (FastAPI on uvicorn).

Routes, each module's ``APIRouter`` (importable and testable alone), wired by
:func:`create_app`:

- ``native``: SGLang's ``POST /generate``; ``openai``: ``POST /v1/completions``,
  ``POST /v1/chat/completions``, ``GET /v1/models``;
- ``status_routes``: ``GET /health``, ``GET /health_generate``, ``GET /get_model_info``,
  ``GET /get_server_info`` (and ``/server_info``), ``GET /memory`` (the engine's
  ``memory_report()``), ``GET /metrics`` (Prometheus text);
- ``cache_routes``: ``/flush_cache`` (``?timeout=``), ``GET /kv_events``, ``POST /save_cache``
  (the radix cache to ``--cache-dir`` now; it is also saved at shutdown), ``POST
  /release_program`` (a program's retained paths, by its routing key);
- ``token_routes``: ``POST /tokenize``, ``POST /detokenize``, ``POST /abort_request``,
  ``POST /concate_and_append_request``;
- ``dashboard``: ``/dashboard`` and its JSON API;
- ``GET /openapi.json``: the OpenAPI schema of all of these, bodies, answers and errors
  included (see ``api_schema``).

Every refused request gets a 4xx JSON error naming the field; the engine checks what it is
given at submission, so no request can leave it in a bad state. A client that disconnects
aborts its requests. On shutdown uvicorn first lets requests in flight finish (up to
``drain_timeout``), then the engine aborts the rest and every KV block is freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import signal
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from radixlang.config import load_api_keys
from radixlang.runtime.engine import Engine
from radixlang.server import (
    cache_routes,
    messages,
    metrics,
    native,
    openai,
    responses,
    status_routes,
    token_routes,
)
from radixlang.server.api_schema import components, route_docs
from radixlang.server.common import (
    APIError,
    TokenTexts,
    error_response,
)
from radixlang.server.dashboard import Dashboard, ProgramReport, add_routes
from radixlang.server.openai import ChatBody, CompletionBody
from radixlang.server.template_check import check_template
from radixlang.version import __version__

log = logging.getLogger(__name__)

# Routes counted by name in /metrics; any other path is counted as "other".
_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses",
           "/v1/messages", "/v1/models", "/health",
           "/health_generate", "/get_model_info", "/get_server_info", "/server_info",
           "/flush_cache", "/metrics", "/abort_request", "/concate_and_append_request",
           "/tokenize", "/detokenize", "/memory", "/dashboard", "/dashboard/api/snapshot",
           "/dashboard/api/history", "/dashboard/api/programs",
           "/dashboard/api/events")  # fmt: skip


class _RequireKey:
    """With ``--api-key`` or ``--api-keys-file``: every route but /health, /metrics and the
    dashboard's page (static code, no data) needs ``Authorization: Bearer <key>`` (what SGLang's
    and OpenAI's clients send) or ``x-api-key: <key>`` (what Anthropic's send). With a keys
    file the key's tenant goes into the request's state (``tenant``), which salts its cache use,
    scopes its routing keys (its programs' retentions) and owns its stored responses. The
    dashboard's API shows every tenant's prompts, so a tenant's key gets a 403 there: only the
    operator's ``--api-key`` opens it."""

    OPEN = ("/health", "/metrics", "/dashboard")
    OPEN_PREFIX = "/dashboard/static/"
    OPERATOR_ONLY = "/dashboard/api/"

    def __init__(
        self, app: Any, api_key: str | None = None, tenants: Mapping[str, str] | None = None
    ) -> None:
        self.app = app
        self.keys: list[tuple[bytes, bytes, str | None]] = []  # the header, the key, its tenant
        if api_key:
            self.keys.append((f"Bearer {api_key}".encode(), api_key.encode(), None))
        for key, tenant in (tenants or {}).items():
            self.keys.append((f"Bearer {key}".encode(), key.encode(), tenant))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path and path not in self.OPEN and not path.startswith(self.OPEN_PREFIX):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            given_key = headers.get(b"x-api-key", b"")  # Anthropic's clients send the key so
            # Every key is compared, in constant time, whatever matched before: how long the
            # check takes says nothing about which key (or how much of one) was right.
            found, tenant = False, None
            for expected, key, name in self.keys:
                match = hmac.compare_digest(given, expected) | hmac.compare_digest(given_key, key)
                if match and not found:
                    found, tenant = True, name
            if found and tenant is not None:
                scope["state"] = {**scope.get("state", {}), "tenant": tenant}
            if not found:
                error = APIError(401, "a valid API key is required: Authorization: Bearer <key>",
                                 kind="authentication_error", code="invalid_api_key")  # fmt: skip
                await error_response(error, scope["path"])(scope, receive, send)
                return
            if tenant is not None and path.startswith(self.OPERATOR_ONLY):
                error = APIError(403, "the dashboard shows every tenant's requests: it needs the "
                                 "server's --api-key, not a tenant's key",
                                 kind="permission_error", code="forbidden")  # fmt: skip
                await error.response(False)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _CountRequests:
    """Counts answers by route and status for /metrics (plain ASGI, so streams and client
    disconnects pass through untouched)."""

    def __init__(self, app: Any, counters: metrics.HTTPCounters) -> None:
        self.app = app
        self.counters = counters

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        route = scope["path"] if scope["path"] in _ROUTES else "other"
        self.counters.in_flight += 1
        try:
            await self.app(scope, receive, send_counted)
        finally:
            self.counters.in_flight -= 1
            self.counters.requests[(route, status)] += 1


class _InternalErrors:
    """Answers an unexpected exception with a JSON 500 that names it, and goes on. (Starlette's
    own handler re-raises after answering, and uvicorn then closes the connection, so a client
    that reuses it next finds it dead.) After a response has started nothing can be said: the
    exception goes on up, and the connection closes mid-answer, as it must."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as e:
            if started:
                raise
            log.exception("request to %s failed", scope["path"])
            error = APIError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error")
            await error_response(error, scope["path"])(scope, receive, send)


def create_app(
    engine: Engine,
    served_model_name: str | None = None,
    owns_engine: bool = False,
    api_key: str | None = None,
    max_queued_requests: int | None = None,
    allowed_origins: list[str] | None = None,
    api_keys_file: str | None = None,
    api_keys: Mapping[str, str] | None = None,
    dashboard: bool = True,
    dashboard_interval: float = 1.0,
    dashboard_max_nodes: int = 150,
) -> FastAPI:
    """The server's ASGI app. With ``owns_engine`` the app's shutdown stops the engine and
    frees every KV block; with ``api_key`` requests must carry it; ``max_queued_requests``
    refuses work (503, Retry-After) past that many queued requests; ``allowed_origins`` lets
    browser pages on those origins call the API (CORS). ``api_keys`` (API key -> tenant name)
    or ``api_keys_file`` (the same in a JSON or TOML file): requests must carry one of those
    keys (or ``api_key``), and each tenant's requests reuse only its own cached prefixes.
    ``dashboard`` serves the live page at /dashboard, its snapshots ``dashboard_interval``
    seconds apart, its tree cut to the ``dashboard_max_nodes`` largest nodes (``dashboard``)."""
    model_name = served_model_name or engine.files.name
    texts = TokenTexts(engine.tokenizer)
    counters = metrics.HTTPCounters()
    board = Dashboard(engine, model_name, dashboard_interval, dashboard_max_nodes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        if dashboard:
            board.start()
        yield
        await board.stop()
        if owns_engine:
            await run_in_threadpool(engine.shutdown, True)
            log.info("engine stopped; every KV block is free")

    app = FastAPI(title="radixlang", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.dashboard = board
    app.state.counters = counters
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )
    tenants = dict(api_keys or {})
    if api_keys_file:
        tenants.update(load_api_keys(api_keys_file))
    auth = bool(api_key or tenants)
    if auth:
        app.add_middleware(_RequireKey, api_key=api_key, tenants=tenants)
    app.add_middleware(_InternalErrors)
    app.add_middleware(_CountRequests, counters=counters)  # outermost: counts refusals too

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e, request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        error = APIError(e.status_code, str(e.detail), kind="invalid_request_error")
        return error_response(error, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        where = [str(part) for part in first.get("loc", ())[1:]]  # ("path", "response_id")
        param = ".".join(where) or None
        message = str(first.get("msg", e))
        error = APIError(400, f"{param}: {message}" if param else message, param=param)
        return error_response(error, request.url.path)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("request to %s failed", request.url.path)
        message = f"internal error: {type(e).__name__}: {e}"
        return error_response(APIError(500, message, kind="server_error"), request.url.path)

    # The routes, each module's on its own router; the OpenAPI schema (/openapi.json) gives
    # every route's body, answers and errors (api_schema), with a 401 where keys are needed.
    def docs(ok: str | None, **kw: Any) -> dict[str, Any]:
        return route_docs(ok, auth=auth, **kw)

    app.include_router(native.router(engine, texts, docs, max_queued_requests))
    chat = openai.OpenAIRoutes(engine, model_name, texts, max_queued_requests=max_queued_requests)
    app.include_router(openai.router(engine, model_name, texts, docs, max_queued_requests, chat))
    app.include_router(responses.router(chat, docs))
    app.include_router(messages.router(chat, docs))
    template = check_template(engine.tokenizer)
    if template.append_only is False:
        log.warning(
            "the chat template is not append-only: a conversation's next turn does not extend "
            "its last prompt, so the cache computes it again from where they differ (%s)",
            template.detail,
        )
    app.include_router(status_routes.router(engine, model_name, counters, docs, template))
    app.include_router(cache_routes.router(engine, docs))
    app.include_router(token_routes.router(engine, model_name, docs))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            bodies = [("CompletionBody", CompletionBody), ("ChatBody", ChatBody),
                      ("ResponsesBody", responses.ResponsesBody),
                      ("MessagesBody", messages.MessagesBody),
                      *token_routes.BODIES, *cache_routes.BODIES,
                      ("ProgramReport", ProgramReport)]  # fmt: skip
            found = schema.setdefault("components", {})
            found.setdefault("schemas", {}).update(components(bodies))
            if auth:
                found["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, operations in schema["paths"].items():
                    if path not in _RequireKey.OPEN:
                        for operation in operations.values():
                            operation["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if dashboard:
        add_routes(app, board, docs)
    return app


def _config(app: Any, host: str, port: int, drain_timeout: float, log_level: str) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=drain_timeout,
    )


def serve(
    engine: Engine,
    host: str = "127.0.0.1",
    port: int = 30000,
    served_model_name: str | None = None,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    **app_options: Any,
) -> None:
    """Serve until interrupted (Ctrl-C, SIGTERM); then drain, stop the engine, free blocks.
    ``app_options`` go to :func:`create_app` (``api_key``, ``max_queued_requests``, ...)."""
    import uvicorn

    app = create_app(engine, served_model_name, owns_engine=True, **app_options)
    # The model's and tokenizer's objects live as long as the server: keep them out of the
    # garbage collector's full passes, which otherwise stall a request now and then (~0.15 s).
    gc.collect()
    gc.freeze()
    # uvicorn re-raises the signal that stopped it once it has shut down cleanly: for SIGINT
    # that is a KeyboardInterrupt, for SIGTERM (a service manager's stop) the handler below;
    # both are the normal end, exit status 0.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    server = uvicorn.Server(_config(app, host, port, drain_timeout, log_level))
    app.state.dashboard.closing = lambda: server.should_exit  # open pages must not hold a drain
    try:
        with contextlib.suppress(KeyboardInterrupt, _Terminated):
            server.run()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class _Terminated(Exception):
    """SIGTERM arrived after uvicorn's own shutdown."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated


class ServerThread:
    """A server on a thread of this process (tests, notebooks): ``url``, ``stop()``."""

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str | None = None,
        owns_engine: bool = False,
        drain_timeout: float = 5.0,
        log_level: str = "warning",
        **app_options: Any,
    ) -> None:
        import uvicorn

        self.app = create_app(engine, served_model_name, owns_engine, **app_options)
        self.engine = engine
        # Bind first, so port 0 becomes a real free port before anyone needs the URL.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._server = uvicorn.Server(_config(self.app, host, port, drain_timeout, log_level))
        self.app.state.dashboard.closing = lambda: self._server.should_exit
        self._failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="radixlang-http", daemon=True)
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            self._thread.join(0.01)
        if not self._server.started:
            raise RuntimeError(f"the server did not start: {self._failure or 'see the log'}")

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._socket]))
        except BaseException as e:
            self._failure.append(e)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join()
        with contextlib.suppress(OSError):
            self._socket.close()

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serve_in_thread(engine: Engine, **kwargs: Any) -> Iterator[ServerThread]:
    """``with serve_in_thread(engine) as server: httpx.get(server.url + "/health")``."""
    server = ServerThread(engine, **kwargs)
    try:
        yield server
    finally:
        server.stop()
