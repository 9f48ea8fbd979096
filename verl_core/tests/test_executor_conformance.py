"""The in-process executor against the core's executor conformance suite."""

import pytest

from verl_core.executor_local import LocalExecutor
from verl_core.contracts import ExecutorConfig
from verl_core.testing import ExecutorConformance


class TestLocalExecutorConformance(ExecutorConformance):
    @pytest.fixture
    def executor(self):
        return LocalExecutor(ExecutorConfig())
