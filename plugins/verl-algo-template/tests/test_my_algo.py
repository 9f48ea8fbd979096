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


def test_skip_uniform_groups_asks_the_rollout_stage_for_dynamic_sampling():
    from verl_algo_template.my_algo import keep_groups_with_spread

    assert MyAlgo(MyAlgoConfig()).rollout_request().filter is None
    request = MyAlgo(MyAlgoConfig(skip_uniform_groups=True, resample_rounds=3)).rollout_request()
    assert request.filter is keep_groups_with_spread and request.max_extra_rounds == 3
    # Groups of 2: [1, 1] and [0, 0] are uniform, [1, 0] is kept.
    batch = make_batch(batch_size=6, group_size=2, scores=[1.0, 1.0, 1.0, 0.0, 0.0, 0.0], tool_tokens=False)
    kept = keep_groups_with_spread(batch)
    assert kept.group_ids.tolist() == [1, 1] and kept.scores.tolist() == [1.0, 0.0]
