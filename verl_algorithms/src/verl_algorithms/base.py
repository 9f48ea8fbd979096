"""The policy-gradient family: its shared settings, its default dataflow and its default loss.

Most RL algorithms for language models are PPO variants: a clipped importance ratio, an optional KL
to a reference policy, an entropy bonus, and an advantage estimator that differs per algorithm.
:class:`PPOFamilyConfig` holds the knobs they share and :class:`PolicyGradient` the step they share,
so an algorithm of this family is its config, its ``compute_advantages`` and, where it differs, its
``policy_loss``. Algorithms outside the family (DPO, SPIN, ...) implement
:class:`~verl_core.contracts.Algorithm` directly and never see these knobs.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping, get_args

import torch

from verl_core.batch import Batch
from verl_core.kit import DataflowBuilder
from verl_core.contracts import Algorithm, AlgorithmConfig, Requirements, RolloutRequest

from verl_algorithms import functional as F
from verl_algorithms.functional import KLEstimator, LossAggMode

__all__ = ["PPOFamilyConfig", "PolicyGradient", "KLEstimator", "LossAggMode", "OldLogProbs", "kl_in_reward",
           "without_v1_keys"]

OldLogProbs = Literal["auto", "recompute", "rollout"]

#: Every algorithm's config before Core v2 (now PPOFamilyConfig's knobs) held these, with these defaults.
V1_DEFAULTS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 0.0, "kl_coef": 0.0,
               "kl_estimator": "low_var_kl", "kl_in_reward": False, "entropy_coef": 0.0,
               "loss_agg_mode": "token-mean", "use_rollout_log_probs": False, "rollout_is_cap": 0.0}


def without_v1_keys(config_cls: type, section: dict[str, Any]) -> dict[str, Any]:
    """A pre-Core-v2 ``[algorithm]`` section: the PPO keys at their old defaults that ``config_cls`` no longer
    takes are dropped (:meth:`~verl_core.contracts.Algorithm.saved_settings`); one set to anything else is left
    for the config check to refuse by name."""
    accepted = {f.name for f in dataclasses.fields(config_cls)}
    stale = [k for k, v in V1_DEFAULTS.items() if k in section and k not in accepted and section[k] == v]
    if stale:
        logging.getLogger(__name__).warning("the saved config predates Core v2; dropping algorithm keys its "
                                            "algorithm no longer has (at their old defaults): %s", ", ".join(stale))
    return {k: v for k, v in section.items() if k not in stale}



@dataclass
class PPOFamilyConfig(AlgorithmConfig):
    """Settings of policy-gradient algorithms with a PPO-style update.

    Attributes:
        clip_ratio_low: lower PPO clip range (ratio >= 1 - clip_ratio_low).
        clip_ratio_high: upper PPO clip range (ratio <= 1 + clip_ratio_high).
        clip_ratio_c: dual-clip bound for negative advantages: their loss is at most
            ``-clip_ratio_c * A`` (Ye et al., arXiv:1912.09729); 0 disables, otherwise > 1.
        kl_coef: weight of the KL to the reference policy (0 = no reference model needed).
        kl_estimator: verl's names and meanings: ``"k1"``/``"kl"``, ``"abs"``, ``"k2"``/``"mse"``,
            ``"k3"``/``"low_var_kl"`` (clamped, as verl's), and the straight-through ``"k1+"``,
            ``"k3+"`` (:func:`~verl_algorithms.functional.kl_penalty` has the table).
        kl_in_reward: subtract the KL from token rewards (PPO style) instead of adding a loss term.
        entropy_coef: entropy bonus weight.
        loss_agg_mode: ``"token-mean"``, ``"seq-mean-token-sum"``, ``"seq-mean-token-mean"`` or
            ``"seq-mean-token-sum-norm"``.
        old_log_probs: which log-probs the PPO ratio divides by (``docs/loss-math.md`` has the table):
            ``"auto"`` recomputes them with the actor, except on a step that is on-policy (staleness 0)
            and takes one optimizer step (one epoch, one mini-batch), where they equal the update's own
            log-probs: the update uses those, detached, and the forward goes (ratio 1, same gradient;
            ``actor/old_log_probs_reused``); ``"recompute"`` always runs the forward; ``"rollout"``
            takes the engine's log-probs (the ratio then also corrects engine/trainer mismatch).
        use_rollout_log_probs: ``true`` is ``old_log_probs = "rollout"`` (the older spelling).
        rollout_is_cap: truncated importance sampling between rollout and training log-probs: each
            token's policy-gradient loss is weighted by ``min(exp(old - rollout log-prob), cap)``,
            correcting for an inference engine whose probabilities differ from the trainer's
            (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL
            training"); 0 disables. Needs recomputed old log-probs (``use_rollout_log_probs = false``).
    """

    value_aliases: ClassVar[dict[str, dict[str, str]]] = {"kl_estimator": F.KL_ALIASES}
    inert_fields: ClassVar[dict[str, str]] = {
        "old_log_probs": "auto and recompute give the same loss and gradient (only the forward goes); rollout is "
                         "use_rollout_log_probs; tested by verl_algorithms/tests/test_old_log_probs.py"}

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "low_var_kl"
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    loss_agg_mode: LossAggMode = "token-mean"
    old_log_probs: OldLogProbs = "auto"
    use_rollout_log_probs: bool = False
    rollout_is_cap: float = 0.0

    @property
    def old_log_prob_source(self) -> OldLogProbs:
        """``old_log_probs`` with ``use_rollout_log_probs = true`` read as ``"rollout"``."""
        return "rollout" if self.use_rollout_log_probs else self.old_log_probs

    def validate(self) -> None:
        super().validate()
        for key, allowed in (("kl_estimator", KLEstimator), ("loss_agg_mode", LossAggMode)):
            if getattr(self, key) not in get_args(allowed):
                raise ValueError(f"{key}: must be one of {list(get_args(allowed))}")
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError("clip_ratio_low/clip_ratio_high: must be >= 0")
        if 0 < self.clip_ratio_c <= 1 or self.clip_ratio_c < 0:
            # A bound at or below 1 caps every negative-advantage token's loss at a constant: no gradient.
            raise ValueError("clip_ratio_c: must be > 1 (dual-clip PPO, 3.0 in the paper) or 0 (off)")
        if self.kl_coef < 0:
            raise ValueError("kl_coef: must be >= 0 (0 = no KL term and no reference model)")
        if self.kl_in_reward and self.kl_estimator.endswith("+"):
            raise ValueError(f"kl_estimator: {self.kl_estimator!r} differs from {self.kl_estimator[:-1]!r} only in the "
                             f"gradient of a KL loss, and kl_in_reward puts the KL in the rewards (no gradient); use "
                             f"{self.kl_estimator[:-1]!r} there, or kl_in_reward = false")
        if self.rollout_is_cap < 0:
            raise ValueError("rollout_is_cap: must be >= 0 (0 disables the correction)")
        if self.old_log_probs not in get_args(OldLogProbs):
            raise ValueError(f"old_log_probs: must be one of {list(get_args(OldLogProbs))}")
        if self.use_rollout_log_probs and self.old_log_probs == "recompute":
            raise ValueError("old_log_probs: 'recompute' contradicts use_rollout_log_probs = true (the engine's "
                             "log-probs); set only old_log_probs")
        if self.rollout_is_cap > 0 and self.old_log_prob_source == "rollout":
            raise ValueError("rollout_is_cap: corrects recomputed old log-probs towards the rollout's; with "
                             "use_rollout_log_probs = true (old_log_probs = 'rollout') the weights are all 1. Set one of them.")


class PolicyGradient(Algorithm):
    """Base of the PPO family: the standard step and the PPO-clip loss with KL and entropy terms.

    The step is: the run's rollout stage (with what :meth:`rollout_request` asks of it), the
    algorithm's reward shaping (:meth:`shape_rewards`, none by default), old log-probs, reference
    log-probs when a KL term is on, critic values when a critic is required, the KL penalty in the
    rewards when ``kl_in_reward``, advantages, the critic update and the actor update. Which nodes
    appear follows from the config and :meth:`requirements`; subclasses rarely override it.
    """

    Config = PPOFamilyConfig

    @classmethod
    def saved_settings(cls, section: dict[str, Any]) -> dict[str, Any]:
        return without_v1_keys(cls.Config, section)

    def requirements(self) -> Requirements:
        # Off-policy capable: the PPO ratio against the old log-probs, and rollout_is_cap's truncated
        # importance weights against the sampling policy's log-probs.
        return Requirements(critic=False, reference=self.config.kl_coef > 0, off_policy=True)

    def rollout_request(self) -> RolloutRequest:
        """What this algorithm asks of the rollout stage (filters, baselines); nothing by default."""
        return RolloutRequest()

    def shape_rewards(self, df: DataflowBuilder) -> None:
        """Add nodes that change ``scores``/``token_rewards`` after the rollout stage (none by default)."""

    #: The batch fields :meth:`compute_advantages` reads (GAE reads ``values`` too, automatically).
    advantage_inputs: tuple[str, ...] = ("token_rewards",)

    def build_dataflow(self, df: DataflowBuilder) -> None:
        cfg = self.config
        needs = self.requirements()
        df.rollout(self.rollout_request())
        self.shape_rewards(df)
        source = cfg.old_log_prob_source
        df.actor_log_probs(from_rollout=source == "rollout", reuse=source == "auto")
        if needs.reference:
            df.reference_log_probs()
        reads = self.advantage_inputs
        if needs.critic:
            df.critic_values()
            reads = (*reads, "values")
        if needs.reference and cfg.kl_in_reward:
            kl_in_reward(df, kl_coef=cfg.kl_coef, estimator=cfg.kl_estimator)
        df.compute_advantages(self, reads=reads)
        if needs.critic:
            df.update_critic(self)
        df.update_actor(self)

    def loss_units(self, batch: Batch) -> float:
        """Loss tokens for ``token-mean``, sequences for the ``seq-mean-*`` modes (policy and value loss)."""
        return F.agg_units(batch.response_mask, self.config.loss_agg_mode)

    def step_metrics(self, batch: Batch, metrics: Mapping[str, float]) -> dict[str, float]:
        """``ppo/kl_divergence`` (the policy's drift from the old log-probs unless a KL term reports one) and,
        with a reference, ``actor/ref_kl``: the k3 KL of the old log-probs to the reference's."""
        out = {"ppo/kl_divergence": metrics.get("ppo/kl_divergence", metrics.get("ppo/approx_kl", 0.0))}
        if batch.ref_log_probs is not None and batch.old_log_probs is not None:
            out["actor/ref_kl"] = float(F.masked_mean(F.kl_penalty(batch.old_log_probs, batch.ref_log_probs, "k3"),
                                                      batch.response_mask))
        return out

    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """PPO-clip policy loss with optional KL and entropy terms."""
        return F.ppo_policy_loss(self.config, batch=batch, log_probs=log_probs, entropy=entropy)


def kl_in_reward(df: DataflowBuilder, *, kl_coef: float, estimator: str) -> str:
    """Add the ``kl_reward`` node to ``df``: ``kl_coef * KL(policy || reference)`` (per token, by
    :func:`~verl_algorithms.functional.kl_penalty`'s ``estimator``) subtracted from the token rewards, PPO's
    KL-in-reward, logged as ``ppo/kl_in_reward``. It runs after the old and the reference log-probs."""
    return df.node("kl_reward", lambda ctx: _kl_reward(ctx, kl_coef, estimator),
                   reads=("token_rewards", "old_log_probs", "ref_log_probs"), writes=("token_rewards",))


def _kl_reward(ctx: Any, kl_coef: float, estimator: str) -> dict[str, torch.Tensor]:
    b = ctx.batch
    kl = F.kl_penalty(b.old_log_probs, b.ref_log_probs, estimator) * b.response_mask
    ctx.metrics["ppo/kl_in_reward"] = float(F.masked_mean(kl, b.response_mask))
    return {"token_rewards": b.token_rewards - kl_coef * kl}
