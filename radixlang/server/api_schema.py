"""The server's OpenAPI schema: what each route takes and answers, errors included.

The routes parse their bodies themselves (the error messages name the field, as SGLang's and
OpenAI's clients expect), so FastAPI sees no body parameter; this module describes them instead:
request bodies from the same pydantic models the routes parse with, and responses (including
the error shape and the ``data:`` events of streamed answers) as JSON schemas. ``route_docs``
gives a route's ``responses`` and ``openapi_extra``; ``components`` the shared schemas.

A streamed answer (``text/event-stream``) documents each event in its media type's
``itemSchema`` (OpenAPI 3.2's, for server-sent events): its ``data`` is JSON (``contentSchema``)
but for the final ``[DONE]``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from radixlang.runtime.kv_events import MEDIA as KV_MEDIA
from radixlang.sampling_fields import SAMPLING_FIELDS, SamplingField
from radixlang.server.common import (
    MAX_BODY_CACHE_SALT_CHARS,
    MAX_RETAIN_S,
    MAX_ROUTING_KEY_CHARS,
)

REF = "#/components/schemas/{model}"


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_INT = {"type": "integer"}
_NUM = {"type": "number"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_INTS = {"type": "array", "items": _INT}
_OPEN_OBJECT = {"type": "object", "additionalProperties": True}


def _object(
    properties: dict[str, Any], required: list[str] | None = None, open_: bool = False
) -> dict[str, Any]:
    """An object with these properties (``required`` defaults to all); ``open_``: it may hold
    other keys too."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": open_,
    }


def _error(code: dict[str, Any]) -> dict[str, Any]:
    return _object(
        {"error": _object({"message": _STR, "type": _STR, "param": _nullable(_STR), "code": code})}
    )


# A sampling field's values, by its kind (radixlang/sampling_fields.py).
_KIND_SCHEMA: dict[str, dict[str, Any]] = {
    "int": _INT,
    "float": _NUM,
    "bool": _BOOL,
    "seed": _nullable(_INT),
    "stop": {"anyOf": [_STR, {"type": "array", "items": _STR}, {"type": "null"}]},
    "token_ids": _nullable(_INTS),
    "text": _nullable(_STR),
    "schema": {"anyOf": [_STR, _OPEN_OBJECT, {"type": "null"}]},
    "logit_bias": _nullable({"type": "object", "additionalProperties": _NUM}),
}


def _sampling_field_schema(f: SamplingField) -> dict[str, Any]:
    schema = {**_KIND_SCHEMA[f.kind], "description": f.help}
    if f.kind in ("int", "float"):  # bounds of a plain number (seed's are torch's, not shown)
        if f.minimum is not None:
            schema["exclusiveMinimum" if f.exclusive_minimum else "minimum"] = f.minimum
        if f.maximum is not None:
            schema["maximum"] = f.maximum
    return schema


# SGLang's sampling parameters, as /generate takes them (``sampling_params``): the table's
# fields, then SGLang's others. An unknown key is a 400; values are checked by the engine
# (ranges, regex syntax, ...): a bad one is a 400 too.
_SAMPLING: dict[str, Any] = {
    **{f.name: _sampling_field_schema(f) for f in SAMPLING_FIELDS},
    "sampling_seed": _nullable(_INT),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": 128}),
    "no_stop_trim": _BOOL,
    # Accepted only when off (null, false, "" or {}); ignored: spaces_between_special_tokens,
    # stream_interval.
    "structural_tag": {},
    "stop_regex": {},
    "custom_params": {},
    "watermark": {},
    "ebnf_full_assistant": {},
    "spaces_between_special_tokens": {},
    "stream_interval": {},
}

