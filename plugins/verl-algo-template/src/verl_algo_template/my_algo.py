"""my_algo: group-baseline policy gradient with clipped advantages (a template to copy).

What it changes relative to GRPO (Shao et al., arXiv:2402.03300): the advantage is the reward
minus its group's mean, not divided by the group's standard deviation, and clipped to
``[-advantage_clip, advantage_clip]``. Everything else - the PPO-clip loss, the KL and entropy
terms, the dataflow - is the core's, reused as it is.

A real plugin's docstring cites its paper (title, arXiv id) and says what it changes vs PPO/GRPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_core.algorithms import functional as F
from verl_core.batch import Batch
from verl_core.algorithms.base import PolicyGradient, PPOFamilyConfig

__all__ = ["MyAlgo", "MyAlgoConfig"]


@dataclass
class MyAlgoConfig(PPOFamilyConfig):
    """Settings of my_algo: the ``[algorithm]`` section of a run's config (``algorithm.<key>=...``).

    The base class brings the shared knobs (clip ratios, ``kl_coef``, ``entropy_coef``,
    ``loss_agg_mode``, ``epochs``, ``mini_batch_size``); add yours with typed defaults here.

    Attributes:
        advantage_clip: advantages are clipped to ``[-advantage_clip, advantage_clip]``.
    """

    advantage_clip: float = 1.0

    def validate(self) -> None:
        """Runs before any model loads; ``"key: message"`` errors name ``algorithm.key`` to the user."""
        super().validate()
        if self.advantage_clip <= 0:
            raise ValueError("advantage_clip: must be > 0")


class MyAlgo(PolicyGradient):
    """Group-mean baseline, clipped advantages, the core's PPO-clip loss."""

    Config = MyAlgoConfig

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(advantages, returns)``, both ``[B, R]`` and 0 where ``response_mask`` is 0."""
        adv = F.group_normalized_advantages(F.sequence_rewards(batch), batch.group_ids, batch.response_mask, norm_by_std=False)
        clip = self.config.advantage_clip
        adv = adv.clamp(-clip, clip) * batch.response_mask
        return adv, adv
