"""SGLang's native ``POST /generate``: its request body and its response shape, so that SGLang's
own ``RuntimeEndpoint`` client (and radixlang's) work against this server unchanged.

A body holds one prompt or a batch (``text`` or ``input_ids``), sampling parameters for all or
per item, log-probability options, and ``stream``. A single prompt answers one object
``{"text", "output_ids", "meta_info"}``; a batch (or ``n`` > 1) answers a list, in order. A stream
sends ``data:`` lines whose ``text`` is cumulative, as SGLang's do, ending with ``data: [DONE]``;
with ``return_logprob`` each chunk's ``meta_info`` holds that chunk's output logprobs.

Structured output: ``sampling_params`` may hold one of ``regex``, ``json_schema`` (a JSON schema
object or its JSON text, as SGLang's clients send it), ``ebnf`` (SGLang's GBNF form) and
radixlang's ``grammar`` (Lark syntax); a malformed one is a 400 naming it.

Beam search: ``sampling_params.beam_width`` > 1 (with ``temperature`` 0, and optionally
``length_penalty`` and ``early_stopping``) answers the best beam; ``meta_info.beams`` lists every
finished beam (``text``, ``output_ids``, ``score``, ``finish_reason``), best first.

Like SGLang, the body's top level takes any key: fields of SGLang's ``GenerateReqInput`` that
ask for something this server lacks (images, LoRA, hidden states...) are refused when set, its
hints (``priority``, routing, disaggregation) are ignored, and so are unknown keys. Inside
``sampling_params`` an unknown key is a 400.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixlang.runtime.request import (
    FinishReason,
    GenerateRequest,
    GenerationResult,
    StreamEvent,
    TopLogprobs,
)
from radixlang.runtime.sampling import STRUCTURED_OUTPUT
from radixlang.server.api_schema import BODY_ERRORS
from radixlang.server.common import (
    MAX_BODY_CACHE_SALT_CHARS,
    MAX_RETAIN_S,
    MAX_ROUTING_KEY_CHARS,
    SSE_DONE,
    APIError,
    TokenTexts,
    cache_salt,
    engine_failure,
    event_batches,
    parse_body,
    read_json,
    results_unless_disconnected,
    routing_key,
    sse,
    submit_all,
)

log = logging.getLogger(__name__)

# SGLang sampling keys this server accepts only at their "off" value (a clear 400 otherwise).
_UNSUPPORTED_UNLESS_OFF = {
    "structural_tag": "structural tags are not supported; use json_schema, ebnf or regex",
    "stop_regex": "stop_regex is not supported; use stop strings",
    "custom_params": "custom logit processors are not supported",
    "watermark": "watermarking is not supported",
    "ebnf_full_assistant": "ebnf_full_assistant is not supported (there is no reasoning part)",
}
# SGLang keys with no effect here: the server's own behaviour is the same or the key is a hint.
_IGNORED = {"spaces_between_special_tokens", "stream_interval"}

# Top-level fields of SGLang's GenerateReqInput (0.5.23) that ask for something this server
# does not do (images, LoRA, hidden states, ...): accepted when off (absent, null, false, empty),
# a 400 naming the field otherwise.
_MULTIMODAL = ("image_data", "audio_data", "video_data", "input_embeds", "modalities",
               "mm_hashes", "mm_content_hashes", "use_audio_in_video", "video_config",
               "images_config", "mm_processor_kwargs", "max_dynamic_patch", "min_dynamic_patch",
               "image_max_dynamic_patch", "video_max_dynamic_patch", "need_wait_for_mm_inputs",
               "num_items_assigned", "encoder_urls", "positional_embed_overrides")  # fmt: skip
_TOP_LEVEL_UNLESS_OFF = {
    **dict.fromkeys(_MULTIMODAL, "is not supported: this server is text only"),
    "lora_path": "is not supported: this server has no LoRA adapters",
    "lora_id": "is not supported: this server has no LoRA adapters",
    "session_params": "is not supported: there are no sessions",
    "custom_logit_processor": "is not supported: custom logit processors are not",
    "return_hidden_states": "is not supported",
    "return_routed_experts": "is not supported: the model has no routed experts",
    "return_indexer_topk": "is not supported",
    "token_ids_logprob": "is not supported: use top_logprobs_num",
    "return_sampling_mask": "is not supported",
    "sampling_logprobs_mode": "is not supported",
    "return_flat_raw_top_logprobs": "is not supported: logprobs come as nested lists",
    "return_flat_raw_output_top_logprobs": "is not supported: logprobs come as nested lists",
    "return_flat_raw_top_logprobs_b64": "is not supported: logprobs come as nested lists",
    "return_entropy": "is not supported",
    "return_bytes": "is not supported",
    "watermark": "is not supported",
    "require_reasoning": "is not supported: the model has no reasoning mode",
    "max_thinking_tokens": "is not supported: the model has no reasoning mode",
    "multi_item_delimiter_indices": "is not supported: there is no multi-item scoring",
    "token_indices_to_pool": "is not supported: there is no pooling",
    "background": "is not supported",
}
# Top-level fields of SGLang's GenerateReqInput that are hints or bookkeeping with no effect
# here (routing, scheduling priority, disaggregation, tracing, logging): accepted and ignored.
_TOP_LEVEL_IGNORED = frozenset(
    ("priority", "routing_key", "routed_dp_rank", "data_parallel_rank",
     "disagg_prefill_dp_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room",
     "bootstrap_pair_key", "decode_tp_size", "session_id", "conversation_id",
     "http_worker_ipc", "log_metrics", "no_logs", "custom_labels", "external_trace_header",
     "received_time", "extra_key", "kv_hints", "routed_experts_start_len")
)  # fmt: skip


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    # Requests reuse only the cached prefixes of requests with the same salt (and tenant).
    cache_salt: str | None = Field(default=None, max_length=MAX_BODY_CACHE_SALT_CHARS)
    # Behind several replicas: requests with one key (a program's, a chat's) share a replica.
    routing_key: str | None = Field(default=None, max_length=MAX_ROUTING_KEY_CHARS)
    # Keep the request's path cached this long for its program's next call (its routing key):
    # a program paused at a tool call. Cut to the engine's retain_max_s.
    retain_s: float | None = Field(default=None, ge=0, le=MAX_RETAIN_S)


def _is_off(value: Any) -> bool:
    if isinstance(value, list):
        return all(_is_off(v) for v in value)
    return value is None or value is False or value == "" or value == {}


def sglang_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The body's fields this server reads. SGLang ignores top-level keys it does not know (only
    ``sampling_params`` is strict), and so does this server: a field that asks for something
    unsupported is refused when it is on; hints and bookkeeping are dropped, and so are keys
    SGLang does not define either (logged at debug level)."""
    out: dict[str, Any] = {}
    unknown = []
    for key, value in data.items():
        if key in GenerateBody.model_fields:
            out[key] = value
        elif key in _TOP_LEVEL_UNLESS_OFF:
            if not _is_off(value):
                raise APIError(400, f"{key} {_TOP_LEVEL_UNLESS_OFF[key]}", param=key)
        elif key not in _TOP_LEVEL_IGNORED:
            unknown.append(key)
    if unknown:
        log.debug("/generate: ignoring unknown top-level field(s) %s", ", ".join(unknown))
    return out


