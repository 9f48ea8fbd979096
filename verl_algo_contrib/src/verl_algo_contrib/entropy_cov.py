"""Clip-Cov and KL-Cov: GRPO with a loss that keeps the policy's entropy from collapsing.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv:2505.22617. The paper shows that a policy-gradient step lowers the entropy by the covariance
between each token's log-probability and its advantage, and that a small fraction of tokens carries
most of that covariance. Both methods touch only those tokens: Clip-Cov stops the gradient of a random
few of them, KL-Cov puts a KL penalty on the top ones. Advantages are GRPO's.

The covariance is taken over the loss tokens of each micro-batch the backend evaluates (the loss sees
no more), as in verl's implementation; the fractions are of those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_algorithms import functional as F
from verl_algorithms.grpo import GRPO, GRPOConfig
from verl_core.batch import Batch

from verl_algo_contrib import functional as CF

__all__ = ["ClipCov", "ClipCovConfig", "KLCov", "KLCovConfig"]


@dataclass
class ClipCovConfig(GRPOConfig):
    """Clip-Cov settings (the paper's defaults).

    Attributes:
        cov_fraction: share of the loss tokens whose gradient is stopped (``r``), 2e-4.
        cov_low: lower covariance bound of the tokens drawn from (``omega_low``), 1.0.
        cov_high: upper covariance bound (``omega_high``), 5.0.
    """

    cov_fraction: float = 2e-4
    cov_low: float = 1.0
    cov_high: float = 5.0

    def validate(self) -> None:
        super().validate()
        if not 0.0 < self.cov_fraction <= 1.0:
            raise ValueError("cov_fraction: must be in (0, 1] (the paper uses 2e-4)")
        if self.cov_low >= self.cov_high:
            raise ValueError(f"cov_low ({self.cov_low}) must be below cov_high ({self.cov_high})")


class ClipCov(GRPO):
    """Group-normalised advantages; PPO-clip with the gradient of a few high-covariance tokens stopped."""

    Config = ClipCovConfig

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        weights, is_metrics = F.rollout_is_weights(cfg, batch)
        loss, stats = CF.clip_cov_loss(log_probs, batch.old_log_probs, batch.advantages, batch.response_mask,
                                       clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high,
                                       fraction=cfg.cov_fraction, cov_low=cfg.cov_low, cov_high=cfg.cov_high,
                                       clip_c=cfg.clip_ratio_c, agg_mode=cfg.loss_agg_mode, token_weights=weights,
                                       norm_length=batch.info.get("max_new_tokens"))
        return CF.with_regularizers(cfg, batch=batch, log_probs=log_probs, entropy=entropy, loss=loss, stats=stats,
                                    is_metrics=is_metrics)


@dataclass
class KLCovConfig(GRPOConfig):
    """KL-Cov settings (the paper's defaults for 7B models).

    Attributes:
        cov_fraction: share of the loss tokens with the largest covariance that get the penalty
            (``k``), 2e-4 (the paper uses 2e-3 for 32B models).
        cov_kl_coef: weight of ``|log(pi / pi_old)|`` on those tokens (``beta``), 1.0.
    """

    cov_fraction: float = 2e-4
    cov_kl_coef: float = 1.0

    def validate(self) -> None:
        super().validate()
        if (self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c) != (0.2, 0.2, 0.0):
            raise ValueError("clip_ratio_low/clip_ratio_high/clip_ratio_c: KL-Cov's surrogate is unclipped (the KL "
                             "penalty on the top-covariance tokens bounds the update instead); leave them unset, or "
                             "use --algo clip_cov")
        if not 0.0 < self.cov_fraction <= 1.0:
            raise ValueError("cov_fraction: must be in (0, 1] (the paper uses 2e-4 or 2e-3)")
        if self.cov_kl_coef < 0:
            raise ValueError("cov_kl_coef: must be >= 0")


class KLCov(GRPO):
    """Group-normalised advantages; the unclipped surrogate with a KL penalty on the top-covariance tokens."""

    Config = KLCovConfig

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.config
        weights, is_metrics = F.rollout_is_weights(cfg, batch)
        loss, stats = CF.kl_cov_loss(log_probs, batch.old_log_probs, batch.advantages, batch.response_mask,
                                     fraction=cfg.cov_fraction, kl_coef=cfg.cov_kl_coef, agg_mode=cfg.loss_agg_mode,
                                     token_weights=weights, norm_length=batch.info.get("max_new_tokens"))
        return CF.with_regularizers(cfg, batch=batch, log_probs=log_probs, entropy=entropy, loss=loss, stats=stats,
                                    is_metrics=is_metrics)
