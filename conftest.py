"""Fixtures shared by every distribution's tests (pytest finds this file above each test tree).

One verl cache per test session, so the built-in model is built and warm-started once however
many test trees (``tests/``, ``verl_algo_contrib/tests/``, ...) a run collects, and the real
``verl`` CLI in a subprocess.
"""

import os
import signal
import sys
import warnings
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


@pytest.fixture(autouse=True)
def signal_handlers_kept():
    """Put back a SIGINT/SIGTERM handler a test leaves changed, and say which test did it.

    The tests share one process: a handler left as SIG_IGN by one test silently changes what Ctrl-C does
    in every later one (the fault test of run.save_on_signal=false once passed alone and failed in the
    suite so). The warning names the test in pytest's warnings summary.
    """
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in before.items():
        now = signal.getsignal(signum)
        if now is not handler:
            signal.signal(signum, handler)
            warnings.warn(f"this test left {signal.Signals(signum).name} handled by {now!r} (it found {handler!r}); "
                          f"put back", RuntimeWarning, stacklevel=1)


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
