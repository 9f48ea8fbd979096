"""The local run store against the run-store contract (the real filesystem, real locks, a real second process)."""

from verl_core.testing import RunStoreConformance
import pytest

from verl_run_store import LocalRunStore


class TestLocalRunStore(RunStoreConformance):
    @pytest.fixture
    def store(self):
        return LocalRunStore
