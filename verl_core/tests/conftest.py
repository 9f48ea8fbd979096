"""Fixtures shared by the core's tests."""

from pathlib import Path

import pytest


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh directory on sys.path to hold fake distributions and modules."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    return root
