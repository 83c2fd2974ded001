"""What the HTTP backends share: one pooled ``httpx.Client``, error mapping, and SSE parsing.

Programs call a backend from many worker threads at once (a fork's branches, a batch's
programs); one ``httpx.Client`` is thread-safe and keeps a pool of connections for them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx

from radixlang.lang.routing import add_routing_header

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 600.0  # seconds: a long generation on a busy server is not a failure


class HTTPBackendError(RuntimeError):
    """The server refused a request (``status_code`` set) or could not be reached (None)."""

    def __init__(
        self,
        message: str,
        status_code: int | None = None,
        error_type: str | None = None,
        url: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error_type = error_type
        self.url = url


def make_client(
    base_url: str,
    api_key: str | None,
    timeout: float | None,
    transport: httpx.BaseTransport | None,
) -> httpx.Client:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(timeout),
        # As many idle connections as a wide fork keeps busy, so branches reuse them.
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        transport=transport,
        # A program's requests carry its routing key (lang/routing.py), so that a server with
        # several replicas keeps them on one; servers without replicas ignore the header.
        event_hooks={"request": [add_routing_header]},
    )


def error_message(body: Any, fallback: str) -> tuple[str, str | None]:
    """(message, type) from an error body: OpenAI/radixlang's ``{"error": {...}}``, vLLM and
    older SGLang's ``{"message": ...}``, or the raw text."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"]), err.get("type")
        if isinstance(err, str) and err:
            return err, None
        if body.get("message"):
            return str(body["message"]), body.get("type")
        if body.get("detail"):  # FastAPI's own errors
            return str(body["detail"]), None
    return fallback, None


def check_response(
    response: httpx.Response, error_cls: type[HTTPBackendError], server: str
) -> None:
    """Raise ``error_cls`` for a non-2xx response (the body must be read already)."""
    if response.is_success:
        return
    try:
        body: Any = response.json()
    except ValueError:
        body = None
    fallback = response.text.strip() or response.reason_phrase
    message, error_type = error_message(body, fallback)
    raise error_cls(
        f"{server} returned {response.status_code} for {response.request.method} "
        f"{response.request.url.path}: {message}",
        status_code=response.status_code,
        error_type=error_type,
        url=str(response.request.url),
    )


def connection_error(
    error: httpx.TransportError, error_cls: type[HTTPBackendError], server: str, url: str
) -> HTTPBackendError:
    if isinstance(error, httpx.TimeoutException):
        what = f"timed out talking to {server} at {url}"
    else:
        what = f"cannot reach {server} at {url}"
    return error_cls(f"{what}: {type(error).__name__}: {error}", url=url)


def iter_sse(
    response: httpx.Response, error_cls: type[HTTPBackendError], server: str
) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream's ``data:`` lines, up to ``[DONE]``. An
    event that carries an error (a failure after the stream began) raises it."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments, event: lines
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise error_cls(f"{server} sent a malformed stream event: {data[:200]!r}") from None
        if isinstance(event, dict) and "error" in event:
            message, error_type = error_message(event, str(event["error"]))
            status = event["error"].get("code") if isinstance(event["error"], dict) else None
            raise error_cls(
                f"{server} failed mid-stream: {message}",
                status_code=status if isinstance(status, int) else None,
                error_type=error_type,
                url=str(response.request.url),
            )
        yield event


class ServiceClient:
    """One service's pooled client: JSON requests and server-sent event streams, with every
    failure (refused, unreachable, broken stream) raised as ``error_cls`` naming the service."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float | None,
        transport: httpx.BaseTransport | None,
        error_cls: type[HTTPBackendError],
        name: str,
    ) -> None:
        self.base_url = base_url
        self.error_cls = error_cls
        self.name = name
        self.client = make_client(base_url, api_key, timeout, transport)

    def request(
        self, method: str, path: str, body: Any = None, check: bool = True
    ) -> httpx.Response:
        try:
            response = self.client.request(method, path, json=body)
        except httpx.TransportError as e:
            raise connection_error(e, self.error_cls, self.name, self.base_url) from None
        if check:
            check_response(response, self.error_cls, self.name)
        return response

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self.request("POST", path, body).json()

    def get(self, path: str) -> Any:
        return self.request("GET", path).json()

    def events(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of a streamed POST. Leaving early (the consumer stopped) closes the
        connection, which makes the service stop generating."""
        try:
            with self.client.stream("POST", path, json=body) as response:
                if not response.is_success:
                    response.read()
                    check_response(response, self.error_cls, self.name)
                yield from iter_sse(response, self.error_cls, self.name)
        except httpx.TransportError as e:
            raise connection_error(e, self.error_cls, self.name, self.base_url) from None

    def close(self) -> None:
        self.client.close()


class RetainedPrograms:
    """The programs whose calls asked a radixlang server to retain their paths (a call that
    may call tools), and the end of that when their run ends: ``POST /release_program`` at
    ``url``. A service without the route (SGLang's, vLLM's: 404 or 405) is not asked again, and
    ``supported=False`` never asks; any other failure is a warning, never the program's error
    (the paths then stay until their deadline)."""

    def __init__(self, service: ServiceClient, url: str, supported: bool = True) -> None:
        self.service = service
        self.url = url
        self.supported = supported
        self.keys: set[str] = set()

    def note(self, key: str | None) -> None:
        """A call of program ``key`` made the server retain its path."""
        if key is not None and self.supported:
            self.keys.add(key)

    def release(self, key: str) -> None:
        if key not in self.keys:
            return
        self.keys.discard(key)
        if not self.supported:
            return
        try:
            response = self.service.request("POST", self.url, {"routing_key": key}, check=False)
            if response.status_code in (404, 405):
                self.supported = False  # no such route: the deadline bounds the retentions
                return
            check_response(response, self.service.error_cls, self.service.name)
        except Exception as e:
            log.warning("could not release program %r's retained paths on %s (they stay "
                        "until their deadline): %s", key, self.service.base_url, e)  # fmt: skip
