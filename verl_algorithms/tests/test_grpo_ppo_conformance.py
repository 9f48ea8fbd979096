"""GRPO and PPO, loaded through the registry as ``verl run --algo`` loads them, against the core's
:class:`AlgorithmConformance` (GRPO by default and with a KL term, as a loss and folded into the
rewards; PPO by default).

Loading by entry-point name also checks that this distribution, not the core, provides both.
"""

from __future__ import annotations

import functools

import pytest
import torch

from verl_core.registry import PluginRegistry
from verl_core.testing import AlgorithmConformance

# The machine is shared: one thread keeps these tests from stealing cores.
torch.set_num_threads(1)

NAMES = ("grpo", "ppo")


@functools.lru_cache(maxsize=None)
def algorithm_class(name: str) -> type:
    return PluginRegistry().load("algorithm", name)


def load(name: str, **config):
    cls = algorithm_class(name)
    return cls(cls.Config(**config))


def test_grpo_and_ppo_come_from_this_distribution():
    infos = {info.name: info for info in PluginRegistry().list("algorithm")}
    for name in NAMES:
        assert name in infos, f"{name} is not installed: pip install -e verl_algorithms"
        assert infos[name].distribution == "verl-algorithms", infos[name]
        assert infos[name].status == "available", infos[name].message
    from verl_algorithms.grpo import GRPO
    from verl_algorithms.ppo import PPO

    assert (algorithm_class("grpo"), algorithm_class("ppo")) == (GRPO, PPO)


class TestGRPOConformance(AlgorithmConformance):
    @pytest.fixture(params=[{}, {"kl_coef": 0.01}, {"kl_coef": 0.01, "kl_in_reward": True, "kl_estimator": "k1"}],
                    ids=["default", "kl-loss", "kl-in-reward"])
    def algorithm(self, request):
        return load("grpo", **request.param)


class TestPPOConformance(AlgorithmConformance):
    @pytest.fixture
    def algorithm(self):
        return load("ppo")
