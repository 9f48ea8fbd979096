"""The arithmetic environment against the core's environment conformance suite."""

import pytest

from verl_core.testing import EnvironmentConformance
from verl_task_arithmetic.plugins import ArithmeticEnvironment


class TestArithmeticEnvironmentConformance(EnvironmentConformance):
    @pytest.fixture
    def environment(self):
        return lambda: ArithmeticEnvironment()

    @pytest.fixture
    def task_row(self):
        return {"prompt": [{"role": "user", "content": "12+30="}], "ground_truth": "42", "extra_info": {}}
