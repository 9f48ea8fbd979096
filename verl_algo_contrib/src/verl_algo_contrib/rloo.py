"""RLOO: REINFORCE with a leave-one-out baseline.

Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs", arXiv:2402.14740 (the estimator: Kool et al., "Buy 4 REINFORCE Samples, Get a
Baseline for Free!", 2019). Like GRPO it samples ``k`` responses per prompt and needs no critic,
but the baseline of a response is the mean reward of the *other* ``k - 1`` responses, which keeps
the estimator unbiased, and nothing is divided by a standard deviation. The paper updates with
plain REINFORCE on fresh samples: one epoch over the whole batch, where the PPO-clip loss used
here equals the policy gradient (the ratio is 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_algorithms.base import KLEstimator, PolicyGradient, PPOFamilyConfig
from verl_core.batch import Batch

from verl_algo_contrib import functional as CF

__all__ = ["RLOO", "RLOOConfig"]


@dataclass
class RLOOConfig(PPOFamilyConfig):
    """RLOO settings.

    Attributes:
        kl_in_reward: a KL penalty, when ``kl_coef`` > 0, is subtracted from the reward before the
            baseline (the paper's sequence-level KL-shaped reward); its β is tuned per task in
            the paper, so ``kl_coef`` defaults to 0 here.
        kl_estimator: ``"k1"``, the plain log-ratio of the KL-shaped reward.
        epochs: 1: on-policy REINFORCE.
        mini_batch_size: 0: one optimizer step on the whole batch.
    """

    kl_coef: float = 0.0
    kl_in_reward: bool = True
    kl_estimator: KLEstimator = "k1"
    epochs: int = 1
    mini_batch_size: int = 0


class RLOO(PolicyGradient):
    """Leave-one-out baselines over each prompt's samples; critic-free."""

    Config = RLOOConfig

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        adv = CF.leave_one_out_advantages(CF.sequence_rewards(batch), batch.group_ids, batch.response_mask)
        return adv, adv
