"""Tools of MCP servers (``environment.mcp_servers``), offered next to the built-in ones.

Each entry of ``mcp_servers`` is one server: ``{command = "...", args = [...], env = {...}, cwd = "..."}``
starts it as a subprocess and talks to it over stdio; ``{url = "...", headers = {...}}`` connects to a
running one over streamable HTTP. ``startup_s`` (either kind, default 60) bounds its start and tool
listing.

A server is started **once per process** (the first environment that needs its tools starts it,
every trajectory after that shares its session) on an event loop of its own, in a daemon thread:
the environment's ``step`` runs on the episode loop's thread pool and blocks on the call, so the
concurrent trajectories' calls overlap on the one session. Calls are held to the environment's
limits, as the Python sandbox's are: ``wall_s`` seconds per call (a late call is cancelled on the
server), ``max_output`` characters of answer. A tool's error result, a server error, a timeout or a
dead server answers the model with ``error: ...`` (counted in ``env/tool_errors``); a server that
cannot start, or whose tool names clash with another's, stops the run at its first step instead.

The servers never outlive the process: :func:`close_servers` (run at exit) ends every session, which
stops a stdio server (its stdin closed, then SIGTERM/SIGKILL to its process group); a process that
dies without running it closes the pipes, and a stdio server exits on the end of its input.

Needs the ``mcp`` package (``pip install 'verl-env-tools[mcp]'``); importing this module does not.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import os
import threading
from typing import Any

from verl_env_tools.tools import Tool, ToolError

__all__ = ["check_server_specs", "server_tools", "close_servers"]

_STDIO_KEYS = {"command": str, "args": list, "env": dict, "cwd": str, "startup_s": (int, float)}
_HTTP_KEYS = {"url": str, "headers": dict, "startup_s": (int, float)}
_GRACE_S = 5.0  # past wall_s, the wait for an answer the client's own timeout should already have ended


def check_server_specs(specs: list[dict[str, Any]]) -> None:
    """Refuse an ``mcp_servers`` entry that is neither a stdio nor an HTTP server; check ``mcp`` is installed."""
    for i, spec in enumerate(specs):
        where = f"mcp_servers[{i}]"
        if not isinstance(spec, dict) or ("command" in spec) == ("url" in spec):
            raise ValueError(f"{where}: needs either command (a stdio server) or url (a streamable HTTP server), "
                             f"got {spec!r}")
        keys = _STDIO_KEYS if "command" in spec else _HTTP_KEYS
        for key, value in spec.items():
            if key not in keys:
                raise ValueError(f"{where}: unknown key {key!r}; a {'stdio' if 'command' in spec else 'HTTP'} "
                                 f"server takes {sorted(keys)}")
            if not isinstance(value, keys[key]) or isinstance(value, bool):
                raise ValueError(f"{where}.{key}: wrong type {type(value).__name__}")
        if not all(isinstance(a, str) for a in spec.get("args", [])):
            raise ValueError(f"{where}.args: must be strings")
        if spec.get("startup_s", 1) <= 0:
            raise ValueError(f"{where}.startup_s: must be positive")
    if specs:
        try:
            import mcp  # noqa: F401
        except ImportError:
            raise ValueError("mcp_servers: the mcp package is not installed; pip install 'verl-env-tools[mcp]'") \
                from None


def _text_of(result: Any) -> str:
    parts = []
    for block in result.content:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')} omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


def _cap(text: str, max_output: int) -> str:
    if len(text) > max_output:  # as the sandbox cuts its output
        return text[:max_output] + f"\n... [{len(text) - max_output} characters cut]"
    return text


@contextlib.asynccontextmanager
async def _http_with_headers(url: str, headers: dict[str, str]) -> Any:
    """Streamable HTTP with ``headers`` on every request (the SDK's default timeouts: 30 s, reads 300 s)."""
    import httpx2
    from mcp.client.streamable_http import streamable_http_client

    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0)) as http:
        async with streamable_http_client(url, http_client=http) as streams:
            yield streams


