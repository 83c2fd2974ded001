"""Anthropic's Messages API: ``POST /v1/messages``, so the official ``anthropic`` client (and
the tools built on it) works against this server.

A request is read into a chat (``system``, then the messages: text blocks joined, an
assistant's ``tool_use`` blocks as its tool calls, a user's ``tool_result`` blocks as tool
messages) and reaches the engine through the chat route's own path
(``OpenAIRoutes.chat_requests``): the chat template, ``tools`` (``input_schema``) and
``tool_choice`` (auto, any, tool, none) under the call grammar, ``output_config.format`` (a
JSON schema) as the chat's ``response_format``. The answer is content blocks:
``text``, then ``tool_use`` blocks with their parsed ``input``; ``stop_reason`` is
``end_turn``, ``max_tokens``, ``stop_sequence`` (with the one matched) or ``tool_use``.
Streamed, it is Anthropic's event sequence: ``message_start``, per block
``content_block_start`` / ``content_block_delta`` (``text_delta`` or ``input_json_delta``) /
``content_block_stop``, then ``message_delta`` (the stop reason and usage) and
``message_stop``.

``usage`` counts as Anthropic does: ``input_tokens`` are the prompt tokens computed,
``cache_read_input_tokens`` those the radix cache already held. Errors take Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``); with ``--api-key`` the key may come as
``x-api-key``. Image and document blocks, server tools and MCP servers are refused, naming the
field. A reasoning model's thinking is a ``thinking`` block first (``thinking_delta``s when
streamed), and ``thinking: {"type": "enabled", "budget_tokens": n}`` bounds it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixlang.constrain.reasoning import ReasoningMarkers, ReasoningSplitter
from radixlang.runtime.request import FinishReason, GenerationResult, StreamEvent
from radixlang.server.answer_parts import AnswerParts, Part, PartEvent, whole_answer
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

_IDS = ("msg", "toolu")
# A streamed block's deltas, by the part it streams: their type, and the field of the piece.
_DELTAS = {"reasoning": {"type": "thinking_delta"}, "text": {"type": "text_delta"},
           "call": {"type": "input_json_delta"}}  # fmt: skip
_DELTA_FIELDS = {"reasoning": "thinking", "text": "text", "call": "partial_json"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class MessagesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # ``format``: a JSON schema the answer follows
    # Accepted and ignored: caching here is automatic (every prefix is cached, nothing to mark),
    # and the others ask nothing of a local model.
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: Any = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Refused when set (see the module's docstring).
    container: Any = None
    mcp_servers: Any = None
    # radixlang's, as on the OpenAI routes
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template
    cache_salt: str | None = Field(default=None, max_length=MAX_BODY_CACHE_SALT_CHARS)
    routing_key: str | None = Field(default=None, max_length=MAX_ROUTING_KEY_CHARS)
    retain_s: float | None = Field(default=None, ge=0, le=MAX_RETAIN_S)


def router(openai: OpenAIRoutes, docs: Any) -> APIRouter:
    handlers = MessagesRoutes(openai)
    routes = APIRouter()
    create = docs(
        "Message",
        body="MessagesBody",
        errors=(*BODY_ERRORS, 404, 503),
        anthropic=True,
        events=typed_events("MessageStreamEvent", "AnthropicError"),
    )
    routes.add_api_route("/v1/messages", handlers.create, methods=["POST"], **create)
    return routes


class MessagesRoutes:
    def __init__(self, openai: OpenAIRoutes) -> None:
        self.openai = openai

    async def create(self, request: Request) -> Response:
        body = await read_body(request, MessagesBody)
        for name in ("container", "mcp_servers"):
            if getattr(body, name) is not None:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        markers = self.openai.reasoning_markers
        chat_fields = chat_body(body, markers)
        budget = _thinking_budget(body.thinking, markers is not None)
        if budget is not None:
            chat_fields["thinking_budget"] = budget
        chat = parse_body(chat_fields, ChatBody)
        requests, choice = await self.openai.chat_requests(chat)
        handles = await self.openai.submit(request, chat, requests, [None], "messages")
        opened = self.openai.thinking_opened(requests[0])
        # thinking blocks
        splitter = ReasoningSplitter(opened, markers.texts) if markers is not None else None
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        shell = {"id": mid, "type": "message", "role": "assistant", "model": self.openai.model_name,
                 "content": [], "stop_reason": None, "stop_sequence": None}  # fmt: skip
        if body.stream:
            prompt_tokens = len(requests[0].input_ids or [])
            parts = AnswerParts(choice, _IDS, splitter=splitter)
            events = _stream(handles[0], shell, parts, prompt_tokens)
            return StreamingResponse(events, media_type="text/event-stream")
        results = await results_unless_disconnected(request, handles)
        if results is None:
            return Response(status_code=499)
        result = results[0]
        parts = whole_answer(result.text, choice, _IDS, splitter)
        return JSONResponse({**shell, "content": [_block(p) for p in parts.parts],
                             **_stop(result, parts), "usage": _usage(result)})  # fmt: skip


def chat_body(body: MessagesBody, markers: ReasoningMarkers | None = None) -> dict[str, Any]:
    """The chat completions body that asks what ``body`` asks."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system
        text = system if isinstance(system, str) else _text_blocks(system, "system")
        messages.append({"role": "system", "content": text})
    for i, message in enumerate(body.messages):
        messages += _chat_messages(message, f"messages[{i}]", markers)
    chat: dict[str, Any] = {"model": body.model, "messages": messages,
                            "max_tokens": body.max_tokens}  # fmt: skip
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "cache_salt",
        "routing_key",
        "retain_s",
        "chat_template_kwargs",
    ):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    if body.tools:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat.update(_chat_tool_choice(body.tool_choice))
    output_format = (body.output_config or {}).get("format")
    if output_format is not None:
        if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
            raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", "
                           "\"schema\": ...}", param="output_config.format")  # fmt: skip
        spec = {"name": "output", "schema": output_format.get("schema")}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    return chat