@dataclass
class Item:
    """One engine request of a body (a batch item, or one of its ``n`` samples)."""

    request: GenerateRequest
    where: str | None  # "text[2]" in a batch, for error messages
    return_logprob: bool
    no_stop_trim: bool
    sampling_where: str  # "sampling_params" or "sampling_params[2]", for error messages


def _per_item(value: Any, i: int, count: int, name: str) -> Any:
    if not isinstance(value, list):
        return value
    if len(value) != count:
        raise APIError(400, f"{name} has {len(value)} entries for {count} prompts", param=name)
    return value[i]


def _engine_sampling(params: dict[str, Any], where: str) -> tuple[dict[str, Any], int, bool]:
    """SGLang sampling keys → the engine's (which are SGLang's names), ``n``, ``no_stop_trim``."""
    out = dict(params)
    for key in _IGNORED:
        out.pop(key, None)
    for key, why in _UNSUPPORTED_UNLESS_OFF.items():
        if not _is_off(out.pop(key, None)):
            raise APIError(400, f"{where}.{key}: {why}", param=f"{where}.{key}")
    # Structured output (regex, json_schema as a schema object or its JSON text, ebnf, and
    # radixlang's Lark ``grammar``) goes to the engine as is; it compiles and checks it.
    structured = [k for k in STRUCTURED_OUTPUT if out.get(k) is not None]
    if len(structured) > 1:
        second = f"{where}.{structured[1]}"
        raise APIError(400, f"{second}: give at most one of {', '.join(structured)}",
                       param=second)  # fmt: skip
    if "sampling_seed" in out:
        out["seed"] = out.pop("sampling_seed")
    n = out.pop("n", 1)
    n = 1 if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
        raise APIError(400, f"{where}.n must be an int in [1, 128], got {n!r}", param=f"{where}.n")
    no_stop_trim = out.pop("no_stop_trim", False)
    if not isinstance(no_stop_trim, bool):
        raise APIError(400, f"{where}.no_stop_trim must be a bool", param=f"{where}.no_stop_trim")
    return out, n, no_stop_trim


