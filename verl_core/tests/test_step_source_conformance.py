"""The core's ``sync`` step source runs the step-source conformance suite."""

import pytest
from verl_core.testing import StepSourceConformance


class TestSyncSource(StepSourceConformance):
    @pytest.fixture
    def overrides(self) -> list[str]:
        return ["trainer.mode='sync'"]
