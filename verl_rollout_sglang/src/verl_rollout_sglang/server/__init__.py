"""The SGLang server as a child process: launch, health wait, logs, and a sure end.

:class:`ServerProcess` starts ``sglang.launch_server`` under SGLang's own interpreter through
``verl_sglang_serve.py`` (a watchdog that kills the server's process group when the trainer
dies, even by ``kill -9``), in a new session so that the group holds the launcher and every
scheduler and detokenizer process it spawns. :meth:`ServerProcess.close` ends the group:
SIGTERM, then SIGKILL after a grace period. The server's output goes to a log file whose tail
is quoted in every start-up error.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import weakref
from pathlib import Path
from typing import Sequence

__all__ = ["ServerProcess", "ServerStartError", "free_port", "CPU_SUPPORT_DIR"]

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
SERVE_SCRIPT = HERE / "verl_sglang_serve.py"
# Holds the `sgl_kernel` stand-in; first on the server's PYTHONPATH when it serves on a CPU.
CPU_SUPPORT_DIR = HERE.parent / "cpu_support"


class ServerStartError(RuntimeError):
    """The SGLang server exited or did not become healthy in time; the message quotes its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_group(pid: int, grace_s: float, reap=None) -> None:
    """SIGTERM the process group led by ``pid``, SIGKILL what is left after ``grace_s``.

    ``reap`` (the launcher's ``Popen.poll``) is called while waiting: the launcher is our child,
    and until it is reaped its zombie keeps the group alive.
    """
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if reap is not None:
            reap()
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class ServerProcess:
    """One ``sglang.launch_server`` child, its log, and its process group.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        log_path: the file the server writes its output to.
        pid: the launcher's pid, which is also the process group id.
    """

    def __init__(self, python: str, args: Sequence[str], *, env: dict[str, str], log_path: Path,
                 port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [python, str(SERVE_SCRIPT), str(os.getpid()), *args]
        logger.info("starting the SGLang server on %s (log: %s): %s", self.url, log_path, " ".join(cmd))
        with open(log_path, "ab") as out:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)
        self.pid = self._proc.pid
        # Ends the group at interpreter exit too (the watchdog covers the exits that skip it).
        self._finalizer = weakref.finalize(self, _end_group, self.pid, 10.0, self._proc.poll)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def exited(self) -> int | None:
        """The launcher's exit code, or None while it runs."""
        return self._proc.poll()

    def wait_healthy(self, client, timeout_s: float) -> None:
        """Poll ``/health`` until it answers 200; fail fast when the process exits.

        Raises:
            ServerStartError: the server exited, or was not healthy after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.exited()
            if code is not None:
                raise ServerStartError(f"the SGLang server exited with code {code} while starting; the end of its "
                                       f"log ({self.log_path}):\n{self.log_tail()}")
            try:
                client.request("GET", "/health", retry=False, timeout_s=5.0)
                return
            except Exception:  # not up yet
                pass
            if time.monotonic() > deadline:
                self.close()
                raise ServerStartError(f"the SGLang server was not healthy after {timeout_s:g} s "
                                       f"(rollout.startup_timeout_s); the end of its log ({self.log_path}):\n"
                                       f"{self.log_tail()}")
            time.sleep(1.0)

    def close(self, grace_s: float = 10.0) -> None:
        """End the server and every process of its group."""
        self._finalizer.detach()
        _end_group(self.pid, grace_s, self._proc.poll)
        try:
            self._proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
