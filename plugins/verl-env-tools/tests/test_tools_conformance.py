"""The tools environment against the core's environment conformance suite: real tool calls in the sandbox."""

import pytest

from verl_core.testing import EnvironmentConformance
from verl_env_tools.env import ToolsConfig, ToolsEnvironment


class TestToolsEnvironmentConformance(EnvironmentConformance):
    # A well-formed calculator call (answered by the sandbox), a final answer, an empty turn and garbage.
    default_responses = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12+30"}}\n</tool_call>',
                         *EnvironmentConformance.default_responses)

    @pytest.fixture
    def environment(self):
        return lambda: ToolsEnvironment(ToolsConfig(max_turns=2))

    @pytest.fixture
    def task_row(self):
        return {"prompt": [{"role": "user", "content": "What is 12+30?"}], "ground_truth": "42", "extra_info": {}}
