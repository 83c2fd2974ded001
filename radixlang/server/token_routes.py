"""The server's token and request routes: ``/tokenize``, ``/detokenize``, ``/abort_request``
and SGLang's ``/concate_and_append_request``, with their bodies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse

from radixlang.runtime.engine import Engine
from radixlang.server.api_schema import BODY_ERRORS
from radixlang.server.common import APIError, read_body


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str
    add_special_tokens: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int]


class AbortBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    rid: str


class ConcatBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    src_rids: list[str]
    dst_rid: str


BODIES = [("TokenizeBody", TokenizeBody), ("DetokenizeBody", DetokenizeBody),
          ("AbortBody", AbortBody), ("ConcatBody", ConcatBody)]  # fmt: skip


def router(engine: Engine, model_name: str, docs: Callable[..., dict[str, Any]]) -> APIRouter:
    """The routes over ``engine``; ``docs(ok, **kw)`` gives a route's OpenAPI answers."""
    routes = APIRouter()

    @routes.post("/tokenize", **docs("TokenizeResult", body="TokenizeBody", errors=BODY_ERRORS))
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_body(request, TokenizeBody)
        if engine.tokenizer is None:
            raise APIError(400, f"model {model_name} has no tokenizer", param="text")
        ids = engine.tokenizer.encode(body.text, add_special_tokens=body.add_special_tokens)
        return JSONResponse(
            {"tokens": list(ids), "count": len(ids), "max_model_len": engine.max_context}
        )

    @routes.post(
        "/detokenize", **docs("DetokenizeResult", body="DetokenizeBody", errors=BODY_ERRORS)
    )
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_body(request, DetokenizeBody)
        vocab = engine.runner.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens holds ids outside [0, {vocab}): {bad[:5]}",
                           param="tokens")  # fmt: skip
        text = engine.tokenizer.decode(body.tokens) if engine.tokenizer else ""
        return JSONResponse({"text": text})

    @routes.post("/abort_request", **docs("Success", body="AbortBody", errors=BODY_ERRORS))
    async def abort_request(request: Request) -> JSONResponse:
        body = await read_body(request, AbortBody)
        engine.abort(body.rid)
        return JSONResponse({"success": True})

    @routes.post(
        "/concate_and_append_request", **docs("Success", body="ConcatBody", errors=BODY_ERRORS)
    )
    async def concate_and_append(request: Request) -> JSONResponse:
        # SGLang joins forked branches' KV into the parent here, approximately (positions are
        # not re-encoded). Its client then sends the joined text with the next request, which
        # the radix cache serves exactly: reused where cached, computed where not.
        await read_body(request, ConcatBody)
        return JSONResponse({"success": True})

    return routes