def parse_items(body: GenerateBody) -> tuple[list[Item], bool]:
    """The body's engine requests, and whether the answer is a list."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids", param="text")
    prompts: list[str] | list[list[int]]
    if body.text is not None:
        batched, field = isinstance(body.text, list), "text"
        prompts = body.text if isinstance(body.text, list) else [body.text]
    else:
        ids = body.input_ids
        batched, field = bool(ids) and isinstance(ids[0], list), "input_ids"  # type: ignore[index]
        prompts = ids if batched else [ids]  # type: ignore[assignment,list-item]
    if batched and not prompts:
        raise APIError(400, f"{field} is an empty batch", param=field)
    count = len(prompts)
    items: list[Item] = []
    for i, prompt in enumerate(prompts):
        where = f"{field}[{i}]" if batched else None
        place = "sampling_params" + (f"[{i}]" if isinstance(body.sampling_params, list) else "")
        params = _per_item(body.sampling_params, i, count, "sampling_params") or {}
        params, n, no_stop_trim = _engine_sampling(params, place)
        logprob = _per_item(body.return_logprob, i, count, "return_logprob")
        start = _per_item(body.logprob_start_len, i, count, "logprob_start_len")
        top = _per_item(body.top_logprobs_num, i, count, "top_logprobs_num")
        if logprob:
            params.update(return_logprob=True, top_logprobs_num=top or 0)
            # SGLang's default start: no prompt positions (-1), as here.
            params["logprob_start_len"] = -1 if start is None else start
        rid = _per_item(body.rid, i, count, "rid")
        for j in range(n):
            sampling = dict(params)
            seed = sampling.get("seed")
            if n > 1 and isinstance(seed, int) and not isinstance(seed, bool):
                sampling["seed"] = seed + j  # n samples, not n copies of one (else: a 400)
            request = GenerateRequest(
                text=prompt if field == "text" else None,  # type: ignore[arg-type]
                input_ids=prompt if field == "input_ids" else None,  # type: ignore[arg-type]
                sampling=sampling,
                request_id=None if rid is None else (rid if n == 1 else f"{rid}-{j}"),
            )
            items.append(Item(request, where, bool(logprob), no_stop_trim, place))
    return items, batched or len(items) > 1


def _triples(pairs: Sequence[tuple[int, float | None]], texts: TokenTexts | None) -> list[list]:
    return [[lp, tok, texts.text(tok) if texts else None] for tok, lp in pairs]


def _top_triples(tops: Sequence[TopLogprobs | None], texts: TokenTexts | None) -> list:
    return [None if top is None else _triples(top, texts) for top in tops]


def result_body(
    result: GenerationResult,
    item: Item,
    texts: TokenTexts | None,
    prompt_ids: bool = False,
    streamed: int | None = None,
) -> dict:
    """SGLang's answer for one finished request. ``streamed``: the last chunk of a stream, whose
    output logprobs are those not sent yet (this many were), as SGLang streams them."""
    text = result.text
    if item.no_stop_trim and isinstance(result.matched_stop, str):
        text += result.matched_stop
    meta: dict[str, Any] = dict(result.meta_info)
    if item.return_logprob:
        start = streamed or 0
        outputs = list(zip(result.output_ids, result.output_logprobs, strict=False))
        meta["input_token_logprobs"] = _triples(result.prompt_logprobs, texts)
        meta["output_token_logprobs"] = _triples(outputs[start:], texts)
        meta["input_top_logprobs"] = _top_triples(result.prompt_top_logprobs, texts)
        meta["output_top_logprobs"] = _top_triples(result.output_top_logprobs[start:], texts)
        meta["output_token_logprobs_length"] = len(outputs)
    out = {"text": text, "output_ids": result.output_ids, "meta_info": meta}
    if prompt_ids:
        out["prompt_token_ids"] = result.prompt_ids
    return out


def router(
    engine: Any,
    texts: TokenTexts,
    docs: Callable[..., dict[str, Any]],
    max_queued_requests: int | None = None,
) -> APIRouter:
    """``POST /generate`` over ``engine``; ``docs(ok, **kw)`` gives its OpenAPI answers; past
    ``max_queued_requests`` queued requests a body is refused with a 503."""
    routes = APIRouter()

    @routes.post(
        "/generate",
        **docs("GenerateResponse", body="GenerateBody", errors=(*BODY_ERRORS, 503),
               stream="GenerateResult"), name="generate",
    )  # fmt: skip
    async def generate_route(request: Request) -> Response:
        return await generate(request, engine, texts, max_queued_requests)

    return routes


async def generate(
    request: Request, engine: Any, texts: TokenTexts, max_queued_requests: int | None = None
) -> Response:
    body = parse_body(sglang_fields(await read_json(request)), GenerateBody)
    items, as_list = parse_items(body)
    salt = cache_salt(request, body.cache_salt)
    key = routing_key(request, body.routing_key)
    for it in items:
        it.request.cache_salt = salt
        it.request.routing_key = key
        it.request.retain_s = body.retain_s or 0.0
    prompt_field = "text" if body.text is not None else "input_ids"
    handles = await submit_all(
        engine,
        [it.request for it in items],
        [it.where for it in items],
        prompt_field,
        max_queued_requests,
        sampling_path=lambda i, field: f"{items[i].sampling_where}.{field}",
    )
    token_texts = texts if body.return_text_in_logprobs else None
    if body.stream:
        try:
            prompts = await run_in_threadpool(_prompt_ids, engine, items)
        except BaseException:
            for h in handles:
                h.abort()
            raise
        stream = _stream(handles, items, token_texts, as_list, prompts, body)
        return StreamingResponse(stream, media_type="text/event-stream")
    results = await results_unless_disconnected(request, handles)
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    out = [
        result_body(r, it, token_texts, body.return_prompt_token_ids)
        for r, it in zip(results, items, strict=True)
    ]
    return JSONResponse(out if as_list else out[0])


def _prompt_ids(engine: Any, items: list[Item]) -> list[list[int]]:
    """Each request's prompt tokens, as the engine reads them (streamed chunks carry their
    count before the result does)."""
    out: list[list[int]] = []
    for i, item in enumerate(items):
        request = item.request
        if request.input_ids is not None:
            out.append(list(request.input_ids))
        elif i and items[i - 1].request.text == request.text:
            out.append(out[-1])  # one of n samples of the same prompt
        else:
            out.append(list(engine.tokenizer.encode(request.text)))
    return out


async def _stream(
    handles: Sequence[Any],
    items: list[Item],
    texts: TokenTexts | None,
    as_list: bool,
    prompts: list[list[int]],
    body: GenerateBody,
) -> AsyncIterator[str]:
    """SGLang's stream: each chunk's ``text`` and ``output_ids`` are cumulative; its
    ``meta_info`` holds the token counts and, with ``return_logprob``, the logprobs of this
    chunk's tokens only (``output_token_logprobs_length`` counts them all so far), as SGLang's
    incremental streaming sends them. The last chunk is the result, with the prompt's logprobs.

    A chunk carries everything a request's handle had when it was sent: the events that came
    together make one chunk, and the last token's event goes out in the result's chunk, as
    SGLang's last chunk carries its last tokens with the finish reason. Never two chunks for
    what came at once: SGLang's frontend keeps only the latest chunk's ``meta_info`` when two
    land between its reads, and would lose the first one's logprobs.
    """
    sofar = [""] * len(handles)
    ids: list[list[int]] = [[] for _ in handles]
    held: list[list[StreamEvent]] = [[] for _ in handles]  # not sent yet
    async for batch in event_batches(handles):
        results: dict[int, GenerationResult] = {}
        for i, event in batch:
            if isinstance(event, GenerationResult):
                results[i] = event
            else:
                held[i].append(event)
        for i in dict.fromkeys(j for j, _ in batch):  # each request once, in order of arrival
            item = items[i]
            result = results.get(i)
            if result is not None:
                held[i] = []  # the result has them all
                if result.finish_reason is FinishReason.ERROR:
                    yield sse(engine_failure(result).body())
                    continue
                chunk = result_body(result, item, texts, body.return_prompt_token_ids, len(ids[i]))
            elif held[i] and held[i][-1].finished:
                continue  # the result is on its way: its chunk carries these
            else:
                events, held[i] = held[i], []
                new_ids = [t for e in events for t in e.token_ids]
                new_text = "".join(e.text for e in events)
                if not new_text and not new_ids:
                    continue
                sofar[i] += new_text
                ids[i] += new_ids
                chunk = _chunk(events, item, texts, sofar[i], ids[i], prompts[i], body)
            if as_list:
                chunk["index"] = i
            yield sse(chunk)
    yield SSE_DONE


def _chunk(
    events: list[StreamEvent],
    item: Item,
    texts: TokenTexts | None,
    text: str,
    ids: list[int],
    prompt: list[int],
    body: GenerateBody,
) -> dict[str, Any]:
    """A stream chunk for ``events`` (one request's, unsent so far): ``text`` and ``ids`` are
    everything so far, theirs included."""
    meta: dict[str, Any] = {
        "id": events[-1].request_id,
        "prompt_tokens": len(prompt),
        # Known once the prompt is admitted; an engine whose events do not carry it
        # reports 0 until the last chunk, which has the result's figure.
        "cached_tokens": getattr(events[-1], "cached_tokens", None) or 0,
        "completion_tokens": len(ids),
        "finish_reason": None,
    }
    if item.return_logprob:
        pairs = [p for e in events for p in zip(e.token_ids, e.logprobs, strict=False)]
        meta["output_token_logprobs"] = _triples(pairs, texts)
        tops = [top for e in events for top in e.top_logprobs]
        meta["output_top_logprobs"] = _top_triples(tops, texts)
        meta["output_token_logprobs_length"] = len(ids)
    chunk = {"text": text, "output_ids": list(ids), "meta_info": meta}
    if body.return_prompt_token_ids:
        chunk["prompt_token_ids"] = prompt
    return chunk
