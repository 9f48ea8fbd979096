"""A verifiers 0.4 taskset as verl sees it: its tasks, their tools and stops, and their scoring.

verifiers 0.4.0 (``verifiers.v1``) splits an environment into a **taskset** (an installed module exporting a
``vf.Taskset`` subclass through ``__all__``, loaded by id as ``vf.load_taskset`` does: ``my-env`` imports
``my_env``), its **tasks** (``vf.Task`` with ``TaskData``: ``prompt``, ``system_prompt``, the taskset's own
fields such as ``answer``), the tasks' **toolsets** (``vf.Toolset`` classes whose ``@vf.tool`` methods the
model may call), **stops** (``@vf.stop`` predicates on the ``vf.Trace``) and **rewards** (``@vf.reward``
methods, weighted, and config-plugged reward functions), which ``Task.score`` records on the trace.

verifiers' own rollouts run a harness program against a model endpoint; verl instead drives the
conversation in its own token-in/token-out loop (``verl_env_kit``) and calls the taskset's own pieces:
the tools through an in-process MCP server the toolset registers itself on (as ``vf.Toolset.register``
does for verifiers' tool servers), the stops and ``Task.score`` on a ``vf.Trace`` built from the turns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib.util
import json
from typing import Any

try:
    import verifiers.v1 as vf
    from verifiers.v1.session import hook_boundary
except ImportError as exc:  # `verl plugins list --check` shows this, the run stops with it
    raise ImportError(f"the verifiers environment needs verifiers 0.4 ({exc}): pip install "
                      f"'verl-env-verifiers[verifiers]', or next to pinned packages `pip install --no-deps "
                      f"verifiers==0.4.0` and pip install 'verl-env-verifiers[verifiers-core]'") from None

__all__ = ["EnvironmentNotInstalled", "Taskset", "check_installed", "load", "module_of", "prompt_messages"]


class EnvironmentNotInstalled(ValueError):
    """The environment id names no installed taskset module."""


def module_of(env_id: str) -> str:
    """The module verifiers imports for ``env_id``: a hub id ``owner/name@version`` is installed as ``name``."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def check_installed(env_id: str) -> None:
    """:class:`EnvironmentNotInstalled` with the install command when ``env_id``'s module cannot be found."""
    module = module_of(env_id)
    if importlib.util.find_spec(f"verifiers.v1.tasksets.{module}") or importlib.util.find_spec(module):
        return
    name = env_id.rsplit("/", 1)[-1].split("@", 1)[0]
    hub = f"prime env install {env_id}" if "/" in env_id else f"prime env install <owner>/{name}"
    raise EnvironmentNotInstalled(
        f"id: the verifiers environment {env_id!r} is not installed (no module {module!r} to import); install "
        f"it first: pip install {name} (a package on an index), pip install -e ./{name} (a local folder), or "
        f"`{hub}` (the Environments Hub)")


class Taskset:
    """One loaded taskset: its tasks by index (``TaskData.idx``) and its shared toolsets."""

    def __init__(self, env_id: str, args: dict[str, Any]) -> None:
        check_installed(env_id)
        self.env_id = env_id
        config_type = vf.taskset_config_type(env_id)
        try:
            config = config_type.model_validate({**args, "id": env_id})
        except Exception as exc:  # pydantic's ValidationError: which argument, what was wrong
            raise ValueError(f"args: the verifiers environment {env_id!r} refuses environment.args "
                             f"{json.dumps(args, default=str)} ({config_type.__name__}): {exc}") from None
        self.taskset = vf.load_taskset(config)
        if not self.taskset.bounded:
            raise ValueError(f"the verifiers environment {env_id!r} yields tasks without end; verl reads a "
                             f"taskset whole (set a size in environment.args if it has one)")
        self.tasks = list(self.taskset)
        self.shared_toolsets = type(self.taskset).toolsets(self.taskset.config)

    def task(self, index: Any) -> Any:
        if not isinstance(index, int) or not 0 <= index < len(self.tasks):
            raise ValueError(f"verifiers environment {self.env_id!r}: the row's extra_info.index is {index!r}, not "
                             f"a task of the taskset (0..{len(self.tasks) - 1}); rows come from "
                             f"data.train = 'verifiers:{self.env_id}'")
        return self.tasks[index]


@functools.lru_cache(maxsize=8)
def _load(env_id: str, args_json: str) -> Taskset:
    return Taskset(env_id, json.loads(args_json))


