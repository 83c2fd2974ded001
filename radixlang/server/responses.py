"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request is read into a chat (its ``instructions`` as the system message, then the stored
conversation ``previous_response_id`` names, then its ``input`` items: messages,
``function_call`` and ``function_call_output``), and reaches the engine through the chat
route's own path (``OpenAIRoutes.chat_requests``): the chat template, function tools and
``tool_choice`` under the call grammar, ``text.format`` as ``response_format``. The answer is
output items: a ``message`` with ``output_text``, or ``function_call`` items. Streamed, it is
the Responses API's typed events, each with its ``sequence_number``, ending with
``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut it).

A stored response (``store``, the default) is continued by ``previous_response_id``: the
next turn's prompt is the earlier turn's prompt and answer plus the new input, already in the
radix cache but for the new tokens (``usage.input_tokens_details.cached_tokens`` shows it).

Refused with OpenAI's error shape, naming the field: hosted tools (web search, file search,
computer use, code interpreter, MCP, image generation, ...), image / file / audio inputs,
``background``, ``conversation``, ``prompt`` templates and item references.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixlang.constrain.reasoning import CLOSE as THINK_CLOSE
from radixlang.constrain.reasoning import ReasoningMarkers, ReasoningSplitter
from radixlang.runtime.request import FinishReason, GenerationResult, StreamEvent
from radixlang.server.answer_parts import AnswerParts, Part, PartEvent
from radixlang.server.api_schema import BODY_ERRORS, typed_events
from radixlang.server.common import (
    MAX_BODY_CACHE_SALT_CHARS,
    MAX_RETAIN_S,
    MAX_ROUTING_KEY_CHARS,
    APIError,
    engine_failure,
    merged_events,
    parse_body,
    read_body,
    results_unless_disconnected,
    string_field,
)
from radixlang.server.openai import ChatBody, OpenAIRoutes
from radixlang.server.response_store import ResponseStore, StoredResponse