_GENERATE_BODY: dict[str, Any] = {
    "type": "object",
    "description": "One prompt or a batch: exactly one of text and input_ids. Other top-level "
    "keys of SGLang's GenerateReqInput are accepted (those asking for something this server "
    "lacks are a 400 unless off), and unknown keys are ignored.",
    "properties": {
        "text": {"anyOf": [_STR, {"type": "array", "items": _STR}, {"type": "null"}]},
        "input_ids": {"anyOf": [_INTS, {"type": "array", "items": _INTS}, {"type": "null"}]},
        "sampling_params": {
            "anyOf": [
                ref("SamplingParams"),
                {"type": "array", "items": ref("SamplingParams")},
                {"type": "null"},
            ]
        },
        "return_logprob": {"anyOf": [_BOOL, {"type": "array", "items": _BOOL}, {"type": "null"}]},
        "logprob_start_len": {"anyOf": [_INT, _INTS, {"type": "null"}]},
        "top_logprobs_num": {"anyOf": [_INT, _INTS, {"type": "null"}]},
        "return_text_in_logprobs": _BOOL,
        "return_prompt_token_ids": _BOOL,
        "stream": _BOOL,
        "rid": {"anyOf": [_STR, {"type": "array", "items": _STR}, {"type": "null"}]},
        "cache_salt": _nullable({"type": "string", "maxLength": MAX_BODY_CACHE_SALT_CHARS}),
        "routing_key": _nullable({"type": "string", "maxLength": MAX_ROUTING_KEY_CHARS}),
        "retain_s": _nullable(
            {
                "type": "number",
                "minimum": 0,
                "maximum": MAX_RETAIN_S,
                "description": "keep the path cached this long for the "
                "program's next call (its routing key)",
            }
        ),
    },
    "additionalProperties": True,
    # Exactly one of text and input_ids (null counts as absent).
    "oneOf": [
        {"required": [key], "properties": {key: {"not": {"type": "null"}}, other: {"type": "null"}}}
        for key, other in (("text", "input_ids"), ("input_ids", "text"))
    ],
}

# [logprob, token id, token text or null]; a logprob is null where there is none (a prompt's
# first token).
_TRIPLE = {
    "type": "array",
    "prefixItems": [_nullable(_NUM), _INT, _nullable(_STR)],
    "minItems": 3,
    "maxItems": 3,
}
_TRIPLES = {"type": "array", "items": _TRIPLE}
_TOP_TRIPLES = {"type": "array", "items": _nullable(_TRIPLES)}
_FINISH_META = _nullable(
    _object({"type": _STR}, open_=True)  # {"type": "length", "length": n}, {"type", "matched"}
)
_LOGPROB_META = {
    "input_token_logprobs": _TRIPLES,
    "output_token_logprobs": _TRIPLES,
    "input_top_logprobs": _TOP_TRIPLES,
    "output_top_logprobs": _TOP_TRIPLES,
    "output_token_logprobs_length": _INT,
}
_META = {
    **_object(
        {
            "id": _STR,
            "prompt_tokens": _INT,
            "completion_tokens": _INT,
            "cached_tokens": _INT,
            "finish_reason": _FINISH_META,
            "e2e_latency": _NUM,
            "beams": {"type": "array", "items": _OPEN_OBJECT},
            **_LOGPROB_META,
        },
        required=["id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"],
        open_=True,
    )
}
_GENERATE_RESULT = _object(
    {
        "text": _STR,
        "output_ids": _INTS,
        "meta_info": ref("GenerateMetaInfo"),
        "prompt_token_ids": _INTS,
        "index": _INT,  # a streamed batch's chunks: which item
    },
    required=["text", "output_ids", "meta_info"],
)

