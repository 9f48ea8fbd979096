"""Process-tree helpers for the tests that check no worker outlives a run, and private Ray clusters."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` in the process tree."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pids: list[int]) -> list[int]:
    """The pids of ``pids`` still running (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def wait_for(predicate, timeout: float, interval: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


# Token authentication is a deployment matter; a private test cluster runs without it.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


@contextlib.contextmanager
def ray_cluster(*, head_cpus: int, worker_nodes: int = 0, worker_cpus: int = 1) -> Iterator[tuple[str, subprocess.Popen]]:
    """A Ray cluster started with `ray start` (a head, plus raylets joined as other machines would);
    yields its address and the head process, and stops every node afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **RAY_ENV}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # A private temp dir (short: Ray's socket paths must fit 107 bytes) keeps `ray start` from
    # recording itself as this machine's current cluster, which a plain ray.init() would then join.
    temp_dir = tempfile.mkdtemp(prefix="vray", dir="/tmp")
    address = f"127.0.0.1:{port}"

    def start(*args: str) -> subprocess.Popen:
        return subprocess.Popen([ray_cli, "start", *args, "--disable-usage-stats", "--block"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    nodes = [start("--head", f"--port={port}", f"--num-cpus={head_cpus}", "--include-dashboard=false",
                   f"--temp-dir={temp_dir}")]
    try:
        nodes += [start(f"--address={address}", f"--num-cpus={worker_cpus}") for _ in range(worker_nodes)]
        yield address, nodes[0]
    finally:
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)
