"""Fixtures for the Ray executor's tests: the CLI started in the background, a Ray session.

The verl cache and the `run_verl` CLI runner come from the repository's root conftest.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest


@pytest.fixture
def start_verl(tmp_path):
    """Start the `verl` CLI in the background (its own session); yields a launcher, kills leftovers after."""
    started: list[subprocess.Popen] = []

    def start(*args, env=None):
        log = open(tmp_path / f"verl-{len(started)}.log", "w+")
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.Popen([sys.executable, "-m", "verl_cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                env=full_env, start_new_session=True)
        proc.log = log  # type: ignore[attr-defined]
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def ray_session():
    """A Ray instance shared by a module's in-process tests (executors join it and leave it running)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
