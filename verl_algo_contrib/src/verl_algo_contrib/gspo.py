"""GSPO: group sequence policy optimisation.

Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071. GRPO's advantages, but the
importance ratio and its clipping act on whole sequences: the ratio of a response is the
geometric mean of its token ratios, ``s_i = exp(mean_t log(pi / pi_old))``, and a response is
clipped or kept as a unit. Token-level ratios are noisy for long responses (and under MoE routing
changes); the sequence ratio matches the sequence-level reward. Because ``s_i`` is a
length-normalised quantity, the clip range is tiny (3e-4 / 4e-4 in the paper).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_algorithms import functional as F
from verl_algorithms.base import LossAggMode
from verl_algorithms.grpo import GRPO, GRPOConfig
from verl_core.batch import Batch

from verl_algo_contrib import functional as CF

__all__ = ["GSPO", "GSPOConfig"]


@dataclass
class GSPOConfig(GRPOConfig):
    """GSPO settings (the paper's clip range; sequence-level aggregation).

    Attributes:
        clip_ratio_low: lower clip of the sequence ratio, ``s >= 1 - 3e-4``.
        clip_ratio_high: upper clip of the sequence ratio, ``s <= 1 + 4e-4``.
        loss_agg_mode: ``"seq-mean-token-mean"``: each response counts once.
    """

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4
    loss_agg_mode: LossAggMode = "seq-mean-token-mean"
    kl_coef: float = 0.0

    def validate(self) -> None:
        super().validate()
        if self.clip_ratio_c:
            raise ValueError("clip_ratio_c: GSPO clips the sequence ratio with clip_ratio_low/high and has no dual "
                             "clip; leave clip_ratio_c = 0")


class GSPO(GRPO):
    """Group-normalised advantages with the sequence-level clipped objective."""

    Config = GSPOConfig

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        weights, is_metrics = F.rollout_is_weights(cfg, batch)
        loss, stats = CF.sequence_clip_loss(log_probs, batch.old_log_probs, batch.advantages, batch.response_mask,
                                            clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high,
                                            agg_mode=cfg.loss_agg_mode, token_weights=weights,
                                            norm_length=batch.info.get("max_new_tokens"))
        return CF.with_regularizers(cfg, batch=batch, log_probs=log_probs, entropy=entropy, loss=loss, stats=stats,
                                    is_metrics=is_metrics)
