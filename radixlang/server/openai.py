"""The OpenAI API: ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET
/v1/models``, so that the official ``openai`` client (and any OpenAI-compatible tool) works
against this server.

Unknown fields are refused, as OpenAI refuses them. Beyond OpenAI's fields, the sampling
extras vLLM and SGLang users know are accepted: ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``regex``,
``ebnf``, beam search (``beam_width``, ``length_penalty``, ``early_stopping``; the answer is the
best beam, and ``temperature`` defaults to 0 with it), and ``continue_final_message`` for chats.

Structured output: ``response_format`` ``{"type": "json_object"}`` (any JSON object) or
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` constrains the output
to valid JSON (chat and completions). Chats take function ``tools`` and ``tool_choice`` and
answer OpenAI's ``tool_calls`` (see ``tools``). Errors take OpenAI's shape, ``code`` included
(``"model_not_found"`` for an unknown model).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixlang.config import TOOL_CALL_RETAIN_S
from radixlang.constrain import ANY_JSON_OBJECT, ConstraintError, json_schema_text
from radixlang.constrain.reasoning import CLOSE as THINK_CLOSE
from radixlang.constrain.reasoning import OPEN as THINK_OPEN
from radixlang.constrain.reasoning import (
    ReasoningMarkers,
    ReasoningSplitter,
    opened_in_prompt,
    split_reasoning,
)
from radixlang.constrain.tool_formats import DEFAULT_FORMAT
from radixlang.runtime.request import (
    FinishReason,
    GenerateRequest,
    GenerationResult,
    StreamEvent,
)
from radixlang.sampling_fields import SAMPLING_FIELDS, SamplingField
from radixlang.server import tools as tooling
from radixlang.server.api_schema import BODY_ERRORS
from radixlang.server.common import (
    MAX_BODY_CACHE_SALT_CHARS,
    MAX_RETAIN_S,
    MAX_ROUTING_KEY_CHARS,
    SSE_DONE,
    APIError,
    TokenBytes,
    TokenTexts,
    cache_salt,
    engine_failure,
    merged_events,
    read_body,
    results_unless_disconnected,
    routing_key,
    sse,
    submit_all,
)

# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "messages",
})  # fmt: skip
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
# A response's id prefix, by its object.
_ID_PREFIX = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}
MAX_TOP_LOGPROBS = 20


# A body's type for each sampling field kind (JSON's: logit_bias keys are strings).
_BODY_TYPES: dict[str, Any] = {
    "int": int,
    "float": float,
    "bool": bool,
    "seed": int,
    "stop": str | list[str],
    "token_ids": list[int],
    "text": str,
    "logit_bias": dict[str, float],
}


def _body_field(f: SamplingField) -> tuple[Any, Any]:
    """A sampling field as an optional body field, with the table's bounds and help."""
    bounds: dict[str, Any] = {"le": f.maximum}
    bounds["gt" if f.exclusive_minimum else "ge"] = f.minimum
    if f.kind == "float":
        bounds["allow_inf_nan"] = False
    bounds = {k: v for k, v in bounds.items() if v is not None}
    return _BODY_TYPES[f.kind] | None, Field(default=None, description=f.help, **bounds)


# The sampling fields OpenAI-style bodies take, under their OpenAI names, from the table
# (radixlang/sampling_fields.py); unset (None): the engine's default.
_SamplingBody = create_model(
    "_SamplingBody",
    __config__=ConfigDict(extra="forbid", strict=True),
    **{f.openai: _body_field(f) for f in SAMPLING_FIELDS if f.openai is not None},
)