_FINISH = _nullable({"type": "string", "enum": ["stop", "length", "abort"]})
_CHAT_FINISH = _nullable({"type": "string", "enum": ["stop", "length", "abort", "tool_calls"]})
_USAGE = _object(
    {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": _object({"cached_tokens": _INT}),
    }
)
_COMPLETION_LOGPROBS = _nullable(
    _object(
        {
            "tokens": {"type": "array", "items": _STR},
            "token_logprobs": {"type": "array", "items": _nullable(_NUM)},
            "top_logprobs": _nullable(
                {
                    "type": "array",
                    "items": _nullable({"type": "object", "additionalProperties": _NUM}),
                }
            ),
            "text_offset": _INTS,
        }
    )
)
_TEXT_CHOICE = _object(
    {"index": _INT, "text": _STR, "logprobs": _COMPLETION_LOGPROBS, "finish_reason": _FINISH}
)
_CHAT_TOKEN = {
    "token": _STR,
    "logprob": _nullable(_NUM),
    "bytes": _INTS,
}
_CHAT_LOGPROBS = _nullable(
    _object(
        {
            "content": {
                "type": "array",
                "items": _object(
                    {
                        **_CHAT_TOKEN,
                        "top_logprobs": {"type": "array", "items": _object(_CHAT_TOKEN)},
                    }
                ),
            }
        }
    )
)
_TOOL_CALL = _object(
    {
        "id": _STR,
        "type": {"const": "function"},
        "function": _object({"name": _STR, "arguments": _STR}),
    }
)
_CHAT_MESSAGE = _object(
    {
        "role": {"const": "assistant"},
        "content": _nullable(_STR),
        "reasoning_content": _STR,  # a reasoning model's thinking
        "tool_calls": {"type": "array", "items": _TOOL_CALL},
    },
    required=["role", "content"],
)
# A streamed call's pieces: the first with id, type and name, then its arguments in pieces.
_TOOL_CALL_DELTA = _object(
    {
        "index": _INT,
        "id": _STR,
        "type": {"const": "function"},
        "function": _object({"name": _STR, "arguments": _STR}, required=[]),
    },
    required=["index"],
)
_CHAT_DELTA = _object(
    {
        "role": {"const": "assistant"},
        "content": _nullable(_STR),
        "reasoning_content": _STR,
        "tool_calls": {"type": "array", "items": _TOOL_CALL_DELTA},
    },
    required=[],
)


# ---- the Responses API (server/responses.py) ----------------------------------------------
_ARRAY = {"type": "array"}
_OUTPUT_TEXT = _object(
    {"type": {"const": "output_text"}, "text": _STR, "annotations": _ARRAY, "logprobs": _ARRAY}
)
_ITEM_STATUS = {"enum": ["in_progress", "completed", "incomplete"]}
_OUTPUT_ITEM = {
    "anyOf": [
        _object({"type": {"const": "message"}, "id": _STR, "status": _ITEM_STATUS,
                 "role": {"const": "assistant"},
                 "content": {"type": "array", "items": _OUTPUT_TEXT}}),
        _object({"type": {"const": "function_call"}, "id": _STR, "call_id": _STR, "name": _STR,
                 "arguments": _STR, "status": _ITEM_STATUS}),
        _object({"type": {"const": "reasoning"}, "id": _STR, "status": _ITEM_STATUS,
                 "summary": _ARRAY,
                 "content": {"type": "array", "items": _object(
                     {"type": {"const": "reasoning_text"}, "text": _STR})}}),
    ]
}  # fmt: skip
_RESPONSE_USAGE = _object(
    {
        "input_tokens": _INT,
        "input_tokens_details": _object({"cached_tokens": _INT}),
        "output_tokens": _INT,
        "output_tokens_details": _object({"reasoning_tokens": _INT}),
        "total_tokens": _INT,
    }
)
_RESPONSE = _object(
    {
        "id": _STR,
        "object": {"const": "response"},
        "created_at": _INT,
        "status": {"enum": ["in_progress", "completed", "incomplete", "failed", "cancelled"]},
        "background": _BOOL,
        "error": _nullable(_object({"code": _STR, "message": _STR})),
        "incomplete_details": _nullable(_object({"reason": _STR})),
        "instructions": _nullable(_STR),
        "max_output_tokens": _nullable(_INT),
        "max_tool_calls": {"type": "null"},
        "model": _STR,
        "output": {"type": "array", "items": _OUTPUT_ITEM},
        "parallel_tool_calls": _BOOL,
        "previous_response_id": _nullable(_STR),
        "reasoning": _OPEN_OBJECT,
        "service_tier": _STR,
        "store": _BOOL,
        "temperature": _NUM,
        "text": _OPEN_OBJECT,
        "tool_choice": {},
        "tools": {"type": "array", "items": _OPEN_OBJECT},
        "top_logprobs": _INT,
        "top_p": _NUM,
        "truncation": {"enum": ["auto", "disabled"]},
        "usage": _nullable(_RESPONSE_USAGE),
        "user": _nullable(_STR),
        "metadata": {"type": "object", "additionalProperties": _STR},
    }
)


