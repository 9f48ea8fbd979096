"""Fixtures for the Ray executor's tests: one verl cache per session, the CLI runner, a Ray session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def verl_cache(tmp_path_factory):
    """One cache for the whole session: the built-in model is built (and warm-started) once.

    Set VERL_TEST_CACHE_DIR to reuse a cache across sessions while developing.
    """
    cache = os.environ.get("VERL_TEST_CACHE_DIR") or str(tmp_path_factory.mktemp("verl-cache"))
    old = os.environ.get("VERL_CACHE_DIR")
    os.environ["VERL_CACHE_DIR"] = cache
    yield Path(cache)
    if old is None:
        os.environ.pop("VERL_CACHE_DIR", None)
    else:
        os.environ["VERL_CACHE_DIR"] = old


@pytest.fixture
def run_verl():
    """Run the real `verl` CLI in a subprocess; returns the CompletedProcess."""

    def run(*args, env=None, timeout=600):
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        return subprocess.run([sys.executable, "-m", "verl_core.cli", *args], capture_output=True, text=True,
                              env=full_env, timeout=timeout)

    return run


@pytest.fixture
def start_verl(tmp_path):
    """Start the `verl` CLI in the background (its own session); yields a launcher, kills leftovers after."""
    started: list[subprocess.Popen] = []

    def start(*args, env=None):
        log = open(tmp_path / f"verl-{len(started)}.log", "w+")
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        proc = subprocess.Popen([sys.executable, "-m", "verl_core.cli", *args], stdout=log, stderr=subprocess.STDOUT,
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
