"""What every HTTP route shares: JSON errors that name the field, strict body parsing, engine
submission that fails as a whole, server-sent events, and waiting on requests while watching
for the client to go away (a client that leaves aborts its requests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from functools import lru_cache
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse

from radixlang.runtime.engine import EngineClosedError, RequestError
from radixlang.runtime.handle import RequestHandle
from radixlang.runtime.request import (
    FinishReason,
    GenerateRequest,
    GenerationResult,
    StreamEvent,
)
from radixlang.runtime.sampling import SamplingParams

M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 64 * 2**20
SSE_DONE = "data: [DONE]\n\n"
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|dict|list|.*\[.*\]|function-.*)$")
_SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's shape,
    which SGLang's clients also read).

    ``code`` differs by API: OpenAI's routes answer OpenAI's machine-readable string (such as
    ``"model_not_found"``) or null, as OpenAI documents; the other routes answer the HTTP
    status, which radixlang's and SGLang's clients read from an error sent mid-stream.
    """

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.headers = headers
        self.code = code

    def body(self, openai: bool = False) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code if openai else self.status,
            }
        }

    def response(self, openai: bool = False) -> JSONResponse:
        return JSONResponse(self.body(openai), status_code=self.status, headers=self.headers)


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is one of the OpenAI API's (its errors take OpenAI's ``code``)."""
    return path.startswith("/v1/") and not is_anthropic_path(path)


def string_field(item: dict[str, Any], key: str, where: str) -> str:
    """``item[key]``, which must be a string; a 400 naming ``where.key`` otherwise."""
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is Anthropic's Messages API (its errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


# Anthropic's error types, by HTTP status.
_ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    default = "api_error" if status >= 500 else "invalid_request_error"
    kind = _ANTHROPIC_ERROR_TYPES.get(status, default)
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError, path: str) -> JSONResponse:
    """``error`` answered in the shape of ``path``'s API: Anthropic's, OpenAI's or the native
    routes' (SGLang's)."""
    if is_anthropic_path(path):
        body = anthropic_error(error.status, error.message)
        return JSONResponse(body, status_code=error.status, headers=error.headers)
    return error.response(is_openai_path(path))


async def read_body(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``; a 4xx ``APIError`` naming what is wrong."""
    return parse_body(await read_json(request), model)


def parse_body(data: dict[str, Any], model: type[M]) -> M:
    """``data`` (a request's JSON object) as ``model``; a 400 naming the field if it does not
    fit."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


async def read_json(request: Request) -> dict[str, Any]:
    """The request's JSON object; a 4xx ``APIError`` if it is not one."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise APIError(
            415,
            f"Content-Type must be application/json, got {ctype or 'none'}",
            kind="invalid_request_error",
        )
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is {length} bytes; the limit is {MAX_BODY_BYTES}")
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    return data


# The longest ``cache_salt`` a request body may carry. With an API-keys file the tenant's name
# (at most config.MAX_TENANT_CHARS) and a separator go before it: the engine's limit
# (runtime.request.MAX_CACHE_SALT_CHARS) holds all three (tests/server/test_route_modules.py).
MAX_BODY_CACHE_SALT_CHARS = 256


def cache_salt(request: Request, salt: str | None) -> str:
    """The radix-cache salt of a request whose body has ``cache_salt`` (its type and length
    checked with the body): with an API-keys file, the key's tenant comes first, so tenants
    never share cached prefixes, even with one salt."""
    salt = salt or ""
    tenant = request_tenant(request)
    return salt if tenant is None else f"{tenant}\0{salt}"


def request_tenant(request: Request) -> str | None:
    """The tenant of the request's API key (an API-keys file's name for it), else None."""
    return request.scope.get("state", {}).get("tenant")


# The header a client names a routing key with where its body has no field for it.
ROUTING_KEY_HEADER = "x-routing-key"
MAX_ROUTING_KEY_CHARS = 256
# The longest retain_s a body may give (the engine cuts it further, to its retain_max_s).
MAX_RETAIN_S = 3600.0