# ---- Anthropic's Messages API (server/messages.py) -------------------------------------------
_CONTENT_BLOCK = {
    "anyOf": [
        _object({"type": {"const": "text"}, "text": _STR}),
        _object({"type": {"const": "tool_use"}, "id": _STR, "name": _STR, "input": _OPEN_OBJECT}),
        _object({"type": {"const": "thinking"}, "thinking": _STR, "signature": _STR}),
    ]
}
_MESSAGE = _object(
    {
        "id": _STR,
        "type": {"const": "message"},
        "role": {"const": "assistant"},
        "model": _STR,
        "content": {"type": "array", "items": _CONTENT_BLOCK},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "stop_sequence": _nullable(_STR),
        "usage": _object(
            {
                "input_tokens": _INT,
                "output_tokens": _INT,
                "cache_read_input_tokens": _INT,
                "cache_creation_input_tokens": _INT,
            }
        ),
    }
)


def typed_events(event: str, error: str = "OpenAIError") -> dict[str, Any]:
    """One server-sent event of a typed stream (the Responses and Messages APIs'): an
    ``event:`` line naming its type, and ``data``: JSON, an ``event`` component (each type's
    fields beside ``type``) or an ``error`` component. No ``[DONE]``: the last event's type
    ends it."""
    data = {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [ref(event), ref(error)]},
    }
    props = {"event": _STR, "data": data}
    return {"type": "object", "properties": props, "required": ["data"]}


def _response(kind: str, choice: dict[str, Any], usage: bool = True) -> dict[str, Any]:
    props = {
        "id": _STR,
        "object": {"const": kind},
        "created": _INT,
        "model": _STR,
        "choices": {"type": "array", "items": choice},
        "usage": _USAGE,
    }
    return _object(props, required=[k for k in props if usage or k != "usage"])


