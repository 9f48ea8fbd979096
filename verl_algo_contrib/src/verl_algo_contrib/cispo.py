"""CISPO: clipped importance-sampling-weight policy optimisation.

MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
arXiv:2506.13585. GRPO's group-normalised advantages, but the loss is
``-sg[clip(r_t)] * A * log pi(y_t)``: the importance weight is clipped and detached instead of the
surrogate being clipped. PPO's clip zeroes the gradient of tokens whose ratio left the trust
region - often the rare "fork" tokens of a reasoning chain - while CISPO keeps every token's
gradient and only bounds how much it is up-weighted. The paper sets no lower bound (a large
``eps_low``) and tunes only ``eps_high``; it drops the KL term and averages over all tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_algorithms import functional as F
from verl_algorithms.base import LossAggMode
from verl_algorithms.grpo import GRPO, GRPOConfig
from verl_core.batch import Batch

from verl_algo_contrib import functional as CF

__all__ = ["CISPO", "CISPOConfig"]


@dataclass
class CISPOConfig(GRPOConfig):
    """CISPO settings.

    Attributes:
        clip_ratio_low: weight >= 1 - clip_ratio_low; 1.0 means no lower bound, as in the paper.
        clip_ratio_high: weight <= 1 + clip_ratio_high. The M1 paper tunes it without giving a
            value; 4.0 (an upper bound of 5) is the setting of the ScaleRL study (arXiv:2510.13786).
        loss_agg_mode: ``"token-mean"`` over all tokens of the batch, as in the paper.
    """

    clip_ratio_low: float = 1.0
    clip_ratio_high: float = 4.0
    loss_agg_mode: LossAggMode = "token-mean"
    kl_coef: float = 0.0

    def validate(self) -> None:
        super().validate()
        if self.clip_ratio_c:
            raise ValueError("clip_ratio_c: CISPO bounds the importance weight with clip_ratio_low/high and has no "
                             "dual clip; leave clip_ratio_c = 0")


class CISPO(GRPO):
    """Group-normalised advantages with the clipped-IS-weight REINFORCE loss."""

    Config = CISPOConfig

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        weights, is_metrics = F.rollout_is_weights(cfg, batch)
        loss, stats = CF.clipped_is_weight_loss(log_probs, batch.old_log_probs, batch.advantages,
                                                batch.response_mask, clip_low=cfg.clip_ratio_low,
                                                clip_high=cfg.clip_ratio_high, agg_mode=cfg.loss_agg_mode,
                                                token_weights=weights, norm_length=batch.info.get("max_new_tokens"))
        return CF.with_regularizers(cfg, batch=batch, log_probs=log_probs, entropy=entropy, loss=loss, stats=stats,
                                    is_metrics=is_metrics)