class _Body(_SamplingBody):  # type: ignore[misc,valid-type]
    model: str
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM-style extras
    cache_salt: str | None = Field(default=None, max_length=MAX_BODY_CACHE_SALT_CHARS)
    routing_key: str | None = Field(default=None, max_length=MAX_ROUTING_KEY_CHARS)
    # radixlang's: keep the path cached this long for the caller's next call (a chat with
    # tools does so by default: the client comes back with the tools' results).
    retain_s: float | None = Field(default=None, ge=0, le=MAX_RETAIN_S)
    response_format: dict[str, Any] | None = None

    def sampling(self, max_tokens: int | None, default_max: int) -> dict[str, Any]:
        if max_tokens is not None and max_tokens < 0:
            raise APIError(400, f"max_tokens must be >= 0, got {max_tokens}", param="max_tokens")
        sampling: dict[str, Any] = {
            f.name: getattr(self, f.openai) for f in SAMPLING_FIELDS if f.openai is not None
        }
        beams = (self.beam_width or 1) > 1
        sampling.update(
            max_new_tokens=default_max if max_tokens is None else max_tokens,
            # Beam search is deterministic: without a temperature it asks for none.
            temperature=(0.0 if beams else 1.0) if self.temperature is None else self.temperature,
            json_schema=response_schema(self.response_format),
            logit_bias=self.logit_bias or None,
            beam_width=self.beam_width if beams else None,
        )
        if beams and self.n > 1:
            raise APIError(
                400,
                "n > 1 with beam_width is not supported: the answer is the best beam",
                param="n",
            )
        if (self.min_tokens or 0) > sampling["max_new_tokens"]:
            raise APIError(400, "min_tokens must not exceed max_tokens", param="min_tokens")
        given = [k for k in ("regex", "ebnf", "json_schema") if sampling[k] is not None]
        if len(given) > 1:
            names = ["response_format" if k == "json_schema" else k for k in given]
            raise APIError(400, f"give at most one of {', '.join(names)}", param=names[1])
        return {k: v for k, v in sampling.items() if v is not None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: str
    text: str | None = None
    image_url: Any = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False
    # vLLM's and SGLang's: more variables for the chat template (Qwen3's enable_thinking, ...).
    chat_template_kwargs: dict[str, Any] | None = None


_Body.model_rebuild()
CompletionBody.model_rebuild()
ChatBody.model_rebuild()


def router(
    engine: Any,
    model_name: str,
    texts: TokenTexts,
    docs: Callable[..., dict[str, Any]],
    max_queued_requests: int | None = None,
    openai: OpenAIRoutes | None = None,
) -> APIRouter:
    """``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models`` over ``engine`` (through
    ``openai``, when the Responses and Messages routes share it); ``docs(ok, **kw)`` gives a
    route's OpenAPI answers (here in OpenAI's error shape); past ``max_queued_requests`` queued
    requests a body is refused with a 503."""
    if openai is None:
        openai = OpenAIRoutes(engine, model_name, texts, max_queued_requests=max_queued_requests)
    errors = (*BODY_ERRORS, 404, 503)
    routes = APIRouter()
    # The two generating routes: path, handler, answer (its stream events are "<answer>Chunk"),
    # body.
    generating = [("/v1/completions", openai.completions, "Completion", "CompletionBody"),
                  ("/v1/chat/completions", openai.chat, "ChatCompletion", "ChatBody")]  # fmt: skip
    for path, handler, answer, body in generating:
        answers = docs(answer, body=body, errors=errors, stream=f"{answer}Chunk", openai=True)
        routes.add_api_route(path, handler, methods=["POST"], **answers)
    routes.add_api_route(
        "/v1/models", openai.models, methods=["GET"], **docs("ModelList", openai=True)
    )
    return routes


class OpenAIRoutes:
    """The OpenAI routes over one engine, serving it as ``model_name``."""

    def __init__(
        self,
        engine: Any,
        model_name: str,
        texts: TokenTexts,
        token_bytes: TokenBytes | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.texts = texts
        self.token_bytes = token_bytes or TokenBytes(engine.tokenizer, texts)
        self.max_queued_requests = max_queued_requests
        self.created = int(time.time())
        self._template_shows_tools: bool | None = None

    @property
    def reasoning_markers(self) -> ReasoningMarkers | None:
        """The model's thinking markers, if it is a reasoning model (its answers are split)."""
        return getattr(self.engine, "reasoning_markers", None)

    def thinking_opened(self, request: GenerateRequest) -> bool:
        """Whether ``request``'s prompt ends inside a thinking block (its template opened it)."""
        markers = self.reasoning_markers
        return markers is not None and opened_in_prompt(request.input_ids or [], markers)

    def check_model(self, model: str) -> None:
        if model not in (self.model_name, "default"):
            raise APIError(
                404,
                f"The model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    async def models(self, request: Request) -> JSONResponse:
        card = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "radixlang", "max_model_len": self.engine.max_context}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    # ---- /v1/completions ---------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await read_body(request, CompletionBody)
        self.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of not in (None, body.n):
            raise APIError(400, "best_of must equal n (or be left out)", param="best_of")
        prompts = _completion_prompts(body.prompt)
        sampling = body.sampling(body.max_tokens, 16)
        if body.logprobs is not None:
            sampling.update(return_logprob=True, top_logprobs_num=body.logprobs)
            if body.echo:
                sampling["logprob_start_len"] = 0
        requests, where = [], []
        for i, prompt in enumerate(prompts):
            for j in range(body.n):
                requests.append(_request(prompt, sampling, j))
                where.append(f"prompt[{i}]" if len(prompts) > 1 else None)

        def echoes() -> list[str]:  # once the requests are in (their token ids checked)
            return [self._prompt_text(p) if body.echo else "" for p in prompts
                    for _ in range(body.n)]  # fmt: skip

        def stream(handles: Sequence[Any], rid: str, created: int) -> AsyncIterator[str]:
            return self._stream_completion(handles, body, rid, created, echoes())

        def choices(results: Sequence[GenerationResult]) -> list[dict[str, Any]]:
            echo, out = echoes(), []
            for i, result in enumerate(results):
                logprobs = None
                if body.logprobs is not None:
                    logprobs = self._completion_logprobs(result, body, echo[i])
                out.append({"index": i, "text": echo[i] + result.text, "logprobs": logprobs,
                            "finish_reason": _FINISH.get(result.finish_reason)})  # fmt: skip
            return out

        return await self._respond(
            request, body, requests, where, "prompt", "text_completion", stream, choices
        )

    async def _respond(
        self,
        request: Request,
        body: _Body,
        requests: Sequence[GenerateRequest],
        where: Sequence[str | None],
        prompt_field: str,
        kind: str,
        stream: Callable[[Sequence[Any], str, int], AsyncIterator[str]],
        choices: Callable[[Sequence[GenerationResult]], list[dict[str, Any]]],
    ) -> Response:
        """Submit ``requests`` and answer: the events ``stream(handles, id, created)`` yields,
        if the body asks for a stream, else one ``kind`` object (``text_completion``,
        ``chat.completion``) with the ``choices`` made of the results; a 499 (and the requests
        aborted) if the client leaves first."""
        handles = await self.submit(request, body, requests, where, prompt_field)
        rid, created = f"{_ID_PREFIX[kind]}-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            events = stream(handles, rid, created)
            return StreamingResponse(events, media_type="text/event-stream")
        results = await results_unless_disconnected(request, handles)
        if results is None:
            return Response(status_code=499)
        return JSONResponse({"id": rid, "object": kind, "created": created,
                             "model": self.model_name, "choices": choices(results),
                             "usage": _usage(results, body.n)})  # fmt: skip

    async def submit(
        self,
        request: Request,
        body: _Body,
        requests: Sequence[GenerateRequest],
        where: Sequence[str | None],
        prompt_field: str,
    ) -> list[Any]:
        """Submit ``requests`` (all or none) with the body's cache salt, routing key and
        retention (a call with tools retains its path by default: the client comes back with
        the tools' results); their handles."""
        salt = cache_salt(request, body.cache_salt)
        key = routing_key(request, body.routing_key)
        retain = body.retain_s
        if retain is None and getattr(body, "tools", None):
            retain = TOOL_CALL_RETAIN_S
        for r in requests:
            r.cache_salt = salt
            r.routing_key = key
            r.retain_s = retain or 0.0
        return await submit_all(
            self.engine,
            requests,
            where,
            prompt_field,
            self.max_queued_requests,
            sampling_path=lambda i, field: _sampling_path(field, body),
        )

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.engine.tokenizer.decode(prompt) if self.engine.tokenizer else ""

    def _completion_logprobs(
        self, result: GenerationResult, body: CompletionBody, echo: str
    ) -> dict[str, Any]:
        pairs: list[tuple[int, float | None]] = list(result.prompt_logprobs) if echo else []
        tops = list(result.prompt_top_logprobs) if echo else []
        pairs += list(zip(result.output_ids, result.output_logprobs, strict=False))
        tops += result.output_top_logprobs
        return self._logprob_lists(pairs, tops, body.logprobs or 0, 0)

    def _logprob_lists(
        self, pairs: Sequence[tuple[int, float | None]], tops: Sequence[Any], k: int, offset: int
    ) -> dict[str, Any]:
        text = self.texts.text
        tokens, offsets = [], []
        for tok, _ in pairs:
            offsets.append(offset)
            tokens.append(text(tok))
            offset += len(tokens[-1])
        top_dicts = [
            None if top is None else {text(t): lp for t, lp in top[:k]} for top in tops
        ] if k else None  # fmt: skip
        return {"tokens": tokens, "token_logprobs": [lp for _, lp in pairs],
                "top_logprobs": top_dicts, "text_offset": offsets}  # fmt: skip

    def _stream_completion(
        self, handles: Sequence[Any], body: CompletionBody, rid: str, created: int, echo: list[str]
    ) -> AsyncIterator[str]:
        head = {"id": rid, "object": "text_completion", "created": created,
                "model": self.model_name}  # fmt: skip
        offsets = [len(e) for e in echo]

        def piece(i: int, event: StreamEvent) -> list[dict[str, Any]]:
            logprobs = None
            if body.logprobs is not None:
                pairs = list(zip(event.token_ids, event.logprobs, strict=False))
                logprobs = self._logprob_lists(pairs, event.top_logprobs, body.logprobs, offsets[i])
            offsets[i] += len(event.text)
            return [_text_choice(i, event.text, logprobs, None)]

        def finished(i: int, result: GenerationResult) -> list[dict[str, Any]]:
            return [_text_choice(i, "", None, _FINISH.get(result.finish_reason))]

        first = [_text_choice(i, prefix, None, None) for i, prefix in enumerate(echo) if prefix]
        return _event_stream(handles, body, head, first, piece, finished)

    # ---- /v1/chat/completions ----------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        body = await read_body(request, ChatBody)
        requests, choice = await self.chat_requests(body)
        markers = self.reasoning_markers
        opened = self.thinking_opened(requests[0])

        def stream(handles: Sequence[Any], rid: str, created: int) -> AsyncIterator[str]:
            return self._stream_chat(handles, body, rid, created, choice, opened)

        def choices(results: Sequence[GenerationResult]) -> list[dict[str, Any]]:
            out = []
            for i, result in enumerate(results):
                logprobs = None
                if body.logprobs:
                    pairs = zip(result.output_ids, result.output_logprobs, strict=False)
                    logprobs = {"content": self._chat_logprobs(pairs, result.output_top_logprobs)}
                message, finish = _chat_message(result, choice, markers, opened)
                out.append({"index": i, "message": message, "logprobs": logprobs,
                            "finish_reason": finish})  # fmt: skip
            return out

        return await self._respond(
            request, body, requests, [None] * body.n, "messages", "chat.completion", stream, choices
        )

    async def chat_requests(
        self, body: ChatBody
    ) -> tuple[list[GenerateRequest], tooling.ToolChoice]:
        """A chat body's requests (``n`` of them: the prompt the chat template renders, the
        sampling, the tools' grammar) and its tool choice; a 4xx naming what is wrong. The
        Responses and Messages routes reach the engine through here too."""
        self.check_model(body.model)
        tools = tooling.parse_tools(body.tools)
        choice = tooling.parse_tool_choice(body.tool_choice, tools, self.tool_format)
        if body.top_logprobs and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        limit = body.max_completion_tokens
        if limit is None:
            limit = body.max_tokens
        sampling = body.sampling(limit, max(self.engine.max_context - 1, 1))
        if choice.calls:
            for key in ("regex", "ebnf"):
                if key in sampling:
                    raise APIError(400, f"{key} cannot be combined with tools", param=key)
            # The output is a call block (or, with "auto", a reply: text, or JSON under
            # response_format): one Lark grammar says which.
            text_schema = sampling.pop("json_schema", None)
            sampling["grammar"] = tooling.call_grammar(
                choice, body.parallel_tool_calls is not False, text_schema
            )
            if choice.fmt.special:  # marker tokens are the calls' text: keep them in it
                sampling["skip_special_tokens"] = False
        if body.logprobs:
            sampling.update(return_logprob=True, top_logprobs_num=body.top_logprobs or 0)
        ids = await run_in_threadpool(self._chat_prompt, body, choice, tools)
        if limit is None:  # what is left of the context window
            sampling["max_new_tokens"] = max(self.engine.max_context - len(ids), 1)
        return [_request(ids, sampling, j) for j in range(body.n)], choice

    @property
    def tool_format(self) -> Any:
        """How the model writes tool calls (the engine's: read off its chat template, or
        named by ``tool_call_format``)."""
        return getattr(self.engine, "tool_format", None) or DEFAULT_FORMAT

    def template_writes_calls(self) -> bool:
        """Whether the chat template writes an assistant message's ``tool_calls`` itself (its
        format was read off it); if not, they go into the message's text."""
        return self.template_shows_tools() or self.tool_format.name == "template"

    def template_shows_tools(self) -> bool:
        """Whether the chat template writes the ``tools`` it is given into the prompt (if not,
        a system message describes them)."""
        if self._template_shows_tools is None:
            probe = {"type": "function", "function": {
                "name": "radixlang_probe_function", "description": "probe",
                "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
            try:
                text = self.engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": "hi"}],
                    tools=[probe],
                    tokenize=False,
                    add_generation_prompt=True,
                )
                self._template_shows_tools = "radixlang_probe_function" in text
            except Exception:
                self._template_shows_tools = False
        return self._template_shows_tools

    def _chat_prompt(
        self, body: ChatBody, choice: tooling.ToolChoice, tools: Sequence[tooling.Tool] = ()
    ) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.model_name} has no chat template", param="messages")
        native = self.template_shows_tools()
        writes_calls = self.template_writes_calls()
        messages = [_plain_message(m, i, writes_calls, self.tool_format)
                    for i, m in enumerate(body.messages)]  # fmt: skip
        final = body.continue_final_message
        if final and messages[-1]["role"] != "assistant":
            raise APIError(
                400,
                "continue_final_message needs an assistant message last",
                param="continue_final_message",
            )
        # Every tool, described as for "auto" whatever the choice (the grammar holds the output
        # to the choice): the prompt's prefix then stays the same from turn to turn of a
        # conversation whose tool_choice changes, and the cache keeps serving it.
        shown = tooling.ToolChoice("auto", tuple(tools) or choice.tools)
        extra: dict[str, Any] = {}
        if choice.calls and native:
            extra["tools"] = [t.spec for t in shown.tools]
        elif choice.calls:
            messages = _with_system_text(messages, tooling.tools_prompt(shown))

        template_vars = body.chat_template_kwargs or {}
        taken = sorted(set(template_vars) & _TEMPLATE_ARGUMENTS)
        if taken:
            raise APIError(400, f"chat_template_kwargs: {taken[0]} is set by the server",
                           param=f"chat_template_kwargs.{taken[0]}")  # fmt: skip

        def render(messages: list[dict[str, Any]]) -> str:
            return tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=not final,
                continue_final_message=final,
                **extra,
                **template_vars,
            )

        try:
            text = render(messages)
        except Exception as e:  # the template refused the conversation (e.g. role order)
            if native or not any(m["role"] == "tool" for m in messages):
                raise APIError(400, f"messages: the chat template refused them: {e}",
                               param="messages") from None  # fmt: skip
            # A template without a tool role: tool results as user messages, marked.
            try:
                text = render([_tool_result_as_user(m) for m in messages])
            except Exception as e2:
                raise APIError(400, f"messages: the chat template refused them: {e2}",
                               param="messages") from None  # fmt: skip
        # The template writes any BOS itself: encode without adding special tokens again.
        return list(tokenizer.encode(text, add_special_tokens=False))

    def _chat_logprobs(self, pairs: Any, tops: Sequence[Any]) -> list[dict[str, Any]]:
        text = self.texts.text
        token_bytes = self.token_bytes.bytes
        out = []
        for (tok, lp), top in zip(pairs, tops, strict=False):
            alternatives = [
                {"token": text(a), "logprob": alp, "bytes": token_bytes(a)}
                for a, alp in (top or [])
            ]
            out.append({"token": text(tok), "logprob": lp, "bytes": token_bytes(tok),
                        "top_logprobs": alternatives})  # fmt: skip
        return out

    def _stream_chat(
        self,
        handles: Sequence[Any],
        body: ChatBody,
        rid: str,
        created: int,
        choice: tooling.ToolChoice,
        opened: bool = False,
    ) -> AsyncIterator[str]:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}  # fmt: skip
        calls = [
            tooling.CallStream(choice.calls, choice.mode == "required", choice.fmt) for _ in handles
        ]
        # A reasoning model's thinking goes out as reasoning_content, its answer as content.
        markers = self.reasoning_markers
        thinks = markers is not None
        texts = markers.texts if markers is not None else (THINK_OPEN, THINK_CLOSE)
        splitters = [ReasoningSplitter(opened, texts) for _ in handles]

        def answer_deltas(i: int, reasoning: str, text: str, end: bool) -> list[dict[str, Any]]:
            deltas = [{"reasoning_content": reasoning}] if reasoning else []
            if not choice.calls:
                return deltas + ([{"content": text}] if text or (not deltas and not end) else [])
            return deltas + calls[i].feed(text) + (calls[i].finish() if end else [])

        def piece(i: int, event: StreamEvent) -> list[dict[str, Any]]:
            logprobs = None
            if body.logprobs:
                pairs = zip(event.token_ids, event.logprobs, strict=False)
                logprobs = {"content": self._chat_logprobs(pairs, event.top_logprobs)}
            reasoning, text = splitters[i].feed(event.text) if thinks else ("", event.text)
            deltas = answer_deltas(i, reasoning, text, end=False) or ([{}] if logprobs else [])
            return [_delta_choice(i, delta, logprobs if k == 0 else None, None)
                    for k, delta in enumerate(deltas)]  # fmt: skip

        def finished(i: int, result: GenerationResult) -> list[dict[str, Any]]:
            reasoning, text = splitters[i].finish() if thinks else ("", "")
            deltas = answer_deltas(i, reasoning, text, end=True)
            out = [_delta_choice(i, delta, None, None) for delta in deltas]
            finish = _FINISH.get(result.finish_reason)
            if calls[i].called and calls[i].closed and result.finish_reason is FinishReason.STOP:
                finish = "tool_calls"
            return [*out, _delta_choice(i, {}, None, finish)]

        first = [_delta_choice(i, {"role": "assistant", "content": ""}, None, None)
                 for i in range(len(handles))]  # fmt: skip
        return _event_stream(handles, body, head, first, piece, finished)


