"""Dr. GRPO: GRPO without its length and difficulty biases.

Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783.
Two changes to GRPO: the advantage is ``r - mean_group`` without dividing by the group's standard
deviation (which over-weights too-easy and too-hard prompts), and the token losses of a response
are summed and divided by a constant (the response budget) instead of the response's own length
(which favours long wrong answers and short right ones). Everything else is GRPO's PPO-clip
loss; the paper drops the KL term.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_algorithms.base import LossAggMode
from verl_algorithms.grpo import GRPO, GRPOConfig

__all__ = ["DrGRPO", "DrGRPOConfig"]


@dataclass
class DrGRPOConfig(GRPOConfig):
    """Dr. GRPO settings: GRPO's, with the paper's two fixes switched on.

    Attributes:
        norm_adv_by_std: False: advantages are ``r - mean_group``.
        loss_agg_mode: ``"seq-mean-token-sum-norm"``: per-response token sums over the rollout's
            ``max_new_tokens`` (recorded on the batch), averaged over responses.
    """

    norm_adv_by_std: bool = False
    loss_agg_mode: LossAggMode = "seq-mean-token-sum-norm"
    kl_coef: float = 0.0


class DrGRPO(GRPO):
    """GRPO with unnormalised group advantages and constant-length loss normalisation."""

    Config = DrGRPOConfig
