"""``tools`` (``verl.environments``): tool calling with a calculator, a sandboxed Python and MCP servers' tools."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl_core.contracts import EnvironmentConfig, StepResult
from verl_env_kit import MultiTurnEnvironment

from verl_env_tools.parsing import ToolCallError, load_parser
from verl_env_tools.tools import TOOLS, ToolError

__all__ = ["ToolsEnvironment", "ToolsConfig"]


@dataclass
class ToolsConfig(EnvironmentConfig):
    """``[environment]`` with ``name = "tools"``.

    Attributes:
        tools: the tools offered (``calculator``, ``python``); ``[]`` offers none (a control run:
            the model must answer alone, and any call it makes is an error).
        parser: how tool calls are read: ``"hermes"`` or ``"package.module:function"``.
        cpu_s, wall_s, memory_mb, max_output: the Python sandbox's limits per call.
        allow_network: run Python code even where the machine cannot isolate the sandbox's network.
        mcp_servers: MCP servers whose tools are offered too (:mod:`verl_env_tools.mcp_tools`), each
            ``{command = "...", args = [...]}`` (stdio; also ``env``, ``cwd``) or ``{url = "..."}``
            (streamable HTTP; also ``headers``); their calls get ``wall_s`` and ``max_output``.
    """

    max_turns: int = 2
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    parser: str = "hermes"
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    max_output: int = 2000
    allow_network: bool = False
    mcp_servers: list[dict[str, Any]] = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        unknown = [t for t in self.tools if t not in TOOLS]
        if unknown:
            raise ValueError(f"tools: unknown {unknown}; the tools are {sorted(TOOLS)}")
        load_parser(self.parser)
        from verl_env_tools.mcp_tools import check_server_specs

        check_server_specs(self.mcp_servers)
        if self.cpu_s < 1 or self.wall_s <= 0 or self.memory_mb < 16 or self.max_output < 1:
            raise ValueError("cpu_s/wall_s/memory_mb/max_output: must be positive (memory_mb >= 16)")
        if "python" in self.tools and not self.allow_network:
            from verl_env_tools.sandbox import network_isolation_available

            if not network_isolation_available():
                raise ValueError("tools: the python tool needs a network namespace, which this machine does not "
                                 "allow; set environment.allow_network = true to run it with network access")


class ToolsEnvironment(MultiTurnEnvironment):
    """Each model turn either calls tools (Hermes ``<tool_call>`` blocks, answered as ``tool``
    messages) or is the final answer (the trajectory ends; the reward function scores it).

    A call that cannot be parsed, names an unknown tool, or fails (an exception, a timeout, a
    sandbox limit, an MCP server's error) is answered with ``error: ...`` so the model can recover,
    and counted in ``env/tool_errors``; the run goes on. MCP servers are shared by the process and
    stopped at its exit (:func:`verl_env_tools.mcp_tools.close_servers`), not by :meth:`close`.
    """

    Config = ToolsConfig
    task = {
        "model": {"path": "builtin:tiny-qwen2-tools"},
        "data": {"train": "builtin:tool-arithmetic"},
    }

    def __init__(self, config: ToolsConfig | None = None) -> None:
        super().__init__(config)
        self._parse = load_parser(self.config.parser)
        self._builtin = {name: TOOLS[name] for name in self.config.tools}
        self._all: dict[str, Any] | None = None

    @property
    def _tools(self) -> dict[str, Any]:
        """The built-in tools, then the MCP servers' (started on first use, shared by the process)."""
        if self._all is None:
            mcp = {}
            if self.config.mcp_servers:
                from verl_env_tools.mcp_tools import server_tools

                mcp = server_tools(self.config.mcp_servers, taken=set(self._builtin))
            self._all = {**self._builtin, **mcp}
        return self._all

    def tools(self) -> list[dict[str, Any]] | None:
        return [t.schema() for t in self._tools.values()] or None

    def reset(self, *, prompt: list[dict[str, str]], extra_info: dict[str, Any]) -> list[dict[str, str]]:
        return list(prompt)

    def step(self, response: str) -> StepResult:
        try:
            calls = self._parse(response)
        except ToolCallError as exc:
            return StepResult([{"role": "tool", "content": f"error: {exc}"}], 0.0, False, {"tool_error": True})
        if not calls:
            return StepResult(None, 0.0, True)
        observations, failed = [], False
        for call in calls:
            tool = self._tools.get(call.name)
            try:
                if tool is None:
                    raise ToolError(f"no tool named {call.name!r}; the tools are {sorted(self._tools) or 'none'}")
                content = tool(call.arguments, self.config)
            except Exception as exc:  # a broken tool answers with its error, the run goes on
                content, failed = f"error: {exc}", True
            observations.append({"role": "tool", "name": call.name, "content": content})
        return StepResult(observations, 0.0, False, {"tool_error": failed})