async def _event_stream(
    handles: Sequence[Any],
    body: _Body,
    head: dict[str, Any],
    first: Sequence[dict[str, Any]],
    piece: Callable[[int, StreamEvent], list[dict[str, Any]]],
    finished: Callable[[int, GenerationResult], list[dict[str, Any]]],
) -> AsyncIterator[str]:
    """A streamed answer's server-sent events, each a ``head`` with one choice: the ``first``
    choices, then as the requests go, ``piece(i, event)``'s for each piece of request ``i``'s
    output (pieces with no text and no tokens skipped) and ``finished(i, result)``'s for its end
    (an engine failure is an error event instead); the usage if the body asks for it; [DONE]."""
    for c in first:
        yield sse({**head, "choices": [c]})
    results: list[GenerationResult | None] = [None] * len(handles)
    async for i, event in merged_events(handles):
        if isinstance(event, GenerationResult):
            if event.finish_reason is FinishReason.ERROR:
                yield sse(engine_failure(event).body(openai=True))
                continue
            results[i] = event
            choices = finished(i, event)
        elif event.text or event.token_ids:
            choices = piece(i, event)
        else:
            continue
        for c in choices:
            yield sse({**head, "choices": [c]})
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": _usage(results, body.n)})
    yield SSE_DONE


def response_schema(response_format: dict[str, Any] | None) -> Any:
    """The JSON schema ``response_format`` asks the output to follow, or None for text; a 400
    naming the field if it is malformed."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind != "json_schema":
        raise APIError(400, "response_format.type must be 'text', 'json_object' or "
                       f"'json_schema', got {kind!r}", param="response_format.type")  # fmt: skip
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema must be an object with name and schema",
                       param="response_format.json_schema")  # fmt: skip
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise APIError(400, "response_format.json_schema.name must be a string",
                       param="response_format.json_schema.name")  # fmt: skip
    schema = spec.get("schema", spec.get("schema_"))
    if schema is None:
        return ANY_JSON_OBJECT  # OpenAI's schema is optional: any JSON object then
    try:
        json_schema_text(schema)
    except ConstraintError as e:
        raise APIError(400, f"response_format.json_schema.schema: {e}",
                       param="response_format.json_schema.schema") from None  # fmt: skip
    return schema


def _sampling_path(field: str, body: _Body) -> str | None:
    """The body's name for a sampling field the engine refused."""
    if field == "max_new_tokens":
        given = getattr(body, "max_completion_tokens", None) is not None
        return "max_completion_tokens" if given else "max_tokens"
    if field == "json_schema":
        kind = (body.response_format or {}).get("type")
        return "response_format.json_schema.schema" if kind == "json_schema" else "response_format"
    if field == "grammar":
        return "tools"
    return None


