"""A backend on an OpenAI-compatible service (OpenAI, vLLM, SGLang, radixlang's ``/v1``).

``OpenAI(model)`` talks to ``/chat/completions`` (``is_chat_model=True``, the default): the
service sees the program's messages, not its text, and writes whole assistant messages, so a
``gen`` must open an assistant turn and ``select`` is not available (chat APIs give no
log-probabilities for given text). ``is_chat_model=False`` uses ``/completions`` over the
program's text, where ``select`` scores choices with ``echo`` and prompt log-probabilities.

Sampling parameters arrive in the engine's names and leave in OpenAI's; the ones OpenAI lacks
(``top_k``, ``min_p``, ``repetition_penalty``, ``skip_special_tokens``, ``regex``, ``ebnf``,
...) are sent, as vLLM and SGLang take them, only when a program sets them, so a plain program
stays a valid request for any service; OpenAI's own service refuses them, so there they raise
``NotImplementedError`` before a request is sent.

Structured output: ``gen(json_schema=...)`` becomes a chat request's ``response_format``
(``json_schema``, strict, every object closed to other keys as strict mode requires), or a
completions request's ``json_schema`` extra (SGLang's). OpenAI's own service
(``api.openai.com``) takes no regex or EBNF (nor ``dtype=``, ``gen_int``, ``gen_string``, which
are regexes) and no JSON schema on completions: those raise ``NotImplementedError`` before a
request is sent. A Lark ``grammar=`` is not part of any OpenAI-compatible API here and always
raises.

Retention: a chat call that offers tools makes a radixlang server retain its path under the
program's routing key (the ``X-Routing-Key`` header every call carries, lang/routing.py), as the
program will be back with the tools' results. A program whose calls did that ends with ``POST
/release_program`` at the server's root (the base URL without its ``/v1``), so its paths do not
stay retained until their deadline. A service without the route (vLLM, SGLang) is not asked
again; OpenAI's own service is never asked.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from radixlang.lang.backends.base import Backend
from radixlang.lang.backends.http_client import (
    DEFAULT_TIMEOUT,
    HTTPBackendError,
    RetainedPrograms,
    ServiceClient,
)
from radixlang.lang.chat_template import PLAIN, ChatTemplate
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob, decide
from radixlang.lang.routing import current_routing_key
from radixlang.sampling_fields import SAMPLING_FIELDS

log = logging.getLogger(__name__)

_SERVICE = "the OpenAI-compatible service"
# The sampling fields an OpenAI-style request carries under their own names (beams and
# logit_bias are not sent from programs; json_schema goes as response_format, below). OpenAI's
# own fields are sent always; the others (vLLM and SGLang extras) only when not the default.
_SENT = tuple(
    f
    for f in SAMPLING_FIELDS
    if f.openai is not None
    and f.name not in ("beam_width", "length_penalty", "early_stopping", "logit_bias")
)
# The program's text is not what a chat service sees: roles only mark message boundaries, and
# no end-of-turn text is a stop string.
CHAT_MESSAGES = ChatTemplate(name="chat-messages", prefix=PLAIN.prefix, suffix=PLAIN.suffix)


class OpenAIError(HTTPBackendError):
    """An OpenAI-compatible service refused a request, or could not be reached."""


class OpenAI(Backend):
    def __init__(
        self,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key: str | None = None,
        is_chat_model: bool = True,
        chat_template: ChatTemplate | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.model = model
        self.base_url = base_url.rstrip("/")
        if api_key is None:
            api_key = os.environ.get("OPENAI_API_KEY")
        self.service = ServiceClient(
            self.base_url, api_key, timeout, transport, OpenAIError, _SERVICE
        )
        self.client = self.service.client
        self.is_chat_model = is_chat_model
        # OpenAI's own service, which takes none of the extras other services do.
        self.official = "api.openai.com" in self.base_url
        # The programs whose calls made the service retain their paths (release_program, at
        # a radixlang server's root; OpenAI's own service is never asked).
        self._retained = RetainedPrograms(
            self.service, _server_root(self.base_url) + "/release_program", not self.official
        )
        self.chat_template = chat_template or (CHAT_MESSAGES if is_chat_model else PLAIN)

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    # ---- completions -------------------------------------------------------------------------
    def generate(self, prompt: str, sampling: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._need_completions("gen over the program's text")
        body = {
            "model": self.model,
            "prompt": prompt,
            **_params(sampling, chat=False, official=self.official),
        }
        self._note_retention(body)
        out = self.service.post("/completions", body)
        choice = out["choices"][0]
        return choice.get("text") or "", _meta_info(out, choice, chat=False)

    def generate_stream(
        self, prompt: str, sampling: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        self._need_completions("gen over the program's text")
        body = {
            "model": self.model,
            "prompt": prompt,
            **_params(sampling, chat=False, official=self.official),
        }
        self._note_retention(body)
        yield from _pieces(self.service.events("/completions", _streaming(body)), chat=False)

    # ---- chat completions --------------------------------------------------------------------
    def generate_chat(
        self, messages: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        body = {
            "model": self.model,
            "messages": _api_messages(messages),
            **_params(sampling, chat=True, official=self.official),
        }
        self._note_retention(body)
        out = self.service.post("/chat/completions", body)
        choice = out["choices"][0]
        message = choice.get("message") or {}
        meta = _meta_info(out, choice, chat=True)
        if message.get("tool_calls"):
            meta["tool_calls"] = message["tool_calls"]
        return message.get("content") or "", meta

    def generate_chat_stream(
        self, messages: list[dict[str, Any]], sampling: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        body = {
            "model": self.model,
            "messages": _api_messages(messages),
            **_params(sampling, chat=True, official=self.official),
        }
        self._note_retention(body)
        yield from _pieces(self.service.events("/chat/completions", _streaming(body)), chat=True)

    # ---- retention ---------------------------------------------------------------------------
    def _note_retention(self, body: dict[str, Any]) -> None:
        """Remember the program of a call that makes a radixlang server retain its path (one
        that offers tools, which retains by default, or sends ``retain_s``): the server keeps
        it under the ``X-Routing-Key`` the call carries, released when the run ends."""
        if body.get("tools") or body.get("retain_s"):
            self._retained.note(current_routing_key())

    def release_program(self, key: str) -> None:
        """End the server's retentions of ``key``'s paths (never raises: see
        ``RetainedPrograms``)."""
        self._retained.release(key)

    # ---- select ------------------------------------------------------------------------------
    def select(
        self,
        prompt: str,
        choices: Sequence[str],
        temperature: float,
        method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        """Score every choice with one echo request over ``prompt + choice`` for all choices.

        As the local backend does, every choice is scored from the same token position: the
        first token, over all choices, that holds any of a choice's characters (a token that
        spans the boundary, ``" "`` + ``"yes"`` -> ``" yes"``, counts as the choice's)."""
        self._need_completions("select")
        choices = list(choices)
        if not choices:
            raise ValueError("select needs at least one choice")
        rows = self._echo([prompt + c for c in choices])
        firsts = [_first_token_of_tail(row, len(c)) for row, c in zip(rows, choices, strict=True)]
        shortest = min(len(row) for row in rows)
        # The text's first token has no log-probability: never score from position 0.
        start = max(1, min(min(firsts), shortest - 1))
        if start >= shortest:
            raise ValueError(f"select cannot score {choices!r} after {prompt!r}: too few tokens")
        scored = [_filled(row[start:]) for row in rows]
        unconditional = None
        if method.requires_unconditional_logprobs:
            unconditional = [_filled(row) for row in self._echo(choices)]
        return decide(choices, scored, method, temperature, start, unconditional)

    def _echo(self, texts: list[str]) -> list[list[tuple[float | None, str, int]]]:
        """Each text's tokens as (logprob, token text, end offset), from one echo request."""
        body = {
            "model": self.model,
            "prompt": texts,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 0,
            "temperature": 0,
        }
        out = self.service.post("/completions", body)
        choices = sorted(out["choices"], key=lambda c: c.get("index", 0))
        if len(choices) != len(texts):
            raise OpenAIError(f"{_SERVICE} answered {len(texts)} prompts with {len(choices)}")
        rows = []
        for choice in choices:
            lps = choice.get("logprobs") or {}
            tokens, token_lps = lps.get("tokens"), lps.get("token_logprobs")
            if not tokens or token_lps is None:
                raise OpenAIError(f"{_SERVICE} returned no echoed prompt log-probabilities")
            offsets = lps.get("text_offset") or _offsets(tokens)
            ends = [*offsets[1:], offsets[-1] + len(tokens[-1])]
            rows.append(list(zip(token_lps, tokens, ends, strict=True)))
        return rows

    def _need_completions(self, what: str) -> None:
        if self.is_chat_model:
            raise NotImplementedError(
                f"{what} needs a completions model: a chat-completions service sees messages, "
                "not the program's text, and gives no log-probabilities for given text. Use "
                "OpenAI(..., is_chat_model=False) with a completions endpoint, or a radixlang "
                "or SGLang server through RuntimeEndpoint"
            )

    def shutdown(self) -> None:
        self.service.close()


