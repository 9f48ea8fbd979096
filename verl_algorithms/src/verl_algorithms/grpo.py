"""GRPO: group-relative policy optimisation.

Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
Models", arXiv:2402.03300. Relative to PPO it drops the critic: each prompt is sampled ``n``
times and a response's advantage is its reward normalised by the mean and standard deviation of
its group. The KL to the reference policy is a loss term rather than a reward penalty, or with
``kl_in_reward`` a penalty in the token rewards whose sum is then the sample's reward, as in verl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from verl_core.batch import Batch

from verl_algorithms import functional as F
from verl_algorithms.base import KLEstimator, PolicyGradient, PPOFamilyConfig

__all__ = ["GRPO", "GRPOConfig"]


@dataclass
class GRPOConfig(PPOFamilyConfig):
    """GRPO settings (defaults follow the paper and verl's recipe).

    Attributes:
        norm_adv_by_std: divide by the group's standard deviation (False gives Dr. GRPO's advantage).
        eps: added to the standard deviation.
        group_std: ``"bessel"`` (``n - 1``; verl, TRL) or ``"population"`` (``n``). Both are in use:
            at 8 samples they differ by a factor sqrt(8/7), which Adam's normalisation mostly absorbs
            and the PPO clip range does not. ``docs/loss-math.md`` lists the conventions.
    """

    inert_when: ClassVar[dict[tuple[str, str], str]] = {
        ("eps", "norm_adv_by_std"): "eps is added to the standard deviation, which only norm_adv_by_std = true divides by",
        ("group_std", "norm_adv_by_std"): "the standard deviation is only used when norm_adv_by_std = true",
    }

    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "low_var_kl"
    norm_adv_by_std: bool = True
    eps: float = 1e-6
    group_std: Literal["bessel", "population"] = "bessel"

    def validate(self) -> None:
        super().validate()
        if self.group_std not in ("bessel", "population"):
            raise ValueError(f"group_std: must be 'bessel' (n - 1, verl's and TRL's) or 'population' (n), "
                             f"not {self.group_std!r}")


class GRPO(PolicyGradient):
    """Group-relative advantages with the PPO-clip loss; no critic."""

    Config = GRPOConfig

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        # The summed token rewards: the score, minus the KL penalty when kl_in_reward folds it in.
        adv = F.group_normalized_advantages(F.sequence_rewards(batch), batch.group_ids, batch.response_mask,
                                            norm_by_std=self.config.norm_adv_by_std, eps=self.config.eps,
                                            unbiased_std=self.config.group_std == "bessel")
        return adv, adv
