"""The REPL on a running server (``radixlang serve``, or any server with the same routes).

Chat turns stream from the OpenAI route ``/v1/chat/completions`` (``stream=True``, with the
usage at the end): the server applies the model's own chat template, as the local backend does,
and its usage says how many prompt tokens its cache held (``prompt_tokens_details``). A fork is
``n`` such requests at once, so each branch streams and reports on its own, and the server's
scheduler computes their shared prompt once. Stopping a stream closes its connection, which
the server takes as an abort. ``/stats`` reads ``/get_server_info``; there is no route for the
radix tree, so ``/tree`` is not available here.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from radixlang.repl.backends import (
    BackendError,
    ChatBackend,
    Generation,
    Piece,
    branch_sampling,
)
from radixlang.repl.session import Usage


class RemoteChat(ChatBackend):
    def __init__(self, url: str, api_key: str | None = None, connect_timeout: float = 10.0):
        self.url = url.rstrip("/")
        self.where = self.url
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No read timeout: a long reply streams for as long as it takes.
        timeout = httpx.Timeout(connect=connect_timeout, read=None, write=30.0, pool=None)
        self.client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        try:
            models = self._get("/v1/models")
        except BackendError as e:
            self.client.close()
            raise BackendError(f"cannot reach a server at {self.url}: {e}") from None
        data = models.get("data") or []
        if not data:
            self.client.close()
            raise BackendError(f"{self.url}/v1/models lists no model")
        self.name = str(data[0].get("id"))
        self._program_backend: Any = None

    # ---- chat ------------------------------------------------------------------------------
    def chat(
        self, messages: list[dict[str, str]], sampling: dict[str, Any], n: int, first: int = 0
    ) -> Generation:
        body: dict[str, Any] = {
            "model": self.name,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": sampling["max_new_tokens"],
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
        }
        if sampling.get("top_k", -1) > 0:
            body["top_k"] = sampling["top_k"]
        responses: list[httpx.Response] = []
        lock = threading.Lock()

        def close_all() -> None:  # unblocks a worker waiting for its next line
            with lock:
                for r in responses:
                    r.close()

        def stream(branch: int, cancelled: threading.Event) -> Iterator[Piece]:
            seed = branch_sampling(sampling, first + branch).get("seed")
            request = body if seed is None else {**body, "seed": seed}
            with self.client.stream("POST", "/v1/chat/completions", json=request) as response:
                with lock:
                    responses.append(response)
                if cancelled.is_set():
                    return
                if response.status_code != 200:
                    response.read()
                    yield Piece(branch, done=True, error=_error_message(response))
                    return
                yield from _chat_pieces(branch, response.iter_lines(), cancelled)

        return Generation(n, stream, on_cancel=close_all)

    # ---- the cache -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        info = self._get("/get_server_info")
        stats = dict(info.get("stats") or {})
        if not stats:
            raise BackendError(f"{self.url}/get_server_info carries no stats: {sorted(info)}")
        stats["model"] = info.get("served_model_name", self.name)
        return stats

    def flush(self) -> None:
        try:
            response = self.client.post("/flush_cache")
        except httpx.HTTPError as e:
            raise BackendError(f"{self.url}: {e}") from None
        if response.status_code != 200:
            raise BackendError(_error_message(response))

    # ---- programs and lifetime -------------------------------------------------------------
    def program_backend(self) -> Any:
        if self._program_backend is None:
            from radixlang.lang.backends.endpoint import RuntimeEndpoint

            self._program_backend = RuntimeEndpoint(self.url, api_key=self.api_key)
        return self._program_backend

    def close(self) -> None:
        self.client.close()

    def _get(self, path: str) -> dict[str, Any]:
        try:
            response = self.client.get(path)
        except httpx.HTTPError as e:
            raise BackendError(f"{self.url}{path}: {e}") from None
        if response.status_code != 200:
            raise BackendError(f"{self.url}{path}: {_error_message(response)}")
        return response.json()


def _chat_pieces(branch: int, lines: Iterator[str], cancelled: threading.Event) -> Iterator[Piece]:
    """One streamed chat completion's server-sent events as pieces; the usage event (after the
    last choice) completes the final piece."""
    finish: str | None = None
    usage: dict[str, Any] = {}
    for line in lines:
        if cancelled.is_set():
            yield Piece(branch, done=True, usage=_usage(usage, "abort"))
            return
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            yield Piece(branch, done=True, error=_message(event))
            return
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                yield Piece(branch, text)
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
    yield Piece(branch, done=True, usage=_usage(usage, finish))


def _usage(usage: dict[str, Any], finish: str | None) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        finish_reason=finish,
    )


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or body)


def _error_message(response: httpx.Response) -> str:
    try:
        return f"HTTP {response.status_code}: {_message(response.json())}"
    except ValueError:
        return f"HTTP {response.status_code}: {response.text[:200]}"
