"""Tools from a real MCP server (tests/lang/mcp/mcp_test_server.py, written with the ``mcp``
SDK and started here) over stdio and over streamable HTTP, used by programs on the local
engine through ``gen(tools=...)`` and ``run_tools``."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import radixlang as sgl
from radixlang.lang.mcp_tools import MCPConnection, MCPError
from radixlang.lang.tools import ToolCall, run_tool_calls

SERVER = Path(__file__).parent / "mcp" / "mcp_test_server.py"


@pytest.fixture(scope="module")
def stdio_server():
    with MCPConnection.stdio(sys.executable, [str(SERVER)], timeout=20) as connection:
        yield connection


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_url():
    port = _free_port()
    process = subprocess.Popen([sys.executable, str(SERVER), "http", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert process.poll() is None, "the MCP server exited"
            assert time.monotonic() < deadline, "the MCP server did not listen in 30 s"
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(10)


def test_a_servers_tools_arrive_with_their_schemas(stdio_server):
    tools = {t.name: t for t in stdio_server.tools()}
    assert set(tools) == {"multiply", "capital", "explode"}
    assert tools["multiply"].description == "Multiply two whole numbers."
    assert tools["multiply"].parameters == {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["a", "b"],
    }
    assert [t.name for t in stdio_server.tools(["capital"])] == ["capital"]
    with pytest.raises(KeyError, match="has no tool 'divide'"):
        stdio_server.tools(["divide"])


def test_calls_run_at_once_and_failures_become_error_results(stdio_server):
    calls = [
        ToolCall("multiply", {"a": 6, "b": 7}, "c1"),
        ToolCall("capital", {"country": "Japan"}, "c2"),
        ToolCall("explode", {"reason": "on purpose"}, "c3"),
        ToolCall("multiply", {"a": "six"}, "c4"),
    ]
    results = run_tool_calls(calls, stdio_server.tools(), timeout=20)
    assert [(r.call_id, r.content, r.is_error) for r in results[:2]] == [
        ("c1", "42", False),
        ("c2", "Tokyo", False),
    ]
    assert results[2].is_error and "exploded: on purpose" in results[2].content
    # Checked against the server's schema before any request.
    assert results[3].is_error and "'b' is a required property" in results[3].content


def test_a_program_calls_an_mcp_tool_on_the_local_engine(stdio_server, tiny_runtime):
    @sgl.function
    def program(s):
        s += sgl.user("What is 6 times 7?")
        s += sgl.assistant(sgl.gen("step", tools=stdio_server.tools(), tool_choice="multiply",
                                   max_tokens=48))  # fmt: skip
        s += sgl.run_tools("step", timeout=20)

    state = program.run(backend=tiny_runtime, temperature=0)
    calls = state.tool_calls("step")
    assert calls and all(c.name == "multiply" for c in calls)
    results = state.tool_results("step")
    for call, result in zip(calls, results, strict=True):
        assert not result.is_error
        assert result.content == str(call.arguments["a"] * call.arguments["b"])
    assert state.messages()[-1] == {"role": "tool", "content": results[-1].content,
                                    "tool_call_id": calls[-1].id, "name": "multiply"}  # fmt: skip


def test_tools_over_streamable_http(http_url):
    with MCPConnection.http(http_url, timeout=20) as server:
        tools = server.tools()
        assert {t.name for t in tools} == {"multiply", "capital", "explode"}
        results = run_tool_calls(
            [ToolCall("capital", {"country": "Peru"}, "a"), ToolCall("explode", {"reason": "x"})],
            tools,
            timeout=20,
        )
    assert (results[0].content, results[0].is_error) == ("Lima", False)
    assert results[1].is_error
    # The connection is closed: a call now is an error result, not a crash.
    late = run_tool_calls([ToolCall("capital", {"country": "Peru"}, "b")], tools, timeout=5)
    assert late[0].is_error and "closed" in late[0].content


def test_an_unreachable_server_is_named_in_the_error():
    with pytest.raises(MCPError, match=r"127\.0\.0\.1:9"):
        MCPConnection.http("http://127.0.0.1:9/mcp", timeout=5)
