"""Every contributed algorithm, loaded through the registry, passes the core's AlgorithmConformance.

Loading by entry-point name also checks that each name in the core's first-party table is really
provided by this distribution.
"""

from __future__ import annotations

import functools

import pytest
import torch

from verl_core.registry import PluginRegistry
from verl_core.testing import AlgorithmConformance

# Every algorithm the installed verl-algo-contrib registers (read from its entry points, not a list).
CONTRIB = sorted(info.name for info in PluginRegistry().list("algorithm") if info.distribution == "verl-algo-contrib")


@functools.lru_cache(maxsize=None)
def algorithm_class(name: str) -> type:
    return PluginRegistry().load("algorithm", name)


def load(name: str, **config):
    cls = algorithm_class(name)
    return cls(cls.Config(**config))


def test_every_first_party_name_is_provided_here():
    registry = PluginRegistry()
    infos = {info.name: info for info in registry.list("algorithm")}
    for name in CONTRIB:
        assert name in infos, f"{name} is listed as a verl-algo-contrib algorithm but not installed"
        assert infos[name].distribution == "verl-algo-contrib"
        assert infos[name].status == "available"


class TestContribConformance(AlgorithmConformance):
    """All algorithms whose inputs the suite's synthetic batches already hold."""

    @pytest.fixture(params=[name for name in CONTRIB if name not in ("remax", "dapo", "clip_cov", "kl_cov")])
    def algorithm(self, request):
        return load(request.param)


class TestCovarianceConformance(AlgorithmConformance):
    """Clip-Cov and KL-Cov act on a fraction of the loss tokens (2e-4 in the paper: one token of the
    suite's small batch, whatever the fraction) and Clip-Cov on covariances in [1, 5], which the suite's
    random log-probs and advantages rarely reach; here both act on a tenth of the tokens, and Clip-Cov
    on covariances in (0, 1), so that every setting has tokens to change."""

    @pytest.fixture(params=[("clip_cov", {"cov_fraction": 0.1, "cov_low": 0.0, "cov_high": 1.0}),
                            ("kl_cov", {"cov_fraction": 0.1})], ids=["clip_cov", "kl_cov"])
    def algorithm(self, request):
        name, config = request.param
        return load(name, **config)


class TestDAPOConformance(AlgorithmConformance):
    """DAPO, by default and with a KL term.

    Its overlong shaping acts in the last ``overlong_buffer_len`` tokens of the response budget
    (4096 of 20480 in the paper, and by default), so the config check gives its fixed batch a
    budget longer than the buffer: the batch's 1-8 token responses then end inside it.
    """

    effect_max_new_tokens = 4100

    @pytest.fixture(params=[{}, {"kl_coef": 0.01}], ids=["default", "kl"])
    def algorithm(self, request):
        return load("dapo", **request.param)


class TestReMaxConformance(AlgorithmConformance):
    """ReMax reads the greedy baseline the rollout stage writes into ``extras`` on its request."""

    @pytest.fixture
    def algorithm(self):
        return load("remax")

    def make_batch(self, algorithm, **overrides):
        batch = super().make_batch(algorithm, **overrides)
        g = torch.Generator().manual_seed(5)
        return batch.replace(extras={"baseline_scores": torch.rand(len(batch), generator=g)})


class TestWithKLConformance(AlgorithmConformance):
    """A KL term turns on the reference role; the suite then checks it is declared and used."""

    @pytest.fixture(params=["gspo", "cispo", "gpg", "drgrpo", "rloo", "opo"])
    def algorithm(self, request):
        return load(request.param, kl_coef=0.01, **({"kl_in_reward": False} if request.param == "rloo" else {}))
