"""Run untrusted Python in a separate, limited process.

:func:`run_python` executes code in a fresh interpreter (``python -I``: no user site, no
environment-variable hooks) started with:

* its own **network namespace** (``unshare(CLONE_NEWNET)``: only a downed loopback, so every
  connection fails); where the machine forbids that, :class:`SandboxUnavailable` is raised unless
  the caller opted in with ``allow_network=True``;
* **resource limits**: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), file size,
  open files, and processes (``RLIMIT_NPROC``, against fork bombs);
* when started as root, the **nobody user** (uid/gid 65534) in a **mount namespace** of its own
  whose world-writable places (``/tmp``, ``/var/tmp``, ``/dev/shm``) are fresh private tmpfs: it
  can write only in its own working directory, and nothing it writes reaches the host; it cannot
  signal other processes either;
* a **wall-clock deadline**: past it the whole process group is killed;
* its output **truncated** to ``max_output`` characters, and only that much held in memory: the rest
  is read and dropped as it comes, so a program that prints gigabytes costs the host nothing;
* its **standard input** given as a string (``stdin``), or empty.

Everything that goes wrong (a timeout, a memory error, a crash, a refused fork) comes back as a
:class:`SandboxResult` with ``ok=False`` and a short reason, never as an exception in the caller.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "run_python", "network_isolation_available"]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18
# World-writable places, each covered with an empty private tmpfs inside the sandbox's mount namespace.
_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_NOBODY = 65534


class SandboxUnavailable(RuntimeError):
    """Network isolation is not possible here and the caller did not allow network access."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one execution.

    Attributes:
        cpu_s: CPU seconds.
        wall_s: wall-clock seconds (the process group is killed after).
        memory_mb: address space in MiB.
        max_processes: processes the sandbox user may have (as root the sandbox runs as nobody,
            so this counts nobody's processes).
        max_output: characters of output kept.
        allow_network: run even where a network namespace cannot be made (network then reachable).
    """

    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 16
    max_output: int = 2000
    allow_network: bool = False


@dataclass
class SandboxResult:
    """What one execution gave: ``ok`` when it exited with code 0 in time; ``truncated`` when its
    output was cut at ``max_output`` characters."""

    ok: bool
    output: str
    error: str = ""
    seconds: float = 0.0
    truncated: bool = False


def _unshare_net() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare(_CLONE_NEWNET) == 0


_AVAILABLE: bool | None = None


def network_isolation_available() -> bool:
    """Whether this machine lets a child process enter a new network namespace (checked once)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            done = subprocess.run([sys.executable, "-I", "-c", "import sys"], preexec_fn=_require_unshare,
                                  capture_output=True, timeout=30)
            _AVAILABLE = done.returncode == 0
        except (OSError, subprocess.SubprocessError):
            _AVAILABLE = False
    return _AVAILABLE


def _require_unshare() -> None:
    if not _unshare_net():
        raise OSError("unshare(CLONE_NEWNET) failed")


def _interpreter() -> str:
    """This interpreter, unless the sandbox user (nobody, when we are root) cannot reach it; then
    the system's ``python3`` (the code only needs the standard library)."""
    if os.getuid() != 0:
        return sys.executable
    path = os.path.realpath(sys.executable)
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & 0o001:
            return shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin") or sys.executable
    return sys.executable


def _private_scratch() -> bool:
    """A mount namespace of the child's own with an empty tmpfs over every world-writable place, so
    nothing it writes outside its working directory outlives it or reaches the host (root only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if os.getuid() != 0 or libc.unshare(_CLONE_NEWNS) != 0:
        return False
    if libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return False
    for place in _SCRATCH:
        if os.path.isdir(place):
            libc.mount(b"tmpfs", place.encode(), b"tmpfs", 0, b"size=64m,mode=1777")
    return True


def _limits(limits: SandboxLimits, workdir: str, isolate: bool):
    def apply() -> None:  # runs in the child between fork and exec
        os.setsid()
        if isolate and not _unshare_net():
            os._exit(97)
        if _private_scratch():
            # The working directory was under /tmp, now covered: make it again in the new tmpfs.
            os.makedirs(workdir, exist_ok=True)
            os.chdir(workdir)
        mem = limits.memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.getuid() == 0:
            os.chown(workdir, _NOBODY, _NOBODY)
            os.setgroups([])
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))

    return apply


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, stdin: str = "") -> SandboxResult:
    """Execute ``code`` in the sandbox with ``stdin`` as its standard input; its stdout and stderr
    (truncated) come back as ``output``.

    Raises:
        SandboxUnavailable: no network namespace can be made and ``limits.allow_network`` is False.
    """
    isolate = network_isolation_available()
    if not isolate and not limits.allow_network:
        raise SandboxUnavailable("this machine does not allow a network namespace for the sandbox "
                                 "(unshare(CLONE_NEWNET) failed); set allow_network = true to run code "
                                 "with network access anyway")
    workdir = tempfile.mkdtemp(prefix="verl-sandbox-")
    start = time.monotonic()
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "PYTHONDONTWRITEBYTECODE": "1",
           "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
    try:
        proc = subprocess.Popen([_interpreter(), "-I", "-c", code], cwd=workdir, env=env,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                preexec_fn=_limits(limits, workdir, isolate))
        # UTF-8 takes at most 4 bytes a character: this many bytes hold max_output characters.
        reader = _BoundedReader(proc.stdout, keep=4 * limits.max_output + 4)
        if stdin:
            threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True).start()
        try:
            proc.wait(timeout=limits.wall_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_group(proc.pid)  # past the deadline, or children it left behind
        proc.wait()
        raw, dropped = reader.result()
        output = raw.decode("utf-8", "replace")
        truncated = dropped > 0 or len(output) > limits.max_output
        if truncated:
            cut = max(0, len(output) - limits.max_output) + dropped
            output = output[:limits.max_output] + f"\n... [{cut} characters cut]"
        seconds = time.monotonic() - start
        if timed_out:
            return SandboxResult(False, output, f"timed out after {limits.wall_s:g} s", seconds, truncated)
        code_ = proc.returncode
        if code_ == 0:
            return SandboxResult(True, output, "", seconds, truncated)
        if code_ == -signal.SIGXCPU or code_ == -signal.SIGKILL:
            reason = f"killed (CPU limit of {limits.cpu_s} s or memory)"
        elif "MemoryError" in output:
            reason = f"out of memory (limit {limits.memory_mb} MiB)"
        else:
            reason = f"exited with code {code_}"
        return SandboxResult(False, output, reason, seconds, truncated)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class _BoundedReader:
    """Reads a pipe to its end in a thread, keeping its first ``keep`` bytes and counting the rest
    (read and dropped, so the writer never blocks on a full pipe and the host's memory stays bounded)."""

    def __init__(self, stream, *, keep: int) -> None:
        self._stream, self._keep = stream, keep
        self._kept = bytearray()
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        fd = self._stream.fileno()
        while chunk := os.read(fd, 1 << 16):
            room = self._keep - len(self._kept)
            self._kept += chunk[:max(room, 0)]
            self._dropped += max(len(chunk) - max(room, 0), 0)

    def result(self) -> tuple[bytes, int]:
        """The kept bytes and how many were dropped, once the pipe is closed (or after 5 s more: a
        process that escaped the group may still hold it)."""
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._stream.close()
        return bytes(self._kept), self._dropped


def _feed(stream, data: bytes) -> None:
    try:
        stream.write(data)
        stream.close()
    except (BrokenPipeError, OSError):  # the program exited (or was killed) before reading it all
        pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
