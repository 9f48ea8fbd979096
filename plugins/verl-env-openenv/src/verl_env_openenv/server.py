"""The OpenEnv servers a run talks to: launched, health-checked, restarted and stopped here, one per process.

``environment.url`` names a server someone else runs; ``environment.launch`` one this process starts on
localhost (an ASGI app ``"package.module:app"``, served with uvicorn, or a command with ``{port}``), under
:mod:`verl_env_openenv._guard` in a process group of its own: stopped at :func:`close_servers` (registered
with ``atexit`` at the first launch), and by the guard if the run dies without it. Every trajectory's
client runs on one event loop in a daemon thread (:func:`run`): one WebSocket session per trajectory,
not one thread.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Coroutine

__all__ = ["ServerError", "close_servers", "run", "schema", "server_url"]

#: ``package.module:attribute``: an ASGI app to serve with uvicorn.
_APP_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class ServerError(RuntimeError):
    """An OpenEnv server that cannot be reached, started or kept running; the message says which and why."""


# -- the event loop every client runs on --------------------------------------------------------------

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = -1


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():  # a forked child gets a loop of its own
            _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
            threading.Thread(target=_loop.run_forever, name="verl-openenv-loop", daemon=True).start()
        return _loop


def run(coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
    """Run ``coro`` on the shared loop and wait for it; :class:`TimeoutError` after ``timeout_s``."""
    future = asyncio.run_coroutine_threadsafe(coro, _event_loop())
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None


# -- HTTP look-ups ---------------------------------------------------------------------------------------

def _get_json(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - the configured server
        return json.loads(response.read().decode())


def _healthy(url: str, timeout_s: float = 2.0) -> str | None:
    """None when ``url``/health answers, else why not."""
    try:
        _get_json(url.rstrip("/") + "/health", timeout_s)
        return None
    except (OSError, ValueError) as exc:  # refused, timed out, HTTP error, not JSON
        return f"{type(exc).__name__}: {exc}"


_schemas: dict[str, dict[str, Any]] = {}


def schema(url: str, timeout_s: float) -> dict[str, Any]:
    """The server's ``/schema`` (``{"action": ..., "observation": ..., "state": ...}``), fetched once per URL."""
    if url not in _schemas:
        try:
            _schemas[url] = _get_json(url.rstrip("/") + "/schema", timeout_s)
        except (OSError, ValueError) as exc:
            raise ServerError(f"{url}/schema did not answer ({type(exc).__name__}: {exc}); is this an OpenEnv "
                              f"server? Or name the action's text field with environment.action_field") from None
    return _schemas[url]


# -- launched servers ------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(launch: str, port: int) -> list[str]:
    if _APP_SPEC.match(launch.strip()):
        return [sys.executable, "-m", "uvicorn", launch.strip(), "--host", "127.0.0.1", "--port", str(port),
                "--log-level", "warning"]
    return shlex.split(launch.replace("{port}", str(port)))


class _Launched:
    """One launched server: its guard process, port, log file and restarts."""

    def __init__(self, launch: str, port: int, startup_s: float, max_restarts: int) -> None:
        self.launch, self.startup_s, self.max_restarts = launch, startup_s, max_restarts
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.restarts = -1  # the first start is not a restart
        self.failed = False  # its log is kept for the error that names it
        self.proc: subprocess.Popen | None = None
        fd, self.log_path = tempfile.mkstemp(prefix="verl-openenv-", suffix=".log")
        os.close(fd)

    def _log_tail(self, chars: int = 2000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:].strip()
        except OSError:
            return ""

    def start(self) -> None:
        self.restarts += 1
        self.failed = True  # until it answers
        if self.restarts > self.max_restarts:
            raise ServerError(f"environment.launch: the server {self.launch!r} died {self.restarts} times "
                              f"(environment.max_restarts = {self.max_restarts}); its log {self.log_path}:\n"
                              f"{self._log_tail()}")
        command = _command(self.launch, self.port)
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- verl: starting {shlex.join(command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "verl_env_openenv._guard", str(os.getpid()), "--", *command],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PORT": str(self.port)})
        deadline = time.monotonic() + self.startup_s
        why = "not started"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"environment.launch: {self.launch!r} exited with code {self.proc.returncode} "
                                  f"before it served {self.url}/health; its log {self.log_path}:\n{self._log_tail()}")
            why = _healthy(self.url)
            if why is None:
                self.failed = False
                return
            time.sleep(0.2)
        self.stop()
        raise ServerError(f"environment.launch: {self.launch!r} did not answer {self.url}/health within "
                          f"{self.startup_s:g} s (environment.startup_timeout_s) ({why}); a command must listen "
                          f"on the port it is given: put {{port}} in it, or read $PORT; its log {self.log_path}:\n"
                          f"{self._log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the guard is the group's leader: the group has its pid
            proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)


_servers_lock = threading.Lock()
_servers: dict[tuple[str, int], _Launched] = {}
_servers_pid = -1


def server_url(config: Any) -> str:
    """The base URL for ``config`` (an :class:`~verl_env_openenv.env.OpenEnvConfig`): ``url``, checked once
    it is reached, or the launched server's, started (or restarted, if it died) here."""
    if config.url:
        return config.url.rstrip("/")
    global _servers_pid
    with _servers_lock:
        if _servers_pid != os.getpid():  # servers of the parent belong to the parent
            _servers.clear()
            _servers_pid = os.getpid()
        key = (config.launch, config.port)
        server = _servers.get(key)
        if server is None:
            server = _servers[key] = _Launched(config.launch, config.port, config.startup_timeout_s,
                                               config.max_restarts)
            atexit.unregister(close_servers)  # once, at the first launch, not at import
            atexit.register(close_servers)
        if not server.alive():
            server.start()
        return server.url


def check_reachable(url: str, config: Any) -> None:
    """Raise :class:`ServerError` naming the setting and the fix when nothing answers at ``url``."""
    why = _healthy(url, timeout_s=config.connect_timeout_s)
    if why is None:
        return
    if config.url:
        raise ServerError(f"environment.url: no OpenEnv server answers at {url}/health ({why}); start it "
                          f"(e.g. `uvicorn my_env.server.app:app --port 8000`), or let verl start it with "
                          f"environment.launch = \"my_env.server.app:app\" instead of environment.url")
    raise ServerError(f"environment.launch: the server {config.launch!r} at {url} stopped answering ({why})")


def close_servers() -> None:
    """Stop every server this process launched (the run's end; also registered with ``atexit``)."""
    with _servers_lock:
        servers = list(_servers.values()) if _servers_pid == os.getpid() else []
        _servers.clear()
    for server in servers:
        server.stop()
        if not server.failed:
            try:
                os.remove(server.log_path)
            except OSError:
                pass