_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# A response's id, as this server makes them (anything else is a 400 naming the parameter).
ResponseId = Annotated[str, Path(pattern=r"^resp_[0-9a-f]{32}$", max_length=37)]
_ROLES = ("user", "system", "developer", "assistant")


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[dict[str, Any]] = Field(default="")
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Refused when set (see the module's docstring), named here so the refusal can say why.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    # radixlang's, as on the other OpenAI routes
    seed: int | None = None
    top_k: int | None = Field(default=None, ge=-1)
    thinking_budget: int | None = Field(default=None, ge=-1)  # a reasoning model's thinking
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template
    cache_salt: str | None = Field(default=None, max_length=MAX_BODY_CACHE_SALT_CHARS)
    routing_key: str | None = Field(default=None, max_length=MAX_ROUTING_KEY_CHARS)
    retain_s: float | None = Field(default=None, ge=0, le=MAX_RETAIN_S)


def router(openai: OpenAIRoutes, docs: Any, store: ResponseStore | None = None) -> APIRouter:
    """The Responses routes over the OpenAI routes' engine; ``docs(ok, **kw)`` gives a route's
    OpenAPI answers."""
    handlers = ResponsesRoutes(openai, store or ResponseStore())
    routes = APIRouter()
    events = typed_events("ResponseStreamEvent")
    create = docs("Response", body="ResponsesBody", errors=(*BODY_ERRORS, 404, 503),
                  openai=True, events=events)  # fmt: skip
    routes.add_api_route("/v1/responses", handlers.create, methods=["POST"], **create)
    path = "/v1/responses/{response_id}"
    found = docs("Response", openai=True, errors=(400, 404))
    routes.add_api_route(path, handlers.retrieve, methods=["GET"], **found)
    deleted = docs("ResponseDeleted", openai=True, errors=(400, 404))
    routes.add_api_route(path, handlers.delete, methods=["DELETE"], **deleted)
    return routes


def _tenant(request: Request) -> str | None:
    return request.scope.get("state", {}).get("tenant")


class ResponsesRoutes:
    def __init__(self, openai: OpenAIRoutes, store: ResponseStore) -> None:
        self.openai = openai
        self.store = store

    async def retrieve(self, request: Request, response_id: ResponseId) -> JSONResponse:
        stored = self.store.get(response_id, _tenant(request))
        if stored is None:
            raise _not_found(response_id, "response_id")
        return JSONResponse(stored.response)

    async def delete(self, request: Request, response_id: ResponseId) -> JSONResponse:
        if not self.store.delete(response_id, _tenant(request)):
            raise _not_found(response_id, "response_id")
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def create(self, request: Request) -> Response:
        body = await read_body(request, ResponsesBody)
        _refuse_unsupported(body)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id, _tenant(request))
            if stored is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = stored.messages
        turn = input_messages(body.input)
        conversation = history + turn
        if not conversation:
            raise APIError(400, "input is empty (and no previous_response_id)", param="input")
        head = [{"role": "system", "content": body.instructions}] if body.instructions else []
        chat = parse_body(chat_body(body, head + conversation), ChatBody)
        requests, choice = await self.openai.chat_requests(chat)
        handles = await self.openai.submit(request, chat, requests, [None], "input")
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        shell = self._response(body, rid, created)
        markers = self.openai.reasoning_markers
        prompt_ids = requests[0].input_ids or []
        opened = self.openai.thinking_opened(requests[0])
        # A template that opened the thinking block wrote its opening (e.g. "<think>\n") into
        # the prompt: the stored answer starts with it, so the next turn renders it again.
        opening = ""
        if opened and markers is not None:
            at = len(prompt_ids) - 1 - prompt_ids[::-1].index(markers.open_id)
            opening = self.openai.engine.tokenizer.decode(prompt_ids[at:])

        def answer_parts() -> AnswerParts:  # a reasoning model's thinking is an item of its own
            splitter = ReasoningSplitter(opened, markers.texts) if markers is not None else None
            return AnswerParts(choice, _IDS, splitter=splitter)

        def finished(result: GenerationResult, parts: AnswerParts) -> dict[str, Any]:
            response = {**shell, **_outcome(result), "output": [_item(p) for p in parts.parts],
                        "usage": _usage(result, markers)}  # fmt: skip
            if body.store:
                answer = _assistant_message(
                    parts, opening, markers.close_text if markers else THINK_CLOSE
                )
                self.store.put(rid, StoredResponse(_tenant(request),
                                                   [*conversation, *answer], response))  # fmt: skip
            return response

        if body.stream:
            events = _stream(handles[0], shell, answer_parts(), finished)
            return StreamingResponse(events, media_type="text/event-stream")
        results = await results_unless_disconnected(request, handles)
        if results is None:
            return Response(status_code=499)
        parts = answer_parts()
        parts.feed(results[0].text)
        parts.finish()
        return JSONResponse(finished(results[0], parts))

    def _response(self, body: ResponsesBody, rid: str, created: int) -> dict[str, Any]:
        """The response object's fields that do not depend on the answer."""
        text_format = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self.openai.model_name,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None, **(body.reasoning or {})},
            "service_tier": "default",
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": text_format},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_logprobs": 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": body.truncation or "disabled",
            "usage": None,
            "user": body.user,
            "metadata": body.metadata or {},
        }


_IDS = ("msg", "fc")


def _not_found(rid: str, param: str) -> APIError:
    return APIError(404, f"No response found with id {rid!r}", param=param, code="not_found")