def _server_root(base_url: str) -> str:
    """A radixlang server's root, where its non-OpenAI routes are: the base URL without its
    ``/v1``."""
    return base_url.removesuffix("/v1")


def _params(sampling: dict[str, Any], chat: bool, official: bool = False) -> dict[str, Any]:
    """Engine sampling names -> an OpenAI request's fields."""
    _check_structured(sampling, chat, official)
    if (sampling.get("beam_width") or 1) > 1:  # not silently dropped: the API has no beams
        raise NotImplementedError(
            "gen(beam_width=...) needs a radixlang backend (a local Runtime or a "
            "RuntimeEndpoint): OpenAI-compatible APIs have no beam search here"
        )
    out: dict[str, Any] = {"max_tokens": sampling.get("max_new_tokens", 128), "n": 1}
    for f in _SENT:
        value = sampling.get(f.name)
        if f.openai_official:  # sent with the table's default; unset seed, no stop: not sent
            value = f.default if value is None else value
            if f.kind == "stop":
                value = [value] if isinstance(value, str) else list(value)
            if value is not None and value != []:
                out[f.openai] = value
            continue
        if value is None or value == f.default or (f.name == "top_k" and value == 0):
            continue
        if official:  # OpenAI's own API has none of these: say so before it answers a 400
            raise NotImplementedError(
                f"OpenAI's API has no {f.openai}: gen({f.openai}=...) cannot run on "
                "api.openai.com. Use a radixlang, SGLang or vLLM server (RuntimeEndpoint, or "
                "OpenAI(base_url=...) pointing at one), or a local Runtime"
            )
        out[f.openai] = value
    if sampling.get("json_schema") is not None:
        schema = sampling["json_schema"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        if chat:
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": _strict(schema), "strict": True},
            }
        else:  # SGLang's completions extra: the schema's JSON text
            out["json_schema"] = json.dumps(schema)
    if sampling.get("tools"):  # gen(tools=...) on a chat model: OpenAI's function calling
        out["tools"] = sampling["tools"]
        out["tool_choice"] = sampling.get("tool_choice", "auto")
        if sampling.get("parallel_tool_calls") is False:
            out["parallel_tool_calls"] = False
    if sampling.get("return_logprob"):
        top = sampling.get("top_logprobs_num") or 0
        if chat:
            out["logprobs"] = True
            if top:
                out["top_logprobs"] = top
        else:
            out["logprobs"] = top
    return out