def _chat_message(
    result: GenerationResult,
    choice: tooling.ToolChoice,
    markers: ReasoningMarkers | None = None,
    opened: bool = False,
) -> tuple[dict[str, Any], str | None]:
    """A finished chat's ``message`` and ``finish_reason``: text, or the calls it made; a
    reasoning model's (``markers``) thinking as ``reasoning_content``."""
    finish = _FINISH.get(result.finish_reason)
    reasoning, text = (
        split_reasoning(result.text, opened, markers.texts)
        if markers is not None
        else (None, result.text)
    )
    extra = {} if reasoning is None else {"reasoning_content": reasoning}
    parsed = tooling.parse_output(text, choice)
    if parsed is None or not parsed[1]:
        return {"role": "assistant", "content": text, **extra}, finish
    before, calls, closed = parsed
    ids = [tooling.new_call_id() for _ in calls]
    message = {"role": "assistant", "content": before or None, **extra,
               "tool_calls": tooling.tool_calls_json(calls, ids)}  # fmt: skip
    if closed and result.finish_reason is FinishReason.STOP:
        finish = "tool_calls"
    return message, finish


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` added to the conversation's system message (one is put first if none is)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        joined = f"{first['content']}\n\n{text}" if first["content"] else text
        return [{**first, "content": joined}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _tool_result_as_user(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] != "tool":
        return message
    return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _request(prompt: str | list[int], sampling: dict[str, Any], j: int) -> GenerateRequest:
    sampling = dict(sampling)
    if j and sampling.get("seed") is not None:
        sampling["seed"] += j  # n samples, not n copies of one
    if isinstance(prompt, str):
        return GenerateRequest(text=prompt, sampling=sampling)
    return GenerateRequest(input_ids=prompt, sampling=sampling)


def _plain_message(
    m: ChatMessage, i: int, template_writes_calls: bool = False, fmt: Any = DEFAULT_FORMAT
) -> dict[str, Any]:
    """A message as the chat template takes it: content parts joined, ``developer`` as
    ``system``. An assistant's ``tool_calls`` go to a template that writes calls as they are
    (arguments as objects); otherwise they are written into its content in ``fmt``."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if part.type != "text":
                raise APIError(400, f"messages[{i}].content: only text parts are supported, "
                               f"got {part.type!r}", param=f"messages[{i}].content")  # fmt: skip
            if part.text is None:
                where = f"messages[{i}].content[{k}].text"
                raise APIError(400, f"{where} is required", param=where)
            texts.append(part.text)
        content = "".join(texts)
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                           "content": content or ""}  # fmt: skip
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError(400, f"messages[{i}].tool_calls: only assistant messages make calls",
                           param=f"messages[{i}].tool_calls")  # fmt: skip
        block = tooling.call_block(m.tool_calls, f"messages[{i}]", fmt)  # checks them too
        if template_writes_calls:
            out["tool_calls"] = tooling.template_tool_calls(m.tool_calls)
        else:
            joint = fmt.text_before if fmt.text_before is not None else "\n"
            out["content"] = f"{out['content']}{joint}{block}" if out["content"] else block
    for key in ("name", "tool_call_id"):
        if getattr(m, key) is not None:
            out[key] = getattr(m, key)
    return out


def _usage(results: Sequence[GenerationResult | None], n: int) -> dict[str, Any]:
    # A prompt sampled n times is counted once, as OpenAI counts it.
    firsts = [r for r in results[::n] if r is not None]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in results if r is not None)
    cached = sum(r.cached_tokens for r in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def _text_choice(i: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _delta_choice(i: int, delta: dict, logprobs: Any, finish: str | None) -> dict[str, Any]:
    return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