def load(env_id: str, args: dict[str, Any]) -> Taskset:
    """The taskset ``env_id`` with ``args`` (its ``TasksetConfig`` fields), loaded once per process."""
    return _load(env_id, json.dumps(args, sort_keys=True, default=str))


def prompt_messages(data: Any) -> list[dict[str, Any]]:
    """A task's ``system_prompt`` and ``prompt`` as chat messages."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*messages, {"role": "user", "content": data.prompt}]
    return [*messages, *(m.model_dump(exclude_none=True) for m in data.prompt or [])]


def run(coroutine: Any) -> Any:
    """Run a coroutine on a loop of this call (the agent loop calls environments from worker threads).

    Where this thread already runs an event loop (a notebook, Playwright's sync API), on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


# -- tools --------------------------------------------------------------------------------------------------


class Tools:
    """A task's toolsets (its own and the taskset's) on one in-process MCP server: the schemas the chat
    template gets and the calls the model makes, each run by the toolset's own ``@vf.tool`` method."""

    def __init__(self, toolsets: list[Any]) -> None:
        from mcp.server.mcpserver import MCPServer

        self.server = MCPServer("verl-env-verifiers")
        for toolset in toolsets:
            toolset.register(self.server)
        self.schemas = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                          "parameters": _input_schema(t)}}
                        for t in run(self.server.list_tools())]
        self.names = [s["function"]["name"] for s in self.schemas]

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """The tool's output text and whether it is an error (an unknown tool, bad arguments, the tool raising)."""
        if name not in self.names:
            return f"error: no tool {name!r}; the tools are {self.names}", True
        try:
            result = run(self.server.call_tool(name, arguments))
        except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's observation
            return f"error: {type(exc).__name__}: {exc}", True
        text = "".join(getattr(part, "text", "") for part in getattr(result, "content", []) or [])
        return text, bool(getattr(result, "is_error", False) or getattr(result, "isError", False))


def _input_schema(tool: Any) -> dict[str, Any]:
    """A listed tool's parameters (``input_schema`` in mcp 2.3, ``inputSchema`` before)."""
    return getattr(tool, "input_schema", None) or getattr(tool, "inputSchema", None) or {"type": "object"}


# -- the trace: stops and scoring --------------------------------------------------------------------------


def trace_of(task: Any, messages: list[dict[str, Any]], calls: dict[int, list[Any]], first_turn: int) -> Any:
    """A ``vf.Trace`` of ``task`` holding ``messages``: the model's turns (assistant messages from position
    ``first_turn`` on) marked as sampled, ``calls`` the tool calls parsed from the assistant message at a position."""
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()))
    call_ids = iter(range(1_000_000))
    pending: list[str] = []
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content") or ""
        if role == "assistant":
            tool_calls = [vf.ToolCall(id=f"call_{next(call_ids)}", name=c.name, arguments=json.dumps(c.arguments))
                          for c in calls.get(i, [])]
            pending = [c.id for c in tool_calls]
            vf_message: Any = vf.AssistantMessage(content=content, tool_calls=tool_calls or None)
        elif role == "tool":
            vf_message = vf.ToolMessage(content=content, tool_call_id=pending.pop(0) if pending else "call")
        elif role == "system":
            vf_message = vf.SystemMessage(content=content)
        else:
            vf_message = vf.UserMessage(content=content)
        trace.nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=vf_message,
                                          sampled=role == "assistant" and i >= first_turn))
    return trace


def trace_stops(task: Any) -> list[Any]:
    """The task's ``@vf.stop`` predicates that read the trace (those on a model request or response
    belong to verifiers' model proxy, which verl does not run)."""
    return [fn for fn in task.hooks("stop") if hook_boundary(fn, allow_trace=True) is vf.Trace]


async def stopped(task: Any, trace: Any) -> str | None:
    """The name of the first stop predicate that says the episode is over, if any."""
    for fn in trace_stops(task):
        result = fn(trace)
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return fn.__name__
    return None


async def score(task: Any, trace: Any) -> dict[str, tuple[float, float]]:
    """``Task.score`` on the trace: each reward's ``(score, weight)`` by name."""
    await task.score(trace)
    missing = [name for name, reward in trace.rewards.items() if reward is None]
    if missing:
        raise RuntimeError(f"rewards {missing} were not scored")
    return {name: (reward.score, reward.weight) for name, reward in trace.rewards.items()}