def _api_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A program's messages as the chat API takes them: a tool turn by its call id only."""
    return [
        {k: v for k, v in m.items() if k != "name"} if m["role"] == "tool" else m for m in messages
    ]


def _check_structured(sampling: dict[str, Any], chat: bool, official: bool) -> None:
    """Refuse the structured output the service cannot follow, before any request."""
    if sampling.get("grammar") is not None:
        raise NotImplementedError(
            "gen(grammar=...) (a Lark grammar) is not supported on the OpenAI backend: "
            "OpenAI-compatible APIs take no Lark grammars. Use a local Runtime or a radixlang "
            "server through RuntimeEndpoint, or ebnf= with a server that takes it"
        )
    if not official:
        return
    for key, what in (("regex", "regex= (or dtype=, gen_int, gen_string)"), ("ebnf", "ebnf=")):
        if sampling.get(key) is not None:
            raise NotImplementedError(
                f"OpenAI does not support {key}-constrained output: gen({what}) cannot run on "
                "api.openai.com. Use json_schema=, or a radixlang/SGLang server (RuntimeEndpoint, "
                "or OpenAI(base_url=...) pointing at one)"
            )
    if sampling.get("json_schema") is not None and not chat:
        raise NotImplementedError(
            "OpenAI's completions API does not support json_schema: use a chat model "
            "(is_chat_model=True), where it becomes response_format"
        )