class _Server:
    """One server's session, held open by a task on the hub's event loop until :meth:`stop`."""

    def __init__(self, spec: dict[str, Any], loop: asyncio.AbstractEventLoop) -> None:
        self.spec, self.loop = spec, loop
        self.label = spec.get("url") or " ".join([spec["command"], *spec.get("args", [])])
        self.client: Any = None
        self.tools: list[Any] = []
        self.error: str | None = None
        self._stop = asyncio.Event()
        self._done = threading.Event()
        self._task: concurrent.futures.Future | None = None

    def _transport(self) -> Any:
        from mcp import StdioServerParameters

        if "url" not in self.spec:
            return StdioServerParameters(command=self.spec["command"], args=list(self.spec.get("args", [])),
                                         env=self.spec.get("env"), cwd=self.spec.get("cwd"))
        if not self.spec.get("headers"):
            return self.spec["url"]
        return _http_with_headers(self.spec["url"], self.spec["headers"])

    async def _serve(self, ready: concurrent.futures.Future) -> None:
        from mcp import Client

        try:
            async with Client(self._transport()) as client:
                listing, cursor = [], None
                while True:
                    page = await client.list_tools(cursor=cursor)
                    listing += page.tools
                    cursor = page.next_cursor
                    if not cursor:
                        break
                self.client, self.tools = client, listing
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as exc:  # noqa: BLE001 - reported to the starter; a late failure ends the session
            if not ready.done():
                ready.set_exception(exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
        finally:
            self.client = None
            self._done.set()

    def start(self) -> None:
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._task = asyncio.run_coroutine_threadsafe(self._serve(ready), self.loop)
        startup_s = float(self.spec.get("startup_s", 60))
        try:
            ready.result(timeout=startup_s)
        except concurrent.futures.TimeoutError:
            self.error = f"it did not start and list its tools within {startup_s:g} s"
            self.stop()
        except BaseException as exc:  # noqa: BLE001 - whatever the transport raised, said once
            self.error = f"{type(exc).__name__}: {exc}"
            self.stop()

    def stop(self) -> None:
        if self._task is None or self._done.is_set():
            return
        if self.client is None:  # still starting: cancel it (the transport still stops its process)
            self.loop.call_soon_threadsafe(self._task.cancel)
        else:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._done.wait(timeout=15)

    def call(self, name: str, arguments: dict[str, Any], config: Any) -> str:
        from mcp import MCPError
        from mcp_types import REQUEST_TIMEOUT

        client = self.client
        if client is None:
            raise ToolError(f"the MCP server of {name!r} is not running")
        future = asyncio.run_coroutine_threadsafe(
            client.call_tool(name, arguments, read_timeout_seconds=config.wall_s), self.loop)
        try:
            result = future.result(timeout=config.wall_s + _GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ToolError(f"{name} timed out after {config.wall_s:g} s") from None
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:
                raise ToolError(f"{name} timed out after {config.wall_s:g} s") from None
            raise ToolError(f"the MCP server failed: {exc.error.message}") from None
        except Exception as exc:  # a dead server, a broken pipe, a malformed answer
            raise ToolError(f"the MCP server failed: {type(exc).__name__}: {exc}") from None
        text = _cap(_text_of(result), config.max_output)
        if result.is_error:
            raise ToolError(text or f"{name} failed")
        return text


class _Hub:
    """The process's servers, keyed by their spec, on one event loop in a daemon thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: dict[str, _Server] = {}

    def tools(self, specs: list[dict[str, Any]], taken: set[str]) -> dict[str, Tool]:
        out: dict[str, Tool] = {}
        with self._lock:
            if self._loop is None or self._pid != os.getpid():  # none yet, or a forked child's copy
                self._servers, self._pid = {}, os.getpid()
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="verl-mcp", daemon=True)
                self._thread.start()
                atexit.unregister(close_servers)  # registered once, at the first server, not at import
                atexit.register(close_servers)
            for spec in specs:
                key = json.dumps(spec, sort_keys=True)
                server = self._servers.get(key)
                if server is None:
                    server = self._servers[key] = _Server(spec, self._loop)
                    server.start()
                if server.error is not None:
                    raise RuntimeError(f"MCP server {server.label!r}: {server.error}")
                for t in server.tools:
                    if t.name in taken or t.name in out:
                        raise RuntimeError(f"MCP server {server.label!r} offers a tool {t.name!r}, a name another "
                                           f"tool already has")
                    out[t.name] = Tool(t.name, t.description or "", dict(t.input_schema),
                                       lambda args, config, s=server, n=t.name: s.call(n, args, config))
        return out

    def close(self) -> None:
        with self._lock:
            if self._pid != os.getpid():
                return
            for server in self._servers.values():
                server.stop()
            self._servers = {}
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
                if not self._thread.is_alive():
                    self._loop.close()
            self._loop, self._thread, self._pid = None, None, -1


_HUB = _Hub()


def server_tools(specs: list[dict[str, Any]], taken: set[str] = frozenset()) -> dict[str, Tool]:
    """The tools of the servers ``specs`` name (started on first use, then shared by the process);
    a name in ``taken`` or on two servers is refused."""
    return _HUB.tools(specs, set(taken))


def close_servers() -> None:
    """End every server's session (and stop the stdio servers' processes); the next use starts them anew."""
    _HUB.close()