def routing_key(request: Request, key: str | None) -> str | None:
    """The routing key of a request (the body's ``routing_key``, else the ``X-Routing-Key``
    header) as the engine takes it: the request's program (whose retentions
    ``/release_program`` ends), and, in front of several replicas, what keeps its requests on
    one replica. With an API-keys file the key's tenant comes first (as in :func:`cache_salt`),
    so one tenant's key never names another's program, even spelt the same."""
    if key is None:
        key = request.headers.get(ROUTING_KEY_HEADER) or None
        if key is not None and len(key) > MAX_ROUTING_KEY_CHARS:
            raise APIError(400, f"the {ROUTING_KEY_HEADER} header is longer than "
                           f"{MAX_ROUTING_KEY_CHARS} characters", param="routing_key")  # fmt: skip
    tenant = request_tenant(request)
    return key if key is None or tenant is None else f"{tenant}\0{key}"


def validation_error(error: ValidationError) -> APIError:
    """A problem pydantic found, as a 400 naming the field by its path."""
    errors = error.errors()
    # Of a union's alternatives, the one that got furthest into the value says most.
    first = max(errors, key=lambda e: len(e["loc"]))
    # pydantic names the union member tried ("text.str", "prompt.list[int]"): drop those.
    parts = [str(p) for p in first["loc"] if not (isinstance(p, str) and _TYPE_TAG.match(p))]
    path = ".".join(parts) or None
    if first["type"] == "missing":
        message = f"{path} is required"
    elif first["type"] == "extra_forbidden":
        message = f"unknown field {path}"
    else:
        message = f"{path}: {first['msg']}"
        if "input" in first and not isinstance(first["input"], dict | list):
            message += f" (got {first['input']!r})"
    return APIError(400, message, param=path)


def sampling_field(message: str) -> str | None:
    """The sampling field an engine error message starts with (they all name it first)."""
    m = re.match(r"[a-z_]+", message)
    return m.group(0) if m and m.group(0) in _SAMPLING_FIELDS else None


# Given a request's index and the sampling field an engine error names, the body's path to that
# field ("sampling_params.json_schema", "response_format.json_schema.schema"), or None.
SamplingParamPath = Callable[[int, str], "str | None"]


def rejected(
    error: RequestError,
    where: str | None,
    prompt_field: str,
    path: str | None = None,
) -> APIError:
    """A request the engine refused, as a 400 naming the field (and the batch item): a
    sampling field (as ``path`` when the body spells it otherwise), or else the prompt (too
    long, empty, ids out of range)."""
    message = str(error)
    field = sampling_field(message)
    if field is not None and path is not None:
        # The body's own name for the field, in the message too: "sampling_params.regex: ..."
        return APIError(400, path + message[len(field) :], param=path)
    param = field or where or prompt_field
    return APIError(400, f"{where}: {message}" if where else message, param=param)


