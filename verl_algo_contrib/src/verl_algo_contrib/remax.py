"""ReMax: REINFORCE with the greedy response's reward as the baseline.

Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
Large Language Models", arXiv:2310.10505. Instead of PPO's critic, each prompt also gets one
greedy response from the current policy, and its reward is subtracted from the sampled
responses' rewards: ``A = r(x, y) - r(x, y_greedy)``. That costs one extra (greedy) generation per
prompt but no value model and no second copy of the weights in the optimizer. The core's
rollout stage produces the baseline on request (``verl_core.kit.run_rollout_stage``); the update
is on-policy REINFORCE (one epoch over the batch, where PPO-clip equals the policy gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_algorithms.base import KLEstimator, PolicyGradient, PPOFamilyConfig
from verl_core.kit import BASELINE as STAGE_BASELINE
from verl_core.batch import Batch
from verl_core.contracts import RolloutRequest

from verl_algo_contrib import functional as CF

__all__ = ["ReMax", "ReMaxConfig"]

BASELINE = STAGE_BASELINE


@dataclass
class ReMaxConfig(PPOFamilyConfig):
    """ReMax settings.

    Attributes:
        kl_coef: a KL-to-reference penalty folded into the reward when > 0 (tuned per task in
            the paper; 0 here, so no reference model is loaded).
        kl_in_reward: the KL penalty is part of the reward, as in the paper's RLHF setting.
        epochs: 1: on-policy REINFORCE.
        mini_batch_size: 0: one optimizer step on the whole batch.
    """

    kl_coef: float = 0.0
    kl_in_reward: bool = True
    kl_estimator: KLEstimator = "k1"
    epochs: int = 1
    mini_batch_size: int = 0


class ReMax(PolicyGradient):
    """Sampled reward minus the greedy response's reward."""

    Config = ReMaxConfig

    advantage_inputs = ("token_rewards", "extras." + BASELINE)

    def rollout_request(self) -> RolloutRequest:
        return RolloutRequest(greedy_baseline=True)

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        baseline = batch.extras.get(BASELINE)
        if baseline is None:
            raise ValueError(f"ReMax needs batch.extras[{BASELINE!r}] from the greedy_baseline rollout stage (RolloutRequest(greedy_baseline=True))")
        return CF.baseline_advantages(batch.token_rewards.float(), baseline, batch.response_mask)
