"""The overlapping step sources run the step-source conformance suite: colocate_async with its producer in
a thread and in a child process (separate_async needs a Ray rollout pool: test_async_trainer's heavy test)."""

import pytest
from verl_core.testing import StepSourceConformance


class TestColocateAsyncThread(StepSourceConformance):
    @pytest.fixture
    def overrides(self) -> list[str]:
        return ["trainer.mode='colocate_async'", "trainer.producer='thread'"]


class TestColocateAsyncProcess(StepSourceConformance):
    @pytest.fixture
    def overrides(self) -> list[str]:
        return ["trainer.mode='colocate_async'", "trainer.producer='process'"]