def _refuse_unsupported(body: ResponsesBody) -> None:
    for name in ("background", "conversation", "prompt", "max_tool_calls"):
        value = getattr(body, name)
        if value not in (None, False):
            raise APIError(400, f"{name} is not supported by this server", param=name)
    for i, tool in enumerate(body.tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise APIError(400, f"tools[{i}]: {kind!r} tools are not supported by this server; "
                           "only function tools are", param=f"tools[{i}].type")  # fmt: skip


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: messages (text parts joined), ``function_call`` items as
    an assistant message's ``tool_calls`` (consecutive calls in one message), and
    ``function_call_output`` items as ``tool`` messages. Reasoning items are dropped (the
    template renders earlier turns without their thinking)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}] if items else []
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise APIError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got "
                               f"{role!r}", param=f"{where}.role")  # fmt: skip
            role = "system" if role == "developer" else role
            out.append({"role": role, "content": _content_text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": string_field(item, "call_id", where), "type": "function",
                    "function": {"name": string_field(item, "name", where),
                                 "arguments": string_field(item, "arguments", where)}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, where)
            out.append({"role": "tool", "tool_call_id": string_field(item, "call_id", where),
                        "content": text})  # fmt: skip
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}: {kind!r} items are not supported by this server",
                           param=f"{where}.type")  # fmt: skip
    return out


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of parts",
                       param=f"{where}.content")  # fmt: skip
    texts = []
    for j, part in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise APIError(400, f"{here}: {kind!r} parts are not supported by this server; only "
                           "text is", param=f"{here}.type")  # fmt: skip
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise APIError(400, f"{here}.text must be a string", param=f"{here}.text")
        texts.append(text)
    return "".join(texts)


