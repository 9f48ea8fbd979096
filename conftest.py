"""Fixtures shared by every distribution's tests (pytest finds this file above each test tree).

One verl cache per test session, so the built-in model is built and warm-started once however
many test trees (``tests/``, ``verl_algo_contrib/tests/``, ...) a run collects, and the real
``verl`` CLI in a subprocess.
"""

import os
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
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory on sys.path to hold fake distributions and modules."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return root


@pytest.fixture
def run_verl():
    """Run the real `verl` CLI in a subprocess; returns the CompletedProcess."""
    import subprocess

    def run(*args, env=None, timeout=600):
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        return subprocess.run([sys.executable, "-m", "verl_cli", *args], capture_output=True, text=True,
                              env=full_env, timeout=timeout)

    return run
