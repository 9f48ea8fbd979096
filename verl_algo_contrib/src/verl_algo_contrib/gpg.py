"""GPG: group policy gradient.

Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
arXiv:2504.02546. Strips GRPO down to the plain policy gradient: no importance ratio, no clipping,
no reference model and no KL term, just ``-A * log pi(y_t)`` averaged over tokens on fresh
samples. The advantage is the group-centred reward ``r - mean_group`` (divided by ``F_norm``, 1
by default), scaled by ``alpha = B / (B - M)`` where ``M`` counts samples in groups with equal
rewards: those contribute nothing, and without the correction they would shrink the gradient.
Because there is no ratio, it needs no old log-probs, which saves a forward pass per step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from verl_algorithms import functional as F
from verl_algorithms.base import PolicyGradient, PPOFamilyConfig
from verl_core.batch import Batch
from verl_core.contracts import Requirements

from verl_algo_contrib import functional as CF

__all__ = ["GPG", "GPGConfig"]


@dataclass
class GPGConfig(PPOFamilyConfig):
    """GPG settings.

    Attributes:
        norm_adv_by_std: divide by the group's standard deviation (``F_norm = std``); the paper's
            default is ``F_norm = 1``.
        correct_for_invalid: apply ``alpha = B / (B - M)``.
        eps: added to the standard deviation.
        epochs: 1 and ``mini_batch_size`` 0: the loss has no ratio, so it is only valid on-policy.

    The PPO clip ratios are refused when moved off their defaults: there is no ratio to clip.
    """

    inert_when: ClassVar[dict[tuple[str, str], str]] = {
        ("eps", "norm_adv_by_std"): "eps is added to the standard deviation, which only norm_adv_by_std = true divides by",
    }

    norm_adv_by_std: bool = False
    correct_for_invalid: bool = True
    eps: float = 1e-6
    epochs: int = 1
    mini_batch_size: int = 0
    kl_coef: float = 0.0

    def validate(self) -> None:
        super().validate()
        if self.epochs != 1 or self.mini_batch_size != 0:
            raise ValueError("epochs: GPG's loss has no importance ratio, so it must update once per batch "
                             "(epochs = 1, mini_batch_size = 0)")
        if self.kl_in_reward:
            raise ValueError("kl_in_reward: GPG computes no old log-probs, so a KL penalty cannot be folded into "
                             "the rewards; keep kl_in_reward = false (the KL is then a loss term)")
        if self.use_rollout_log_probs or self.old_log_probs != "auto":
            key = "use_rollout_log_probs" if self.use_rollout_log_probs else "old_log_probs"
            raise ValueError(f"{key}: GPG uses no old log-probs at all; leave it at its default")
        ppo = PPOFamilyConfig()
        for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c"):
            if getattr(self, key) != getattr(ppo, key):
                raise ValueError(f"{key}: GPG's loss has no importance ratio, so there is nothing to clip; leave "
                                 f"{key} at its default ({getattr(ppo, key)})")


class GPG(PolicyGradient):
    """Group-centred advantages with the plain policy-gradient loss."""

    Config = GPGConfig

    def requirements(self) -> Requirements:
        # No importance ratio: a sample from an older policy would be weighted as if the current one drew it.
        return dataclasses.replace(super().requirements(), off_policy=False)

    def build_dataflow(self, df: Any) -> None:
        df.rollout(self.rollout_request())
        self.shape_rewards(df)
        if self.requirements().reference:
            df.reference_log_probs()
        df.compute_advantages(self, reads=("token_rewards",))
        # No ratio, so no old log-probs: the update reads only the advantages.
        df.update_actor(self, reads=("advantages",))

    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        adv = CF.gpg_advantages(CF.sequence_rewards(batch), batch.group_ids, batch.response_mask,
                                norm_by_std=cfg.norm_adv_by_std, eps=cfg.eps,
                                correct_for_invalid=cfg.correct_for_invalid)
        return adv, adv

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        # On-policy, so the policy that sampled is the current one: its detached log-probs are the
        # trainer's side of the rollout correction.
        weights, is_metrics = F.rollout_is_weights(self.config, batch, trainer_log_probs=log_probs.detach())
        loss, stats = CF.vanilla_pg_loss(log_probs, batch.advantages, batch.response_mask,
                                         agg_mode=self.config.loss_agg_mode, token_weights=weights,
                                         norm_length=batch.info.get("max_new_tokens"))
        return CF.with_regularizers(self.config, batch=batch, log_probs=log_probs, entropy=entropy, loss=loss,
                                    stats=stats, is_metrics=is_metrics)