async def submit_all(
    engine: Any,
    requests: Sequence[GenerateRequest],
    where: Sequence[str | None],
    prompt_field: str = "prompt",
    max_queued: int | None = None,
    sampling_path: SamplingParamPath | None = None,
) -> list[RequestHandle]:
    """Submit every request, or none: one refused request aborts those already queued. With
    ``max_queued``, a body that would take the queue past it is refused with a 503. An error
    about a sampling field names it as ``sampling_path(index, field)`` says, if given."""
    if max_queued is not None and engine.num_waiting + len(requests) > max_queued:
        raise APIError(
            503,
            f"the server is overloaded: {engine.num_waiting} requests are queued (limit "
            f"{max_queued}); retry shortly",
            kind="server_overloaded",
            headers={"Retry-After": "1"},
        )

    def submit() -> list[RequestHandle]:
        handles: list[RequestHandle] = []
        try:
            for i, (request, place) in enumerate(zip(requests, where, strict=True)):
                try:
                    handles.append(engine.submit(request))
                except RequestError as e:
                    field = sampling_field(str(e))
                    path = sampling_path(i, field) if sampling_path and field else None
                    raise rejected(e, place, prompt_field, path) from None
        except BaseException:
            for h in handles:
                h.abort()
            raise
        return handles

    try:
        # Tokenizing and compiling a regex can take a while: keep the event loop free.
        return await run_in_threadpool(submit)
    except EngineClosedError as e:
        raise APIError(503, f"the engine is shut down: {e}", kind="server_error") from None


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has gone (the body is already read, so only that can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def results_unless_disconnected(
    request: Request, handles: Sequence[RequestHandle]
) -> list[GenerationResult] | None:
    """Every request's result; None (and the requests aborted) if the client leaves first. A
    request the engine failed raises a 500 naming the failure."""
    results = asyncio.ensure_future(
        asyncio.gather(*(h.wait(raise_on_error=False) for h in handles))
    )
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not results.done():
            results.cancel()  # its CancelledError is read, so asyncio does not log it
            results.add_done_callback(lambda f: f.cancelled() or f.exception())
            for h in handles:
                h.abort()
    if not results.done() or results.cancelled():
        return None
    for result in results.result():
        if result.finish_reason is FinishReason.ERROR:
            raise engine_failure(result)
    return results.result()


async def merged_events(
    handles: Sequence[RequestHandle],
) -> AsyncIterator[tuple[int, StreamEvent | GenerationResult]]:
    """Every handle's events as they come, tagged with the handle's index; each handle's last
    item is its result. Leaving early (a client gone) aborts every request still running."""
    batches = event_batches(handles)
    try:
        async for batch in batches:
            for item in batch:
                yield item
    finally:
        await batches.aclose()


async def event_batches(
    handles: Sequence[RequestHandle],
) -> AsyncIterator[list[tuple[int, StreamEvent | GenerationResult]]]:
    """:func:`merged_events`, as lists: each holds every item that had come when the list was
    taken (so a stream may send what came together as one piece). Leaving early (a client gone)
    aborts every request still running."""
    queue: asyncio.Queue[tuple[int, StreamEvent | GenerationResult]] = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        async for event in handle.stream():
            queue.put_nowait((i, event))
        queue.put_nowait((i, await handle.wait(raise_on_error=False)))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        finished = 0
        while finished < len(handles):
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            yield batch
            finished += sum(isinstance(item, GenerationResult) for _, item in batch)
    finally:
        for task in tasks:
            task.cancel()
        for h in handles:
            h.abort()  # a no-op for finished requests


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def engine_failure(result: GenerationResult) -> APIError:
    return APIError(500, f"generation failed: {result.error}", kind="server_error")


class TokenTexts:
    """Each token id's own text (for logprobs), decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        if self._tokenizer is None:
            return ""
        with contextlib.suppress(Exception):
            return self._tokenizer.decode([token_id])
        return ""


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the character that stands for each byte in a
    token's string. Printable Latin-1 bytes stand for themselves; the other 68 bytes take the
    characters from U+0100 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars: dict[str, int] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(0x100 + shifted)] = byte
            shifted += 1
    return chars


_BYTE_LEVEL = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_types(tokenizer: Any) -> set[str]:
    """The types of a fast tokenizer's decoder (a Sequence's members too); empty if unknown."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    try:
        state = json.loads(decoder.__getstate__())
    except Exception:
        return set()
    members = state.get("decoders") or [state]
    return {str(m.get("type")) for m in members if isinstance(m, dict)}


class TokenBytes:
    """Each token id's own bytes, for OpenAI's logprobs ``bytes``: a token that holds part of a
    UTF-8 character has those bytes, not the replacement character its decoded text shows.

    Byte-level BPE tokenizers (GPT-2's alphabet) map each character of the token's string back
    to its byte; SentencePiece-style ones give ``<0xHH>`` byte tokens and ``▁`` for a space;
    anything else falls back to the UTF-8 of the token's decoded text.
    """

    def __init__(self, tokenizer: Any, texts: TokenTexts) -> None:
        self._tokenizer = tokenizer
        self._texts = texts
        self._byte_level = "ByteLevel" in _decoder_types(tokenizer)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> list[int]:
        piece = None
        if self._tokenizer is not None:
            with contextlib.suppress(Exception):
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece:
            if self._byte_level and all(c in _BYTE_LEVEL for c in piece):
                return [_BYTE_LEVEL[c] for c in piece]
            if not self._byte_level:
                fallback = _BYTE_FALLBACK.match(piece)
                if fallback:
                    return [int(fallback.group(1), 16)]
                if "\u2581" in piece:
                    return list(piece.replace("\u2581", " ").encode())
        return list(self._texts.text(token_id).encode())
