"""A backend on a radixlang or SGLang server, over SGLang's native HTTP API.

``RuntimeEndpoint("http://host:port")`` sends every generation call as a ``/generate`` request
over the program's whole text; the server's radix cache makes the shared part free, as the
local engine's does. The chat template comes from the server's ``/get_model_info`` (radixlang
sends the tokenizer's jinja template; an SGLang server does not, so it falls back to ``PLAIN``
unless ``chat_template=`` is given).

``report_programs=True`` posts each program run's call graph to the server's dashboard
(``POST /dashboard/api/programs``), with each call's cache hits.

A program whose calls asked the server to retain their paths (a gen that may call tools) ends
with ``POST /release_program``, so its paths do not stay retained until their deadline; an
SGLang server has no such route and is not asked again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import httpx

from radixlang.constrain.tool_formats import ToolFormat
from radixlang.lang.backends.base import Backend, StreamMeta, usage_of
from radixlang.lang.backends.http_client import (
    DEFAULT_TIMEOUT,
    HTTPBackendError,
    RetainedPrograms,
    ServiceClient,
)
from radixlang.lang.chat_template import PLAIN, ChatTemplate, from_jinja
from radixlang.lang.choices import ChoicesDecision, ChoicesSamplingMethod, TokenLogprob, decide
from radixlang.lang.routing import current_routing_key

log = logging.getLogger(__name__)

_SERVER = "the server"
# Fields of a /generate request that SGLang takes beside sampling_params, not inside it.
_TOP_LEVEL = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
              "retain_s")  # fmt: skip
# select scores the prompt's last few tokens too: where a choice's tokenization departs from
# the prompt's is found among them (a boundary merge reaches back a token or two).
_BOUNDARY_WINDOW = 4


class EndpointError(HTTPBackendError):
    """A radixlang/SGLang server refused a request, or could not be reached."""


class RuntimeEndpoint(Backend):
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        chat_template: ChatTemplate | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
        report_programs: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.report_programs = report_programs
        self._report_failed = False  # warn once, not per program
        self.service = ServiceClient(
            self.base_url, api_key, timeout, transport, EndpointError, _SERVER
        )
        # The programs whose calls asked the server to retain their paths (release_program).
        self._retained = RetainedPrograms(self.service, "/release_program")
        self.client = self.service.client
        try:
            self.model_info = self.get_model_info()
        except BaseException:
            self.service.close()
            raise
        self.chat_template = chat_template or _template_from(self.model_info)

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_info(self) -> dict[str, Any]:
        return self.service.get("/get_model_info")

    def get_server_info(self) -> dict[str, Any]:
        return self.service.get("/get_server_info")

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompt: str, sampling: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._note_retention(sampling)
        out = self.service.post("/generate", _generate_body(prompt, sampling))
        return out["text"], _meta_info(out)

    def generate_stream(
        self, prompt: str, sampling: dict[str, Any]
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """SGLang's stream: each event's ``text`` is cumulative; its ``meta_info`` has the
        counts so far and, with ``return_logprob``, the tokens' logprobs (every token's so far,
        or only the event's with SGLang's incremental streaming: both are taken). Yields each
        event's new text with its chunk meta_info, then the whole meta_info."""
        self._note_retention(sampling)
        body = _generate_body(prompt, sampling)
        body["stream"] = True
        sent = ""
        last: dict[str, Any] = {}
        tracker = StreamMeta()
        for event in self.service.events("/generate", body):
            text = event.get("text", "")
            if not text.startswith(sent):
                raise EndpointError(
                    f"{_SERVER} streamed text that does not extend the text before it "
                    "(expected SGLang's cumulative stream)"
                )
            piece = tracker.piece(_meta_info({"meta_info": event.get("meta_info")}))
            if len(text) > len(sent) or piece.get("output_token_logprobs"):
                yield text[len(sent) :], piece
                sent = text
            last = event
        yield "", tracker.final(_meta_info(last))

    def cache_prefix(self, prompt: str, wait: bool = False) -> None:
        # Always synchronous: a fork's branches are sent after this returns, so all of them
        # find the shared prefix already cached.
        self.service.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0}})

    def flush_cache(self) -> bool:
        return self.service.request("POST", "/flush_cache", check=False).status_code == 200

    # ---- retention ---------------------------------------------------------------------------
    def _note_retention(self, sampling: dict[str, Any]) -> None:
        """Remember the program of a call that asks to retain its path: it is the server's
        program key (the ``X-Routing-Key`` its requests carry), released when the run ends."""
        if sampling.get("retain_s"):
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
        """Score every choice in one batched request over the cached prompt, as
        :meth:`LocalBackend.select <radixlang.lang.backends.local.LocalBackend.select>` does: from
        the first position where any choice's tokenization of ``prompt + choice`` departs from
        the prompt's own, the same position for all. Without a tokenizer here, the server's
        token ids for the prompt's last few positions show where that is."""
        choices = list(choices)
        if not choices:
            raise ValueError("select needs at least one choice")
        cached = self.service.post(
            "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0}}
        )
        first = max(cached["meta_info"]["prompt_tokens"] - _BOUNDARY_WINDOW, 0)
        metas: list[dict[str, Any]] = [cached["meta_info"]]
        rows = self._score([prompt] + [prompt + c for c in choices], first, metas)
        departs = [_common_prefix_len(_ids(rows[0]), _ids(row)) for row in rows[1:]]
        if first > 0 and min(departs) == 0:
            # A choice departs at the window's first position or before it: look at it all.
            first = 0
            rows = self._score([prompt] + [prompt + c for c in choices], first, metas)
            departs = [_common_prefix_len(_ids(rows[0]), _ids(row)) for row in rows[1:]]
        lengths = [first + len(row) for row in rows[1:]]
        start = first + min(departs)
        start = max(1, min(start, min(lengths) - 1))
        scored = [_filled(row[start - first :]) for row in rows[1:]]
        unconditional = None
        if method.requires_unconditional_logprobs:
            unconditional = [_filled(row) for row in self._score(choices, 0, metas)]
        decision = decide(choices, scored, method, temperature, start, unconditional)
        decision.meta_info.update(usage_of(metas))
        return decision

    def _score(
        self, texts: list[str], logprob_start_len: int, metas: list[dict[str, Any]]
    ) -> list[list[tuple[float | None, int, str | None]]]:
        """Each text's prompt log-probabilities from ``logprob_start_len`` on, in one request
        (each answer's meta_info is added to ``metas``)."""
        outs = self.service.post(
            "/generate",
            {
                "text": texts,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": logprob_start_len,
            },
        )
        if not isinstance(outs, list) or len(outs) != len(texts):
            raise EndpointError(f"{_SERVER} answered a batch of {len(texts)} with {outs!r:.200}")
        metas.extend(out["meta_info"] for out in outs)
        return [[tuple(e) for e in out["meta_info"]["input_token_logprobs"]] for out in outs]

    def report_program(self, name: str, graph: dict[str, Any], status: str) -> None:
        """Post the graph to the server's dashboard. A server that cannot take it (an SGLang
        server, or one started with --no-dashboard) costs a warning, never the program."""
        body = {"name": name, "status": status, "graph": graph}
        try:
            self.service.post("/dashboard/api/programs", body)
        except EndpointError as e:
            if not self._report_failed:
                log.warning("could not report program %r to %s's dashboard: %s",
                            name, self.base_url, e)  # fmt: skip
            self._report_failed = True

    def shutdown(self) -> None:
        self.service.close()


