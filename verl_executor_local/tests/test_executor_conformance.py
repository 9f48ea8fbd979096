"""The in-process executor against the core's executor conformance suite."""

import pytest

from verl_executor_local import LocalExecutor
from verl_core.contracts import ExecutorConfig
from verl_core.testing import ExecutorConformance


class TestLocalExecutorConformance(ExecutorConformance):
    @pytest.fixture
    def executor(self):
        return LocalExecutor(ExecutorConfig())


def test_the_local_executor_puts_its_worker_where_executor_device_says():
    """"auto" is the GPU where torch sees one (a one-GPU machine never trains on the CPU unasked), else the CPU."""
    import torch

    seen = []
    group = LocalExecutor(ExecutorConfig()).create_group(role="actor", factory=lambda world: seen.append(world) or 0)
    assert group.world_size == 1 and seen[0].device == ("cuda" if torch.cuda.is_available() else "cpu")
    LocalExecutor(ExecutorConfig(device="cpu")).create_group(role="actor", factory=lambda w: seen.append(w) or 0)
    assert seen[1].device == "cpu"
    with pytest.raises(ValueError, match="device: .*'tpu'"):
        LocalExecutor(ExecutorConfig(device="tpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: .*CUDA device"):
            LocalExecutor(ExecutorConfig(device="cuda"))
