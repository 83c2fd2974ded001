"""Tools from MCP servers: connect with the ``mcp`` SDK (a command over stdio, or a URL over
streamable HTTP), list the server's tools, and hand them to ``gen(tools=...)`` as
:class:`~radixlang.lang.tools.Tool`\\s whose calls go to the server.

The SDK is async; programs and ``run_tools`` are threads. A connection therefore keeps its own
event loop on a thread of its own, opened once and used by every call (as many at once as the
model asks for), and closed by :meth:`MCPConnection.close` (or leaving its ``with`` block)::

    with MCPConnection.stdio("python", ["my_server.py"]) as server:
        s += sgl.assistant(sgl.gen("step", tools=server.tools()))
        s += sgl.run_tools("step")

A tool's arguments are checked against the schema the server gave (``jsonschema``) before the
call; a result the server marks as an error, and a failed call, become error results the model
reads, as a Python tool's exception does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from radixlang.lang.tools import DEFAULT_TIMEOUT_S, Tool, make_tool


class MCPError(RuntimeError):
    """An MCP server could not be reached, or refused a request."""


class MCPToolError(RuntimeError):
    """A tool's result that the server marked as an error (its text is the message)."""


class MCPConnection:
    """One open connection to an MCP server (see the module's doc)."""

    def __init__(self, server: Any, name: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        try:
            from mcp import Client
        except ImportError as e:  # pragma: no cover - the extra is installed with the package
            raise ImportError("MCP tools need the mcp SDK: pip install 'radixlang[agents]'") from e
        self.name = name
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mcp-{name}",
                                        daemon=True)  # fmt: skip
        self._thread.start()
        self._client = Client(server, read_timeout_seconds=timeout)
        self._closed = False
        try:
            self._run(self._client.__aenter__(), f"connecting to {name}")
        except BaseException:
            self._stop_loop()
            raise
        self._tools: list[Tool] | None = None

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> MCPConnection:
        """Start ``command args`` and speak MCP over its stdin and stdout."""
        from mcp import StdioServerParameters

        params = StdioServerParameters(command=command, args=list(args),
                                       env=dict(env) if env is not None else None)  # fmt: skip
        return cls(params, " ".join([command, *args]), timeout)

    @classmethod
    def http(cls, url: str, timeout: float = DEFAULT_TIMEOUT_S) -> MCPConnection:
        """Speak MCP over streamable HTTP to ``url`` (e.g. ``http://127.0.0.1:8000/mcp``)."""
        return cls(url, url, timeout)

    def _run(self, coroutine: Any, what: str, timeout: float | None = None) -> Any:
        if self._closed:
            coroutine.close()
            raise MCPError(f"MCP server {self.name}: the connection is closed")
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        limit = timeout or self.timeout
        try:
            return future.result(limit)
        except TimeoutError:
            future.cancel()
            raise MCPError(f"MCP server {self.name}: {what} took over {limit:g} s") from None
        except MCPError:
            raise
        except Exception as e:
            raise MCPError(f"MCP server {self.name}: {what} failed: {type(e).__name__}: {e}") from e

    def tools(self, names: Sequence[str] | None = None) -> list[Tool]:
        """The server's tools (listed once), or those of ``names``."""
        if self._tools is None:
            listing = self._run(self._client.list_tools(), "listing its tools")
            self._tools = [self._tool(t) for t in listing.tools]
        if names is None:
            return list(self._tools)
        by_name = {t.name: t for t in self._tools}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise KeyError(f"MCP server {self.name} has no tool {missing[0]!r}: it has "
                           f"{', '.join(by_name) or 'none'}")  # fmt: skip
        return [by_name[n] for n in names]

    def _tool(self, listed: Any) -> Tool:
        schema = dict(listed.input_schema or {"type": "object", "properties": {}})
        # Titles the SDK derives from names ("A" for a) only cost the prompt tokens.
        schema.pop("title", None)
        schema["properties"] = {
            key: {k: v for k, v in prop.items() if k != "title"} if isinstance(prop, dict) else prop
            for key, prop in (schema.get("properties") or {}).items()
        }

        def call(**arguments: Any) -> str:
            return self.call(listed.name, arguments)

        return make_tool(listed.name, listed.description or "", schema, call)

    def call(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Call tool ``name``: its result as text (raises :class:`MCPToolError` for a result the
        server marks as an error)."""
        result = self._run(self._client.call_tool(name, dict(arguments)), f"calling {name}")
        text = _result_text(result)
        if getattr(result, "is_error", False):
            raise MCPToolError(text or f"{name} failed")
        return text

    def close(self) -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):
            self._run(self._client.__aexit__(None, None, None), "closing", timeout=10)
        self._closed = True
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> MCPConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _result_text(result: Any) -> str:
    """A tool result's content as text: its text parts joined, else its structured content."""
    parts = []
    for block in result.content or []:
        if getattr(block, "type", None) == "text":
            parts.append(block.text)
        else:  # an image, audio or resource: named, as the model cannot see it
            parts.append(f"[{getattr(block, 'type', 'content')}]")
    if parts:
        return "\n".join(parts)
    structured = getattr(result, "structured_content", None)
    return json.dumps(structured) if structured is not None else ""
