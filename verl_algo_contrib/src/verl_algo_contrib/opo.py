"""OPO: on-policy RL with the optimal reward baseline.

Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585. Two changes to GRPO:
training is strictly on-policy (one gradient step per batch of fresh samples, so the importance
ratio is exactly 1 and nothing is clipped), and the baseline is the variance-minimising one for
sequence rewards, the length-weighted mean ``sum_j l_j r_j / sum_j l_j`` of the group's rewards,
without dividing by a standard deviation. No KL term and no entropy bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_algorithms.base import LossAggMode, PPOFamilyConfig, PolicyGradient
from verl_core.batch import Batch

from verl_algo_contrib import functional as CF

__all__ = ["OPO", "OPOConfig"]


@dataclass
class OPOConfig(PPOFamilyConfig):
    """OPO settings.

    Attributes:
        epochs: 1 and ``mini_batch_size`` 0: exactly one gradient step per batch (on-policy).
        loss_agg_mode: ``"token-mean"``, matching the token-length weighting of the baseline.
    """

    epochs: int = 1
    mini_batch_size: int = 0
    kl_coef: float = 0.0
    loss_agg_mode: LossAggMode = "token-mean"


class OPO(PolicyGradient):
    """Length-weighted group baseline, strictly on-policy updates."""

    Config = OPOConfig

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        adv = CF.length_weighted_baseline_advantages(CF.sequence_rewards(batch), batch.group_ids,
                                                     batch.response_mask)
        return adv, adv
