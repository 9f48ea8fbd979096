"""The vision environment against the core's environment conformance suite."""

import pytest

from verl_core.testing import EnvironmentConformance
from verl_env_vision.env import VisionEnvironment


class TestVisionEnvironmentConformance(EnvironmentConformance):
    @pytest.fixture
    def environment(self):
        return lambda: VisionEnvironment()

    @pytest.fixture
    def task_row(self):
        content = [{"type": "image"}, {"type": "text", "text": "How many sides has the shape?"}]
        return {"prompt": [{"role": "user", "content": content}], "ground_truth": "3", "extra_info": {}}
