"""The Ray executor against the core's executor conformance suite: groups of two worker processes on a
local Ray instance, a worker killed mid-call included."""

import pytest

from verl_core.testing import ExecutorConformance
from verl_executor_ray.config import RayExecutorConfig

pytestmark = pytest.mark.slow


class TestRayExecutorConformance(ExecutorConformance):
    world_size = 2
    kills_workers = True

    @pytest.fixture
    def executor(self, ray_session):
        from verl_executor_ray.executor import RayExecutor

        config = RayExecutorConfig(world_size=2)
        config.validate()
        return RayExecutor(config)
