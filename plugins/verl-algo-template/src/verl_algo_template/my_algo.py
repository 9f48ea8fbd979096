"""my_algo: group-baseline policy gradient with clipped advantages (a template to copy).

What it changes relative to GRPO (Shao et al., arXiv:2402.03300): the advantage is the reward
minus its group's mean, not divided by the group's standard deviation, and clipped to
``[-advantage_clip, advantage_clip]``. Optionally (``skip_uniform_groups``) it asks the run's rollout
stage to drop groups whose rewards are all equal and to sample more prompts in their place, as
DAPO's dynamic sampling does (Yu et al., arXiv:2503.14476). Everything else - the PPO-clip loss, the
KL and entropy terms, the dataflow - is verl-algorithms' (``PolicyGradient``), the resampling loop the
core's rollout stage, reused as they are.

A real plugin's docstring cites its paper (title, arXiv id) and says what it changes vs PPO/GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from verl_algorithms import functional as F
from verl_algorithms.base import PolicyGradient, PPOFamilyConfig
from verl_core.batch import Batch
from verl_core.contracts import RolloutRequest

__all__ = ["MyAlgo", "MyAlgoConfig", "keep_groups_with_spread"]


@dataclass
class MyAlgoConfig(PPOFamilyConfig):
    """Settings of my_algo: the ``[algorithm]`` section of a run's config (``algorithm.<key>=...``).

    The base class brings the shared knobs (clip ratios, ``kl_coef``, ``entropy_coef``,
    ``loss_agg_mode``, ``epochs``, ``mini_batch_size``); add yours with typed defaults here.

    Attributes:
        advantage_clip: advantages are clipped to ``[-advantage_clip, advantage_clip]``.
        skip_uniform_groups: drop groups whose samples all got the same reward (their advantages
            are all 0) and resample, so the update sees a full batch of informative groups.
        resample_rounds: extra generation rounds per step at most when ``skip_uniform_groups``.
    """

    advantage_clip: float = 1.0
    skip_uniform_groups: bool = False
    resample_rounds: int = 2

    # What the conformance suite's "every field changes something" check needs to know.
    inert_when: ClassVar[dict[tuple[str, str], str]] = {
        ("resample_rounds", "skip_uniform_groups"): "resampling happens only when skip_uniform_groups is on",
    }

    def validate(self) -> None:
        """Runs before any model loads; ``"key: message"`` errors name ``algorithm.key`` to the user."""
        super().validate()
        if self.advantage_clip <= 0:
            raise ValueError("advantage_clip: must be > 0")
        if self.resample_rounds < 0:
            raise ValueError("resample_rounds: must be >= 0 (0 drops uniform groups without resampling)")


class MyAlgo(PolicyGradient):
    """Group-mean baseline, clipped advantages, verl-algorithms' PPO-clip loss."""

    Config = MyAlgoConfig

    def rollout_request(self) -> RolloutRequest:
        """Ask the rollout stage for dynamic sampling; the stage owns the loop, the plugin the filter."""
        if not self.config.skip_uniform_groups:
            return RolloutRequest()
        return RolloutRequest(filter=keep_groups_with_spread, max_extra_rounds=self.config.resample_rounds)

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(advantages, returns)``, both ``[B, R]`` and 0 where ``response_mask`` is 0."""
        adv = F.group_normalized_advantages(F.sequence_rewards(batch), batch.group_ids, batch.response_mask,
                                            norm_by_std=False)
        clip = self.config.advantage_clip
        adv = adv.clamp(-clip, clip) * batch.response_mask
        return adv, adv


def keep_groups_with_spread(batch: Batch) -> Batch:
    """The samples of groups (``group_ids``) whose scores are not all equal; lone samples are dropped."""
    keep = []
    for group in batch.group_ids.unique():
        members = (batch.group_ids == group).nonzero().flatten()
        if len(members) > 1 and batch.scores[members].max() > batch.scores[members].min():
            keep += members.tolist()
    return batch.select(sorted(keep))
