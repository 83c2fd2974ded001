"""A real MCP server written with the ``mcp`` SDK, for the language's MCP tests: started by the
tests over stdio (no argument) or streamable HTTP (``http PORT``)."""

from __future__ import annotations

import sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

# Bounded, so the grammar built from this server's schema ends a random model's numbers.
Digits = Annotated[int, Field(ge=0, le=99)]

server = MCPServer("radixlang-test-tools", log_level="WARNING")


@server.tool()
def multiply(a: Digits, b: Digits) -> int:
    """Multiply two whole numbers."""
    return a * b


@server.tool()
def capital(country: str) -> str:
    """The capital city of a country."""
    capitals = {"france": "Paris", "japan": "Tokyo", "peru": "Lima"}
    return capitals.get(country.lower(), "unknown")


@server.tool()
def explode(reason: str) -> str:
    """Always fails, saying why."""
    raise ToolError(f"exploded: {reason}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
