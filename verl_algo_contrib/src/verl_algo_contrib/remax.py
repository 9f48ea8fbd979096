"""ReMax: REINFORCE with the greedy response's reward as the baseline.

Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
Large Language Models", arXiv:2310.10505. Instead of PPO's critic, each prompt also gets one
greedy response from the current policy, and its reward is subtracted from the sampled
responses' rewards: ``A = r(x, y) - r(x, y_greedy)``. That costs one extra (greedy) generation per
prompt but no value model and no second copy of the weights in the optimizer. The core's
:meth:`~verl_core.dataflow.DataflowBuilder.greedy_baseline` node produces the baseline; the update
is on-policy REINFORCE (one epoch over the batch, where PPO-clip equals the policy gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_core.batch import Batch
from verl_core.interfaces import Algorithm, AlgorithmConfig

from verl_algo_contrib import functional as CF

__all__ = ["ReMax", "ReMaxConfig"]

BASELINE = "baseline_scores"


@dataclass
class ReMaxConfig(AlgorithmConfig):
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
    kl_estimator: str = "k1"
    epochs: int = 1
    mini_batch_size: int = 0


class ReMax(Algorithm):
    """Sampled reward minus the greedy response's reward."""

    Config = ReMaxConfig

    def build_dataflow(self, df: Any) -> None:
        needs = self.requirements()
        df.actor_generate()
        df.reward_score()
        df.greedy_baseline(name=BASELINE)
        df.actor_log_probs()
        if needs.reference:
            df.reference_log_probs()
            if self.config.kl_in_reward:
                df.kl_in_reward(self)
        df.compute_advantages(self, reads=("token_rewards", "extras." + BASELINE))
        df.update_actor(self)
        df.sync_weights()

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        baseline = batch.extras.get(BASELINE)
        if baseline is None:
            raise ValueError(f"ReMax needs batch.extras[{BASELINE!r}] from the greedy_baseline dataflow node")
        return CF.baseline_advantages(batch.token_rewards.float(), baseline, batch.response_mask)