_RESPONSES: dict[str, dict[str, Any]] = {
    "Error": {
        **_error(_INT),
        "description": "A refused request; code is the HTTP status.",
    },
    "OpenAIError": {
        **_error(_nullable(_STR)),
        "description": "OpenAI's error shape; code is a machine-readable string or null.",
    },
    "SamplingParams": _object(_SAMPLING, required=[]),
    "GenerateBody": _GENERATE_BODY,
    "GenerateMetaInfo": _META,
    "GenerateResult": _GENERATE_RESULT,
    "GenerateResponse": {
        "anyOf": [ref("GenerateResult"), {"type": "array", "items": ref("GenerateResult")}]
    },
    "Completion": _response("text_completion", _TEXT_CHOICE),
    "CompletionChunk": _response("text_completion", _TEXT_CHOICE, usage=False),
    "ChatCompletion": _response(
        "chat.completion",
        _object(
            {
                "index": _INT,
                "message": _CHAT_MESSAGE,
                "logprobs": _CHAT_LOGPROBS,
                "finish_reason": _CHAT_FINISH,
            }
        ),
    ),
    "ChatCompletionChunk": _response(
        "chat.completion.chunk",
        _object(
            {
                "index": _INT,
                "delta": _CHAT_DELTA,
                "logprobs": _CHAT_LOGPROBS,
                "finish_reason": _CHAT_FINISH,
            }
        ),
        usage=False,
    ),
    "ModelList": _object(
        {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": _object(
                    {
                        "id": _STR,
                        "object": {"const": "model"},
                        "created": _INT,
                        "owned_by": _STR,
                        "max_model_len": _INT,
                    }
                ),
            },
        }
    ),
    "Status": _object({"status": {"const": "ok"}}),
    "ModelInfo": _object(
        {
            "model_path": _STR,
            "tokenizer_path": _STR,
            "served_model_name": _STR,
            "is_generation": _BOOL,
            "max_context_length": _INT,
            "vocab_size": _INT,
            "chat_template": _nullable(_STR),
            "bos_token": _nullable(_STR),
            "eos_token": _nullable(_STR),
            "tool_call_format": _nullable({"type": "object"}),
        }
    ),
    "ServerInfo": _object(
        {
            "version": _STR,
            "model_path": _STR,
            "served_model_name": _STR,
            "dtype": _STR,
            "device": _STR,
            "deterministic": _BOOL,
            "block_size": _INT,
            "num_blocks": _INT,
            "max_context_length": _INT,
            "max_batch_tokens": _INT,
            "max_running_requests": _INT,
            "schedule_policy": _STR,
            "chat_template": _object({"append_only": _nullable(_BOOL), "detail": _STR}),
            # The engine's counters (Engine.stats()): names to numbers.
            "stats": {"type": "object", "additionalProperties": _NUM},
        }
    ),
    "MemoryReport": _object(
        {
            "block_size": _INT,
            "bytes_per_block": _INT,
            "kv_dtype": _STR,
            "blocks": {"type": "object", "additionalProperties": _INT},
            "slots": _OPEN_OBJECT,
            "sharing": _OPEN_OBJECT,
        },
        open_=True,  # tree, kv_bytes, metadata, tier, ...: see MemoryReport.to_dict
    ),
    "Success": _object({"success": {"const": True}}),
    "FlushResult": _object({"success": {"const": True}, "message": _STR}),
    # {"success": true} and what Engine.save_cache reports (nodes, tokens, bytes written).
    "SaveCacheResult": {
        **_object({"success": {"const": True}}, open_=True),
        "additionalProperties": _INT,
    },
    # POST /release_program: how many retained paths the program's end released.
    "ReleaseResult": _object(
        {"success": {"const": True}, "released": {"type": "integer", "minimum": 0}}
    ),
    # GET /kv_events (docs/scale-out.md): the radix cache's stored / removed blocks.
    "KvEvents": _object(
        {
            "last_seq": _INT,
            "gap": _BOOL,
            "block_size": _INT,
            "events": {
                "type": "array",
                "items": _object(
                    {
                        "seq": _INT,
                        "kind": {"enum": ["stored", "removed", "cleared"]},
                        "hashes": _INTS,
                        "parent": _nullable(_INT),
                        "salt_seed": _INT,
                        # stored events only: where the blocks are now
                        "medium": {"enum": list(KV_MEDIA)},
                    },
                    required=["seq", "kind", "hashes", "parent", "salt_seed"],
                ),
            },
            "snapshot": {
                "type": "array",
                "items": _object(
                    {"salt_seed": _INT, "hashes": _INTS, "medium": {"enum": list(KV_MEDIA)}}
                ),
            },
        },
        required=["last_seq", "gap", "block_size", "events"],
    ),
    # The dashboard's API (docs/dashboard.md): the top level exactly, the parts open.
    "DashboardSnapshot": _object(
        {
            "time": _NUM,
            "model": _STR,
            "interval": _NUM,
            "metrics": {"type": "object", "additionalProperties": _NUM},
            "stats": {"type": "object", "additionalProperties": _NUM},
            "tree": _object(
                {
                    "nodes": {"type": "array", "items": _OPEN_OBJECT},
                    "hidden": {"type": "array", "items": _OPEN_OBJECT},
                    "evictions": {"type": "array", "items": _OPEN_OBJECT},
                    "num_nodes": _INT,
                    "shown_nodes": _INT,
                    "cached_tokens": _INT,
                },
                open_=True,
            ),
            "pool": _object(
                {"total": _INT, "free": _INT, "used": _INT, "map": _OPEN_OBJECT}, open_=True
            ),
            "requests": {"type": "array", "items": _OPEN_OBJECT},
            "programs_version": _INT,
            "point": _nullable(_OPEN_OBJECT),
        },
        required=[
            "time",
            "model",
            "interval",
            "metrics",
            "stats",
            "tree",
            "pool",
            "requests",
            "programs_version",
        ],
    ),
    "DashboardHistory": _object(
        {"interval": _NUM, "points": {"type": "array", "items": _OPEN_OBJECT}}
    ),
    "ProgramList": _object(
        {
            "version": _INT,
            "programs": {
                "type": "array",
                "items": _object(
                    {"id": _INT, "name": _STR, "time": _NUM, "status": _STR, "graph": _OPEN_OBJECT}
                ),
            },
        }
    ),
    "ProgramId": _object({"id": _INT}),
    "TokenizeResult": _object({"tokens": _INTS, "count": _INT, "max_model_len": _INT}),
    "DetokenizeResult": _object({"text": _STR}),
    "Response": _RESPONSE,
    "ResponseStreamEvent": _object({"type": _STR, "sequence_number": _INT}, open_=True),
    "AnthropicError": _object(
        {"type": {"const": "error"}, "error": _object({"type": _STR, "message": _STR})}
    ),
    "Message": _MESSAGE,
    "MessageStreamEvent": _object({"type": _STR}, open_=True),
    "ResponseDeleted": _object(
        {"id": _STR, "object": {"const": "response.deleted"}, "deleted": _BOOL}
    ),
}

