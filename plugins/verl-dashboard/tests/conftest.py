"""Fixtures: real run directories from short real `verl run`s, the dashboard server, and a headless Chromium.

The browser is Debian's ``chromium`` (``apt-get install chromium``) driven by Playwright's Python client
(``pip install playwright``; its own browser download is not used). Without either, the browser tests skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("VERL_CHROMIUM", "/usr/bin/chromium")
DOCS_SHOTS = Path(__file__).resolve().parents[3] / "docs" / "dashboard"
# Small but real: the built-in task, model, backend and algorithm; checkpoints at steps 3 and 6.
SMALL = ["data.batch_size=8", "rollout.n=4", "data.max_val_samples=32", "run.threads=1", "run.save_every=3",
         "run.max_steps=6", "run.val_every=3"]


def verl_run(out: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "verl_cli", "run", "--output-dir", str(out), *overrides],
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="session")
def finished_runs(tmp_path_factory, verl_cache) -> Path:
    """A folder of two finished runs that differ in learning rate and seed."""
    root = tmp_path_factory.mktemp("runs")
    for name, extra in (("grpo-a", []), ("grpo-b", ["backend.lr=5e-6", "run.seed=2"])):
        res = verl_run(root / name, *SMALL, *extra)
        assert res.returncode == 0, res.stderr[-3000:]
    return root


def serve(paths, interval_ms: int = 300):
    from verl_dashboard.server import make_server

    server = make_server([str(p) for p in paths], port=0, interval_ms=interval_ms)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server


@pytest.fixture
def dashboard():
    """``dashboard(paths)`` -> a running server on a free port (stopped after the test)."""
    servers = []

    def start(*paths, interval_ms: int = 300):
        servers.append(serve(paths, interval_ms))
        return servers[-1]

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="session")
def browser():
    missing = None if Path(CHROMIUM).is_file() else f"no Chromium at {CHROMIUM} (apt-get install chromium, or set " \
                                                    f"VERL_CHROMIUM)"
    try:
        import playwright.sync_api as playwright_api
    except ImportError:
        missing = missing or "no Playwright (pip install playwright)"
    if missing:  # CI installs both (scripts/setup.sh): there a missing browser is a failure, not a skip
        (pytest.fail if os.environ.get("CI") else pytest.skip)(missing)
    with playwright_api.sync_playwright() as pw:
        # Flags for a closed network: no background connections, no component updates.
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run", "--disable-quic"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.errors = []
    page.on("pageerror", lambda exc: page.errors.append(str(exc)))
    yield page
    context.close()


@pytest.fixture
def screenshot(tmp_path):
    """``screenshot(page, name)``: saved under the test's output; with ``VERL_UPDATE_SCREENSHOTS=1`` also
    copied to docs/dashboard/ (so a test run does not rewrite tracked files)."""
    def shoot(page, name: str, *, full_page: bool = False) -> Path:
        path = tmp_path / f"{name}.png"
        page.screenshot(path=str(path), full_page=full_page)
        if os.environ.get("VERL_UPDATE_SCREENSHOTS") == "1" and os.access(DOCS_SHOTS.parent, os.W_OK):
            DOCS_SHOTS.mkdir(exist_ok=True)
            shutil.copy(path, DOCS_SHOTS / path.name)
        return path

    return shoot