# Where a JSON schema holds subschemas: maps of them, lists of them, and single ones.
_SUB_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_ONE = ("items", "additionalProperties", "not", "contains")


def _strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object that lists properties and
    says nothing of other keys (OpenAI's strict mode requires it)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUB_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _strict(v) for k, v in out[key].items()}
    for key in _SUB_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_strict(v) for v in out[key]]
    for key in _SUB_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _streaming(body: dict[str, Any]) -> dict[str, Any]:
    # include_usage: the last chunk carries token counts, as a non-streamed response does.
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


def _meta_info(out: dict[str, Any], choice: dict[str, Any], chat: bool) -> dict[str, Any]:
    usage = out.get("usage") or {}
    finish: dict[str, Any] = {"type": choice.get("finish_reason")}
    if choice.get("matched_stop") is not None:  # vLLM and SGLang say which stop matched
        finish["matched"] = choice["matched_stop"]
    meta: dict[str, Any] = {
        "id": out.get("id"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "finish_reason": finish,
    }
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        meta["cached_tokens"] = cached
    logprobs = choice.get("logprobs")
    if logprobs:
        meta.update(_output_logprobs(logprobs, chat))
    return meta


def _output_logprobs(logprobs: dict[str, Any], chat: bool) -> dict[str, Any]:
    """OpenAI's logprobs as SGLang's (logprob, token id, token text) triples; no token ids."""
    if chat:
        content = logprobs.get("content") or []
        tokens = [(e.get("logprob"), None, e.get("token")) for e in content]
        tops = [
            [(t.get("logprob"), None, t.get("token")) for t in e.get("top_logprobs") or []]
            for e in content
        ]
    else:
        lps = logprobs.get("token_logprobs") or []
        tokens = list(zip(lps, [None] * len(lps), logprobs.get("tokens") or [], strict=False))
        tops = [
            [(lp, None, tok) for tok, lp in (top or {}).items()]
            for top in logprobs.get("top_logprobs") or []
        ]
    return {"output_token_logprobs": tokens, "output_top_logprobs": tops}


def _pieces(events: Iterator[dict[str, Any]], chat: bool) -> Iterator[tuple[str, dict[str, Any]]]:
    """Stream chunks -> (new text, {}) per piece, then ("", meta_info)."""
    last: dict[str, Any] = {}
    finish: dict[str, Any] = {}
    for event in events:
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            if piece:
                yield piece, {}
            if choice.get("finish_reason") is not None:
                finish = {k: v for k, v in choice.items() if k in ("finish_reason", "matched_stop")}
        last = event
    yield "", _meta_info(last, finish, chat)


def _offsets(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for tok in tokens:
        out.append(at)
        at += len(tok)
    return out


def _first_token_of_tail(row: list[tuple[float | None, str, int]], tail: int) -> int:
    """The first token that holds any of the text's last ``tail`` characters. Counted back from
    the end, so a leading BOS token's text in the offsets (vLLM) does not shift the boundary."""
    boundary = row[-1][2] - tail
    for j, (_, _, end) in enumerate(row):
        if end > boundary:
            return j
    return len(row)


def _filled(row: list[tuple[float | None, str, int]]) -> list[TokenLogprob]:
    # A text's first token has no log-probability: count it as 0, as the local backend does.
    return [(lp if lp is not None else 0.0, None, tok) for lp, tok, _ in row]
