"""PPO with a learned critic and generalised advantage estimation.

Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347; applied to language
models as in Ouyang et al., "Training language models to follow instructions with human
feedback", arXiv:2203.02155: the KL to the reference policy is subtracted from the per-token
reward, and advantages come from GAE (arXiv:1506.02438) over the critic's values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_core.batch import Batch
from verl_core.contracts import Requirements

from verl_algorithms import functional as F
from verl_algorithms.base import KLEstimator, PolicyGradient, PPOFamilyConfig

__all__ = ["PPO", "PPOConfig"]


@dataclass
class PPOConfig(PPOFamilyConfig):
    """PPO settings.

    Attributes:
        gamma: discount factor over response tokens.
        lam: GAE lambda.
        value_clip: clip range of the value loss.
        whiten_advantages: normalise advantages over the batch.
    """

    kl_coef: float = 0.001
    kl_estimator: KLEstimator = "k1"
    kl_in_reward: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    value_clip: float = 0.5
    whiten_advantages: bool = True


class PPO(PolicyGradient):
    """Actor-critic PPO: GAE advantages, clipped policy and value losses."""

    Config = PPOConfig

    def requirements(self) -> Requirements:
        return Requirements(critic=True, reference=self.config.kl_coef > 0, off_policy=True)

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return F.gae_advantages(batch.token_rewards, batch.values, batch.response_mask, gamma=self.config.gamma,
                                lam=self.config.lam, whiten=self.config.whiten_advantages)

    def value_loss(self, *, batch: Batch, values: torch.Tensor | None = None, log_probs=None, entropy=None):
        return F.clipped_value_loss(values, batch.values, batch.returns, batch.response_mask,
                                    clip=self.config.value_clip, agg_mode=self.config.loss_agg_mode,
                                    norm_length=batch.info.get("max_new_tokens"))