def _template_from(info: dict[str, Any]) -> ChatTemplate:
    template = info.get("chat_template")
    if not template:  # an SGLang server does not say
        return PLAIN
    name = info.get("served_model_name") or info.get("model_path") or "model"
    chat = from_jinja(template, name, info.get("bos_token"), info.get("eos_token"))
    served = info.get("tool_call_format")
    if isinstance(served, dict):  # the server's own (its marker tokens' ids included)
        with contextlib.suppress(ValueError):
            chat = dataclasses.replace(chat, tool_format=ToolFormat.from_json(served))
    return chat


def _generate_body(text: str, sampling: dict[str, Any]) -> dict[str, Any]:
    params = dict(sampling)
    body: dict[str, Any] = {"text": text}
    for key in _TOP_LEVEL:
        if key in params:
            body[key] = params.pop(key)
    body["sampling_params"] = params
    return body


def _meta_info(out: dict[str, Any]) -> dict[str, Any]:
    meta = dict(out.get("meta_info") or {})
    if "output_ids" in out:
        meta["output_ids"] = out["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        if meta.get(key) is not None:  # JSON lists back to the triples LocalBackend gives
            meta[key] = [tuple(e) for e in meta[key]]
    return meta


def _ids(row: list[tuple[float | None, int, str | None]]) -> list[int]:
    return [tok for _, tok, _ in row]


def _filled(row: list[tuple[float | None, int, str | None]]) -> list[TokenLogprob]:
    # A text's first token has no log-probability: count it as 0, as LocalBackend does.
    return [(lp if lp is not None else 0.0, tok, text) for lp, tok, text in row]


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))
