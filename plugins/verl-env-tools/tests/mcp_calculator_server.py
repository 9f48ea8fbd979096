"""An MCP server (stdio) offering the built-in ``calculator``: same name, description, schema and answers.

Written with the SDK's low-level ``Server`` so the input schema is published exactly as the built-in
tool's (the high-level API derives its own, with titles), and the prompt the chat template renders is
the one the tool model was warm-started on. ``python mcp_calculator_server.py [LOG]``: every call is
appended to the file LOG (a line each), so a test can see the calls really came through MCP.
"""

from __future__ import annotations

import sys

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

from verl_env_tools.tools import ToolError, calculator

LOG = sys.argv[1] if len(sys.argv) > 1 else None


async def list_tools(ctx, params) -> types.ListToolsResult:
    return types.ListToolsResult(tools=[types.Tool(name=calculator.name, description=calculator.description,
                                                   input_schema=calculator.parameters)])


async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
    if LOG:
        with open(LOG, "a") as f:
            f.write(f"{params.name}\n")
    if params.name != calculator.name:
        return types.CallToolResult(content=[types.TextContent(type="text", text=f"no tool {params.name!r}")],
                                    is_error=True)
    try:
        text, failed = calculator(params.arguments or {}, None), False
    except ToolError as exc:
        text, failed = str(exc), True
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=failed)


app = Server("verl-calculator", on_list_tools=list_tools, on_call_tool=call_tool)


async def main() -> None:
    async with stdio_server() as (read, write):
        await app.run(read, write, app.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
