"""An unexpected exception inside a route (here the tokenizer failing) is a JSON 500 naming it,
and the connection stays open for the client's next request; the engine goes on serving."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlparse

import pytest
from server_checks import assert_no_leak

MARKER = "[boom]"


@pytest.fixture()
def failing_tokenizer(engine, monkeypatch):
    encode = engine.tokenizer.encode

    def faulty(text, *args, **kwargs):
        if isinstance(text, str) and MARKER in text:
            raise RuntimeError("the tokenizer broke")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", faulty)


def _post(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data  # fmt: skip


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))  # fmt: skip
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        rest += chunk
    return int(head.split()[1]), json.loads(rest[:length])


@pytest.mark.parametrize(
    "path, body, openai",
    [
        ("/generate", {"text": f"hi {MARKER}", "sampling_params": {"max_new_tokens": 2}}, False),
        ("/v1/completions", {"model": "default", "prompt": f"x {MARKER}", "max_tokens": 2}, True),
    ],
)
def test_an_internal_error_is_a_500_and_the_connection_lives_on(
    server, client, failing_tokenizer, path, body, openai
):
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(_post(path, body))
        status, error = _read_response(sock)
        assert status == 500
        message = error["error"]["message"]
        assert message == "internal error: RuntimeError: the tokenizer broke"
        assert error["error"]["type"] == "server_error"
        # The same connection answers the next request.
        sock.sendall(_post("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}))
        status, answer = _read_response(sock)
        assert status == 200 and answer["meta_info"]["completion_tokens"] == 2
    assert_no_leak(client)
