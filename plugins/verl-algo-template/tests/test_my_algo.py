"""my_algo against the core's conformance suite, plus its own math by hand."""

import pytest
import torch

from verl_core.registry import PluginRegistry
from verl_core.testing import AlgorithmConformance, make_batch

from verl_algo_template.my_algo import MyAlgo, MyAlgoConfig

torch.set_num_threads(1)


class TestMyAlgoConformance(AlgorithmConformance):
    """Shapes, masking, gradients, edge cases and the dataflow declaration, as verl checks them."""

    @pytest.fixture
    def algorithm(self):
        # Loaded the way `verl run --algo my_algo` loads it: through the installed entry point.
        cls = PluginRegistry().load("algorithm", "my_algo")
        return cls(cls.Config())


def test_advantages_are_group_centred_and_clipped():
    batch = make_batch(batch_size=4, group_size=4, scores=[3.0, 0.0, 0.0, 1.0], tool_tokens=False)
    adv, _ = MyAlgo(MyAlgoConfig(advantage_clip=1.0)).compute_advantages(batch)
    # Group mean 1: [2, -1, -1, 0] clipped to [1, -1, -1, 0] on every response token.
    first = adv[torch.arange(4), 0]
    assert first.tolist() == [1.0, -1.0, -1.0, 0.0]
    assert (adv[batch.response_mask == 0] == 0).all()


def test_config_errors_name_the_key():
    from verl_core.config import ConfigError, build_dataclass

    with pytest.raises(ConfigError, match="algorithm.advantage_clip: must be > 0"):
        build_dataclass(MyAlgoConfig, {"advantage_clip": 0.0}, "algorithm")
