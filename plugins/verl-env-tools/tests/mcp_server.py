"""A small MCP server for the tests (stdio; ``--http PORT`` for streamable HTTP): ``lookup``, ``add``,
and tools that fail (``boom`` raises, ``hang`` sleeps, ``shout`` answers too much)."""

from __future__ import annotations

import asyncio
import sys

from mcp.server.mcpserver import MCPServer

app = MCPServer("verl-test")
TABLE = {"capital_of_france": "Paris", "answer": "42"}


@app.tool()
def lookup(key: str) -> str:
    """Look a key up in a small table."""
    return TABLE.get(key, f"no entry for {key!r}")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def boom() -> str:
    """Always raises."""
    raise RuntimeError("the server broke")


@app.tool()
async def hang(seconds: float = 3600.0) -> str:
    """Sleeps (past any time limit)."""
    await asyncio.sleep(seconds)
    return "woke up"


@app.tool()
def shout(n: int) -> str:
    """Answers with n letters."""
    return "A" * n


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
