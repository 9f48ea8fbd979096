"""REINFORCE++ and REINFORCE++-baseline: critic-free policy gradients with global normalisation.

Hu et al., "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models"
(later "REINFORCE++: Stabilizing Critic-Free Policy Optimization with Global Advantage
Normalization"), arXiv:2501.03262. Both drop PPO's critic and keep its clipped surrogate; they
differ from GRPO in normalising advantages over the whole batch instead of within each prompt's
group, which GRPO's per-group standard deviation makes biased and unstable on easy or hard
prompts.

* **REINFORCE++** (:class:`ReinforcePlusPlus`): a token-level KL penalty is folded into the
  reward (``r_t = -β KL_t``, plus the score at the last token), the return of each token is the
  sum of the rewards after it, and the returns are whitened over the batch. Needs no groups.
* **REINFORCE++-baseline** (:class:`ReinforcePlusPlusBaseline`): for several samples per prompt,
  subtract the group's mean reward first, then whiten over the batch; the KL to the reference is
  a loss term with the ``k2`` estimator instead of a reward penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_algorithms.base import KLEstimator, PolicyGradient, PPOFamilyConfig
from verl_algorithms.functional import masked_whiten
from verl_core.batch import Batch

from verl_algo_contrib import functional as CF

__all__ = ["ReinforcePlusPlus", "ReinforcePlusPlusConfig", "ReinforcePlusPlusBaseline",
           "ReinforcePlusPlusBaselineConfig"]


@dataclass
class ReinforcePlusPlusConfig(PPOFamilyConfig):
    """REINFORCE++ settings.

    Attributes:
        kl_coef: β of the token-level KL penalty in the reward (the paper's recipes use a small
            β such as 0.001; 0 removes the reference model).
        kl_in_reward: True: the KL is part of the reward, as in the paper.
        kl_estimator: ``"k1"``: ``log pi - log pi_ref`` per token.
        gamma: discount of the returns over response tokens (1: no discount).
    """

    kl_coef: float = 0.001
    kl_in_reward: bool = True
    kl_estimator: KLEstimator = "k1"
    gamma: float = 1.0

    def validate(self) -> None:
        super().validate()
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError("gamma: must be in (0, 1]")


class ReinforcePlusPlus(PolicyGradient):
    """Returns-to-go of KL-shaped token rewards, whitened over the batch."""

    Config = ReinforcePlusPlusConfig

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        mask = batch.response_mask.float()
        returns = CF.returns_to_go(batch.token_rewards.float(), batch.response_mask, gamma=self.config.gamma)
        if float(mask.sum()) == 0:
            return torch.zeros_like(returns), returns
        return masked_whiten(returns, mask) * mask, returns


@dataclass
class ReinforcePlusPlusBaselineConfig(PPOFamilyConfig):
    """REINFORCE++-baseline settings.

    Attributes:
        kl_coef: weight of the KL loss term (a small value such as 0.001, as for REINFORCE++).
        kl_in_reward: False: the KL is a loss term, as in the paper's baseline variant.
        kl_estimator: ``"k2"``: ``0.5 (log pi - log pi_ref)^2``, whose gradient is the KL's.
    """

    kl_coef: float = 0.001
    kl_in_reward: bool = False
    kl_estimator: KLEstimator = "k2"


class ReinforcePlusPlusBaseline(PolicyGradient):
    """Group-mean baseline, then batch-wide whitening; KL as a loss term."""

    Config = ReinforcePlusPlusBaselineConfig

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        adv = CF.group_mean_whitened_advantages(CF.sequence_rewards(batch), batch.group_ids, batch.response_mask)
        return adv, adv