def _chat_messages(
    message: dict[str, Any], where: str, markers: ReasoningMarkers | None
) -> list[dict[str, Any]]:
    """A message as chat messages; on a reasoning model (``markers``) an assistant's thinking
    blocks are written back before its text, as the model wrote them (so the conversation's
    prompt stays on the cached path)."""
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise APIError(400, f"{where}.role must be 'user' or 'assistant', got {role!r}",
                       param=f"{where}.role")  # fmt: skip
    unknown = sorted(set(message) - {"role", "content"})
    if unknown:
        raise APIError(400, f"{where}: unknown field {unknown[0]}",
                       param=f"{where}.{unknown[0]}")  # fmt: skip
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of blocks",
                       param=f"{where}.content")  # fmt: skip
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(string_field(block, "text", here))
        elif kind == "tool_use" and role == "assistant":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise APIError(400, f"{here}.input must be an object", param=f"{here}.input")
            calls.append({"id": string_field(block, "id", here), "type": "function",
                          "function": {"name": string_field(block, "name", here),
                                       "arguments": json.dumps(arguments)}})  # fmt: skip
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            text = result if isinstance(result, str) else _text_blocks(result, f"{here}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            call_id = string_field(block, "tool_use_id", here)
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "thinking" and role == "assistant":
            if markers is not None:
                thinking.append(string_field(block, "thinking", here))
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # nothing to show
        else:
            raise APIError(400, f"{here}: {kind!r} blocks are not supported in {role} messages "
                           "by this server", param=f"{here}.type")  # fmt: skip
    out = list(results)
    if role == "assistant":
        opening, closing = markers.texts if markers is not None else ("", "")
        thought = "".join(f"{opening}{t}{closing}" for t in thinking)
        turn: dict[str, Any] = {"role": "assistant", "content": thought + "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _text_blocks(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", param=where)
    texts = []
    for j, block in enumerate(blocks):
        here = f"{where}[{j}]"
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise APIError(400, f"{here}: {kind!r} blocks are not supported here; only text",
                           param=f"{here}.type")  # fmt: skip
        texts.append(string_field(block, "text", here))
    return "".join(texts)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    kind = tool.get("type", "custom")
    if kind != "custom":
        raise APIError(400, f"{where}: {kind!r} tools are not supported by this server; only "
                       "custom tools (name, description, input_schema) are",
                       param=f"{where}.type")  # fmt: skip
    unknown = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
    if unknown:
        raise APIError(400, f"{where}: unknown field {unknown[0]}",
                       param=f"{where}.{unknown[0]}")  # fmt: skip
    if "input_schema" not in tool:
        raise APIError(400, f"{where}.input_schema is required", param=f"{where}.input_schema")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind in _TOOL_CHOICES:
        out["tool_choice"] = _TOOL_CHOICES[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise APIError(400, "tool_choice.type must be 'auto', 'any', 'tool' (with a name) or "
                       f"'none', got {kind!r}", param="tool_choice.type")  # fmt: skip
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


# ---- the answer ----------------------------------------------------------------------------


def _thinking_budget(thinking: dict[str, Any] | None, thinks: bool) -> int | None:
    """``thinking``'s budget: ``{"type": "enabled", "budget_tokens": n}`` bounds a reasoning
    model's thinking; ``disabled`` and ``adaptive`` set none. A model that does not think takes
    no ``enabled``."""
    kind = (thinking or {}).get("type", "disabled")
    if kind in ("disabled", "adaptive"):
        return None
    if kind != "enabled":
        raise APIError(400, "thinking.type must be 'enabled', 'disabled' or 'adaptive', got "
                       f"{kind!r}", param="thinking.type")  # fmt: skip
    if not thinks:
        raise APIError(400, "thinking: this model does not think (no <think> and </think> "
                       "tokens in its chat template)", param="thinking")  # fmt: skip
    budget = (thinking or {}).get("budget_tokens")
    if budget is None:
        return None
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise APIError(400, "thinking.budget_tokens must be a positive integer",
                       param="thinking.budget_tokens")  # fmt: skip
    return budget


def _block(part: Part, streaming: bool = False) -> dict[str, Any]:
    if part.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if streaming else part.text, "signature": ""}
    if part.kind == "text":
        return {"type": "text", "text": "" if streaming else part.text}
    arguments: Any = {}
    if not streaming:
        try:
            arguments = json.loads(part.text)
        except json.JSONDecodeError:  # a call cut by max_tokens: its arguments as far as written
            arguments = {}
    return {"type": "tool_use", "id": part.item_id, "name": part.name, "input": arguments}


def _stop(result: GenerationResult, parts: AnswerParts) -> dict[str, Any]:
    if result.finish_reason is FinishReason.LENGTH:
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if parts.called and result.finish_reason is FinishReason.STOP:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(result.matched_stop, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": result.matched_stop}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(result: GenerationResult) -> dict[str, Any]:
    return {
        "input_tokens": result.prompt_tokens - result.cached_tokens,
        "output_tokens": result.completion_tokens,
        "cache_read_input_tokens": result.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


async def _stream(
    handle: Any, shell: dict[str, Any], parts: AnswerParts, prompt_tokens: int
) -> AsyncIterator[str]:
    """Anthropic's events for one answer."""

    def event(kind: str, **fields: Any) -> str:
        payload = {"type": kind, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    start_usage = {"input_tokens": prompt_tokens, "output_tokens": 0,
                   "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}  # fmt: skip
    yield event("message_start", message={**shell, "usage": start_usage})
    yield event("ping")

    def block_events(events: Sequence[PartEvent]) -> list[str]:
        out = []
        for e in events:
            part = parts.parts[e.index]
            if e.kind == "open":
                out.append(event("content_block_start", index=e.index,
                                 content_block=_block(part, streaming=True)))  # fmt: skip
            elif e.kind == "delta":
                delta = _DELTAS[part.kind] | {_DELTA_FIELDS[part.kind]: e.piece}
                out.append(event("content_block_delta", index=e.index, delta=delta))
            else:
                out.append(event("content_block_stop", index=e.index))
        return out

    async for _, item in merged_events([handle]):
        if isinstance(item, GenerationResult):
            if item.finish_reason is FinishReason.ERROR:
                failure = engine_failure(item)
                yield event("error", error={"type": "api_error", "message": failure.message})
                return
            for text in block_events(parts.finish()):
                yield text
            yield event("message_delta", delta=_stop(item, parts), usage=_usage(item))
            yield event("message_stop")
            return
        if isinstance(item, StreamEvent) and item.text:
            for text in block_events(parts.feed(item.text)):
                yield text