def chat_body(body: ResponsesBody, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body that asks what ``body`` asks."""
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"),
                         ("seed", "seed"), ("top_k", "top_k"), ("cache_salt", "cache_salt"),
                         ("thinking_budget", "thinking_budget"),
                         ("chat_template_kwargs", "chat_template_kwargs"),
                         ("routing_key", "routing_key"), ("retain_s", "retain_s")):  # fmt: skip
        if getattr(body, ours) is not None:
            chat[theirs] = getattr(body, ours)
    if body.tools:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    text_format = (body.text or {}).get("format")
    if text_format is not None:
        chat["response_format"] = _response_format(text_format)
    return chat


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise APIError(400, f"tools[{i}]: unknown field {unknown[0]}",
                       param=f"tools[{i}].{unknown[0]}")  # fmt: skip
    function = {k: v for k, v in tool.items() if k != "type" and v is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                   f'{{"type": "function", "name": ...}}, got {choice!r}',
                   param="tool_choice")  # fmt: skip


def _response_format(text_format: Any) -> dict[str, Any]:
    if not isinstance(text_format, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    kind = text_format.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: text_format[k] for k in ("name", "schema", "strict") if k in text_format}
        return {"type": "json_schema", "json_schema": spec}
    raise APIError(400, "text.format.type must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r}", param="text.format.type")  # fmt: skip


# ---- the answer ----------------------------------------------------------------------------


def _item(part: Part, status: str = "completed") -> dict[str, Any]:
    """An output item: the thinking, a message with its text, or a function call."""
    if part.kind == "reasoning":
        content = [_reasoning_part(part.text)] if status == "completed" else []
        return {"type": "reasoning", "id": part.item_id, "status": status, "summary": [],
                "content": content}  # fmt: skip
    if part.kind == "text":
        content = [_text_part(part.text)] if status == "completed" else []
        return {"type": "message", "id": part.item_id, "status": status, "role": "assistant",
                "content": content}  # fmt: skip
    return {"type": "function_call", "id": part.item_id, "call_id": part.call_id,
            "name": part.name, "arguments": part.text if status == "completed" else "",
            "status": status}  # fmt: skip


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _assistant_message(
    answer: AnswerParts, opening: str = "", close: str = THINK_CLOSE
) -> list[dict[str, Any]]:
    """The answer as the chat message a continuation renders: its thinking kept as written
    (with the markers, and the ``opening`` the template wrote when it opened the block), so an
    append-only template renders the cached tokens again."""
    parts = answer.parts
    text = "".join(p.text for p in parts if p.kind == "text")
    if answer.reasoning is not None and close in answer.raw:
        end = answer.raw.index(close) + len(close)
        rest = answer.raw[end:]
        text = opening + answer.raw[: end + len(rest) - len(rest.lstrip())] + text
    calls = [{"id": p.call_id, "type": "function",
              "function": {"name": p.name, "arguments": p.text}}
             for p in parts if p.kind == "call"]  # fmt: skip
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = calls
    return [message]


def _outcome(result: GenerationResult) -> dict[str, Any]:
    if result.finish_reason is FinishReason.LENGTH:
        return {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    if result.finish_reason is FinishReason.ERROR:
        error = {"code": "server_error", "message": f"generation failed: {result.error}"}
        return {"status": "failed", "error": error}
    if result.finish_reason is FinishReason.ABORT:
        return {"status": "cancelled"}
    return {"status": "completed"}


def _usage(result: GenerationResult, markers: ReasoningMarkers | None = None) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens,
        "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": result.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(result, markers)},
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }


def _reasoning_tokens(result: GenerationResult, markers: ReasoningMarkers | None) -> int:
    """The output's tokens up to and with ``</think>`` (all of it, if cut while thinking)."""
    ids = result.output_ids
    if markers is None or not ids:
        return 0
    if markers.close_id in ids:
        return ids.index(markers.close_id) + 1
    return len(ids) if ids[0] == markers.open_id else 0


async def _stream(
    handle: Any, shell: dict[str, Any], parts: AnswerParts, finished: Any
) -> AsyncIterator[str]:
    """The Responses API's events for one answer, numbered in order."""
    number = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal number
        payload = {"type": kind, "sequence_number": number, **fields}
        number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)

    def part_events(events: Sequence[PartEvent]) -> list[str]:
        out = []
        for e in events:
            part = parts.parts[e.index]
            ids = {"item_id": part.item_id, "output_index": e.index}
            if e.kind == "open":
                out.append(event("response.output_item.added", output_index=e.index,
                                 item=_item(part, "in_progress")))  # fmt: skip
                if part.kind == "text":
                    out.append(event("response.content_part.added", **ids, content_index=0,
                                     part=_text_part("")))  # fmt: skip
            elif e.kind == "delta" and part.kind == "reasoning":
                out.append(event("response.reasoning_text.delta", **ids, content_index=0,
                                 delta=e.piece))  # fmt: skip
            elif e.kind == "delta" and part.kind == "text":
                out.append(event("response.output_text.delta", **ids, content_index=0,
                                 delta=e.piece, logprobs=[]))  # fmt: skip
            elif e.kind == "delta":
                out.append(event("response.function_call_arguments.delta", **ids,
                                 delta=e.piece))  # fmt: skip
            elif part.kind == "reasoning":
                out.append(event("response.reasoning_text.done", **ids, content_index=0,
                                 text=part.text))  # fmt: skip
                out.append(event("response.output_item.done", output_index=e.index,
                                 item=_item(part)))  # fmt: skip
            elif part.kind == "text":
                out.append(event("response.output_text.done", **ids, content_index=0,
                                 text=part.text, logprobs=[]))  # fmt: skip
                out.append(event("response.content_part.done", **ids, content_index=0,
                                 part=_text_part(part.text)))  # fmt: skip
                out.append(event("response.output_item.done", output_index=e.index,
                                 item=_item(part)))  # fmt: skip
            else:
                out.append(event("response.function_call_arguments.done", **ids,
                                 name=part.name, arguments=part.text))  # fmt: skip
                out.append(event("response.output_item.done", output_index=e.index,
                                 item=_item(part)))  # fmt: skip
        return out

    async for _, item in merged_events([handle]):
        if isinstance(item, GenerationResult):
            if item.finish_reason is FinishReason.ERROR:
                failure = engine_failure(item)
                yield event("error", code="server_error", message=failure.message, param=None)
                return
            for text in part_events(parts.finish()):
                yield text
            response = finished(item, parts)
            kind = "response.incomplete" if response["status"] == "incomplete" else None
            yield event(kind or "response.completed", response=response)
            return
        if isinstance(item, StreamEvent) and item.text:
            for text in part_events(parts.feed(item.text)):
                yield text
