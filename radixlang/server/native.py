"""SGLang's native ``POST /generate``: its request body and its response shape, so that SGLang's
own ``RuntimeEndpoint`` client (and radixlang's) work against this server unchanged.

A body holds one prompt or a batch (``text`` or ``input_ids``), sampling parameters for all or
per item, log-probability options, and ``stream``. A single prompt answers one object
``{"text", "output_ids", "meta_info"}``; a batch (or ``n`` > 1) answers a list, in order. A stream
sends ``data:`` lines whose ``text`` is cumulative, as SGLang's do, ending with ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixlang.runtime.request import FinishReason, GenerateRequest, GenerationResult, TopLogprobs
from radixlang.server.common import (
    SSE_DONE,
    APIError,
    TokenTexts,
    engine_failure,
    merged_events,
    read_body,
    results_unless_disconnected,
    sse,
    submit_all,
)

# SGLang sampling keys this server accepts only at their "off" value (a clear 400 otherwise).
_UNSUPPORTED_UNLESS_OFF = {
    "json_schema": "JSON-schema constrained decoding is not supported yet; use regex",
    "ebnf": "EBNF grammars are not supported yet; use regex",
    "structural_tag": "structural tags are not supported",
    "stop_regex": "stop_regex is not supported; use stop strings",
    "custom_params": "custom logit processors are not supported",
}
# SGLang keys with no effect here: the server's own behaviour is the same or the key is a hint.
_IGNORED = {"spaces_between_special_tokens", "stream_interval"}
# SGLang request fields accepted only when absent or null (no images, audio, LoRA, sessions...).
_MULTIMODAL = ("image_data", "audio_data", "video_data", "input_embeds", "lora_path",
               "session_params", "custom_logit_processor", "modalities")  # fmt: skip


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    return_hidden_states: bool = False
    log_metrics: bool = True
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    modalities: Any = None


@dataclass
class Item:
    """One engine request of a body (a batch item, or one of its ``n`` samples)."""

    request: GenerateRequest
    where: str | None  # "text[2]" in a batch, for error messages
    return_logprob: bool
    no_stop_trim: bool


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
        value = out.pop(key, None)
        if value not in (None, [], {}, ""):
            raise APIError(400, f"{where}.{key}: {why}", param=f"{where}.{key}")
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
    for name in _MULTIMODAL:
        if getattr(body, name) not in (None, [], ""):
            raise APIError(400, f"{name} is not supported: this server is text only", param=name)
    if body.return_hidden_states:
        raise APIError(400, "return_hidden_states is not supported", param="return_hidden_states")
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
            if n > 1 and sampling.get("seed") is not None:
                sampling["seed"] += j  # n samples, not n copies of one
            request = GenerateRequest(
                text=prompt if field == "text" else None,  # type: ignore[arg-type]
                input_ids=prompt if field == "input_ids" else None,  # type: ignore[arg-type]
                sampling=sampling,
                request_id=None if rid is None else (rid if n == 1 else f"{rid}-{j}"),
            )
            items.append(Item(request, where, bool(logprob), no_stop_trim))
    return items, batched or len(items) > 1


def _triples(pairs: Sequence[tuple[int, float | None]], texts: TokenTexts | None) -> list[list]:
    return [[lp, tok, texts.text(tok) if texts else None] for tok, lp in pairs]


def _top_triples(tops: Sequence[TopLogprobs | None], texts: TokenTexts | None) -> list:
    return [None if top is None else _triples(top, texts) for top in tops]


def result_body(result: GenerationResult, item: Item, texts: TokenTexts | None) -> dict:
    text = result.text
    if item.no_stop_trim and isinstance(result.matched_stop, str):
        text += result.matched_stop
    meta: dict[str, Any] = dict(result.meta_info)
    if item.return_logprob:
        outputs = list(zip(result.output_ids, result.output_logprobs, strict=False))
        meta["input_token_logprobs"] = _triples(result.prompt_logprobs, texts)
        meta["output_token_logprobs"] = _triples(outputs, texts)
        meta["input_top_logprobs"] = _top_triples(result.prompt_top_logprobs, texts)
        meta["output_top_logprobs"] = _top_triples(result.output_top_logprobs, texts)
    return {"text": text, "output_ids": result.output_ids, "meta_info": meta}


async def generate(request: Request, engine: Any, texts: TokenTexts) -> Response:
    body = await read_body(request, GenerateBody)
    items, as_list = parse_items(body)
    prompt_field = "text" if body.text is not None else "input_ids"
    handles = await submit_all(
        engine,
        [it.request for it in items],
        [it.where for it in items],
        prompt_field,
        request.app.state.max_queued_requests,
    )
    token_texts = texts if body.return_text_in_logprobs else None
    if body.stream:
        stream = _stream(handles, items, token_texts, as_list)
        return StreamingResponse(stream, media_type="text/event-stream")
    results = await results_unless_disconnected(request, handles)
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    out = [result_body(r, it, token_texts) for r, it in zip(results, items, strict=True)]
    return JSONResponse(out if as_list else out[0])


async def _stream(
    handles: Sequence[Any], items: list[Item], texts: TokenTexts | None, as_list: bool
) -> AsyncIterator[str]:
    sofar = [""] * len(handles)
    ids: list[list[int]] = [[] for _ in handles]
    async for i, event in merged_events(handles):
        if isinstance(event, GenerationResult):
            if event.finish_reason is FinishReason.ERROR:
                yield sse(engine_failure(event).body())
                continue
            chunk = result_body(event, items[i], texts)
        else:
            if not event.text and not event.token_ids:
                continue
            sofar[i] += event.text
            ids[i] += event.token_ids
            meta = {"id": event.request_id, "completion_tokens": len(ids[i]),
                    "finish_reason": None}  # fmt: skip
            chunk = {"text": sofar[i], "output_ids": ids[i], "meta_info": meta}
        if as_list:
            chunk["index"] = i
        yield sse(chunk)
    yield SSE_DONE