_STATUS_TEXT = {
    400: "The request is malformed or refused; the error names the field (param).",
    401: "A valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>).",
    403: "A tenant's key: the dashboard's API needs the server's --api-key.",
    404: "The model (or the stored response) does not exist.",
    413: "The body is over the size limit.",
    415: "The body is not application/json.",
    500: "The server failed (a bug, or the engine failed the request).",
    503: "The engine is shut down (or failed a probe), or the queue is full (Retry-After).",
}


def _event(chunk: str, openai: bool) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.2's ``itemSchema``): its ``data`` is a
    ``chunk`` as JSON, an error (the engine failed the request), or the last, ``[DONE]``."""
    error = ref("OpenAIError" if openai else "Error")
    data = {
        "type": "string",
        "anyOf": [
            {"const": "[DONE]"},
            {
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [ref(chunk), error]},
            },
        ],
    }
    return {"type": "object", "properties": {"data": data}, "required": ["data"]}


def snapshot_events() -> dict[str, Any]:
    """``/dashboard/api/events``: each event's ``data`` is a snapshot (with its ``point``); the
    stream has no end (the client hangs up)."""
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": ref("DashboardSnapshot")}  # fmt: skip
    return {"type": "object", "properties": {"data": data}, "required": ["data"]}


def components(body_models: list[tuple[str, type[BaseModel]]]) -> dict[str, Any]:
    """Every component schema: the response and error schemas, the bodies pydantic parses
    (``body_models``: name, model) and the models they use."""
    models = [(model, "validation") for _, model in body_models]
    keys, top = models_json_schema(models, ref_template=REF)  # type: ignore[arg-type]
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    for name, model in body_models:
        # models_json_schema names each model by its class; the routes' names may differ.
        schemas[name] = schemas.pop(keys[(model, "validation")]["$ref"].rsplit("/", 1)[1])
    return {**schemas, **_RESPONSES}


# What reading a JSON body can answer (``common.read_body``): malformed or invalid, too large,
# not JSON. Every route with a body lists these among its errors.
BODY_ERRORS = (400, 413, 415)


def route_docs(
    ok: str | None,
    *,
    body: str | None = None,
    errors: tuple[int, ...] = (),
    openai: bool = False,
    anthropic: bool = False,
    stream: str | None = None,
    auth: bool = False,
    text: bool = False,
    query: list[dict[str, Any]] | None = None,
    events: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``responses`` and ``openapi_extra`` for a route: its 200 (component ``ok``, or plain text),
    ``body`` (a component, as application/json), ``errors`` (statuses; 500 always, 401 with
    ``auth``) in the native, OpenAI or Anthropic shape, a ``stream`` (the component of each
    event)."""
    content: dict[str, Any] = {}
    if text:
        content["text/plain"] = {"schema": _STR}
    if ok is not None:
        content["application/json"] = {"schema": ref(ok)}
    if stream is not None:
        content["text/event-stream"] = {"itemSchema": _event(stream, openai)}
    if events is not None:  # a stream of another shape (``snapshot_events``)
        content["text/event-stream"] = {"itemSchema": events}
    shape = "AnthropicError" if anthropic else "OpenAIError" if openai else "Error"
    error = {"content": {"application/json": {"schema": ref(shape)}}}
    codes = sorted({*errors, 500, *((401,) if auth else ())})
    responses: dict[int | str, Any] = {200: {"description": "Success", "content": content}}
    for code in codes:
        responses[code] = {"description": _STATUS_TEXT[code], **error}
    extra: dict[str, Any] = {}
    if body is not None:
        extra["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": ref(body)}},
        }
    if query:
        extra["parameters"] = query
    return {"responses": responses, "openapi_extra": extra}
