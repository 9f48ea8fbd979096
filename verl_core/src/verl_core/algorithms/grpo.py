"""GRPO: group-relative policy optimisation.

Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", arXiv:2402.03300. Relative to PPO it drops the critic: each prompt is sampled ``n``
times and a response's advantage is its reward normalised by the mean and standard deviation of
its group. The KL to the reference policy is a loss term rather than a reward penalty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_core.algorithms import functional as F
from verl_core.batch import Batch
from verl_core.interfaces import Algorithm, AlgorithmConfig

__all__ = ["GRPO", "GRPOConfig"]


@dataclass
class GRPOConfig(AlgorithmConfig):
    """GRPO settings (defaults follow the paper and verl's recipe).

    Attributes:
        norm_adv_by_std: divide by the group's standard deviation (False gives Dr. GRPO's advantage).
        eps: added to the standard deviation.
    """

    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    norm_adv_by_std: bool = True
    eps: float = 1e-6


class GRPO(Algorithm):
    """Group-relative advantages with the PPO-clip loss; no critic."""

    Config = GRPOConfig

    def build_dataflow(self, df) -> None:
        needs = self.requirements()
        df.actor_generate()
        df.reward_score()
        df.filter_batch(self)
        df.actor_log_probs()
        if needs.reference:
            df.reference_log_probs()
        df.compute_advantages(self, reads=("scores",))
        df.update_actor(self)
        df.sync_weights()

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        adv = F.group_normalized_advantages(batch.scores, batch.group_ids, batch.response_mask,
                                            norm_by_std=self.config.norm_adv_by_std, eps=self.config.eps)
        return adv, adv
