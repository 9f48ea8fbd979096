"""Reusable pieces of policy-gradient algorithms, as small pure functions.

Advantage estimators, KL estimators, loss aggregation modes and the PPO-clip loss live here so
that an algorithm plugin combines them instead of copying them. Every function takes masks
explicitly: tokens with mask 0 (padding, tool outputs) never contribute.

:func:`masked_mean` and :func:`scores_to_token_rewards` are the core's own (:mod:`verl_core.batch`: its
rollout stage uses them) and are re-exported here, so that an algorithm finds all of its pieces in one module.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import torch

from verl_core.batch import Batch, masked_mean, scores_to_token_rewards

__all__ = [
    "with_regularizers",
    "KLEstimator",
    "LossAggMode",
    "KL_ESTIMATORS",
    "KL_ALIASES",
    "LOSS_AGG_MODES",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "agg_loss",
    "agg_units",
    "kl_penalty",
    "scores_to_token_rewards",
    "sequence_rewards",
    "group_normalized_advantages",
    "gae_advantages",
    "ppo_clip_loss",
    "truncated_is_weights",
    "rollout_is_weights",
    "policy_regularizers",
    "ppo_policy_loss",
    "clipped_value_loss",
]

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
#: verl's names of the per-token KL estimators (:func:`kl_penalty` has the table).
KLEstimator = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+"]
KL_ESTIMATORS = frozenset(get_args(KLEstimator))
#: verl's second names of the KL estimators.
KL_ALIASES = {"kl": "k1", "mse": "k2", "k3": "low_var_kl"}
LOSS_AGG_MODES = frozenset(get_args(LossAggMode))


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from sampled-token log-probs, by verl's names.

    With ``r = log p - log q`` (policy minus reference; Schulman, "Approximating KL divergence", 2020):

    ============================  ==========================================  ===========================
    name                          value                                       note
    ============================  ==========================================  ===========================
    ``k1`` / ``kl``               ``r``                                       unbiased, can be negative
    ``abs``                       ``|r|``                                     biased upward
    ``k2`` / ``mse``              ``r^2 / 2``                                 its gradient is the KL's
    ``k3`` / ``low_var_kl``       ``exp(-r) + r - 1``, ``r`` clamped to       unbiased, never negative;
                                  [-20, 20] first, the result to [-10, 10]    finite at a -inf log-prob
    ``k1+`` / ``k3+``             the value of ``k1`` / ``k3``, the gradient  straight-through: an
                                  of ``k2``                                   unbiased KL gradient
    ============================  ==========================================  ===========================

    ``k3`` means what it means in verl (the clamped ``low_var_kl``), so a config moved from verl
    trains the same loss.
    """
    diff = log_probs - ref_log_probs
    name = estimator[:-1] if estimator.endswith("+") and estimator in KL_ESTIMATORS else estimator
    if name in ("k1", "kl"):
        value = diff
    elif name == "abs":
        value = diff.abs()
    elif name in ("k2", "mse"):
        value = 0.5 * diff.square()
    elif name in ("k3", "low_var_kl"):
        neg = (-diff).clamp(-20.0, 20.0)
        value = (torch.exp(neg) - neg - 1).clamp(-10.0, 10.0)
    else:
        raise ValueError(f"kl_estimator: unknown {estimator!r}; use one of {sorted(KL_ESTIMATORS)}")
    if name == estimator:
        return value
    grad = 0.5 * diff.clamp(-20.0, 20.0).square()  # clamped like k3: finite at a -inf log-prob
    return grad - grad.detach() + value.detach()


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over the masked entries."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return out if shift_mean else out + mean


def agg_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, *, norm_length: int | None = None) -> torch.Tensor:
    """Reduce a ``[B, R]`` per-token loss to a scalar.

    Modes:
        ``token-mean``: mean over all valid tokens of the batch (DAPO, verl's default).
        ``seq-mean-token-sum``: sum within each sequence, mean over sequences.
        ``seq-mean-token-mean``: mean within each sequence, mean over sequences (original GRPO).
        ``seq-mean-token-sum-norm``: sum within each sequence divided by a constant length
            (``norm_length``: the rollout's response budget, ``batch.info["max_new_tokens"]``), mean over
            sequences (Dr. GRPO). Without it this mode raises: the tensor's width would change with every
            micro-batch a backend trims, and the gradient with it.
    """
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return masked_mean(loss, mask)
    seq_valid = (mask.sum(-1) > 0).to(loss.dtype)
    n_seq = seq_valid.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum":
        per_seq = masked_sum(loss, mask, -1)
    elif mode == "seq-mean-token-mean":
        per_seq = masked_sum(loss, mask, -1) / mask.sum(-1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        if not norm_length:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' divides by the response budget, "
                             "batch.info['max_new_tokens'], and this batch records none (the run's rollout stage "
                             "and environments record it); set it, or choose another loss_agg_mode")
        per_seq = masked_sum(loss, mask, -1) / float(norm_length)
    else:
        raise ValueError(f"loss_agg_mode: unknown mode {mode!r}; use one of {sorted(LOSS_AGG_MODES)}")
    return (per_seq * seq_valid).sum() / n_seq


def agg_units(mask: torch.Tensor, mode: str) -> float:
    """How many units :func:`agg_loss` with ``mode`` averages ``mask``'s batch over: its loss tokens for
    ``token-mean``, its sequences with at least one loss token for the ``seq-mean-*`` modes.

    A backend that cuts a mini-batch into micro-batches (by size, by token budget, over data-parallel
    ranks) weights each micro-batch's loss by its units over the mini-batch's, so that the sum is the
    loss of the whole mini-batch, not a mean of micro-batch means.
    """
    if mode == "token-mean":
        return float(mask.sum())
    if mode in LOSS_AGG_MODES:
        return float((mask.sum(-1) > 0).sum())
    raise ValueError(f"loss_agg_mode: unknown mode {mode!r}; use one of {sorted(LOSS_AGG_MODES)}")


def sequence_rewards(batch: Batch) -> torch.Tensor:
    """Each sample's total reward ``[B]``: its score plus whatever nodes added to its token rewards
    beyond the score (a KL penalty folded into the rewards).

    Exactly ``scores`` when the token rewards are the score on the last token, also for a response
    with no trainable token (whose token rewards are all masked).
    """
    scores = batch.scores.float()
    if batch.token_rewards is None:
        return scores
    extra = (batch.token_rewards.float() - scores_to_token_rewards(scores, batch.response_mask)) * batch.response_mask
    return scores + extra.sum(-1)


def group_normalized_advantages(scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor, *,
                                norm_by_std: bool = True, eps: float = 1e-6, unbiased_std: bool = True,
                                ) -> torch.Tensor:
    """GRPO outcome advantage: ``(r - mean_group) / (std_group + eps)`` broadcast over tokens.

    Shao et al., "DeepSeekMath" (arXiv:2402.03300). The standard deviation is Bessel-corrected
    (``n - 1``, as verl and TRL compute it) unless ``unbiased_std=False`` (the population's, ``n``).
    A group of one sample gets advantage 0: it has no baseline (verl gives it its raw score).
    ``norm_by_std=False`` gives the Dr. GRPO variant (arXiv:2503.20783).
    """
    scores = scores.float()
    adv = torch.zeros_like(scores)
    for gid in torch.unique(group_ids):
        members = group_ids == gid
        group = scores[members]
        if group.numel() < 2:
            continue
        centred = group - group.mean()
        std = group.std(unbiased=unbiased_std)
        # Equal rewards carry no signal: advantage 0 (also when eps is 0).
        adv[members] = centred / (std + eps) if norm_by_std and std > 0 else (centred if not norm_by_std else 0.0)
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, *,
                   gamma: float, lam: float, whiten: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens (Schulman et al., arXiv:1506.02438).

    Masked positions are skipped: the recursion carries over them so tool tokens between policy
    turns neither add reward nor break the chain. Returns ``(advantages, returns)``.
    """
    mask = response_mask.to(values.dtype)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype)
    last_gae = torch.zeros_like(next_value)
    adv_rev = []
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        # Where the token is masked, keep the running quantities unchanged.
        next_value = m * values[:, t] + (1 - m) * next_value
        last_gae = m * gae + (1 - m) * last_gae
        adv_rev.append(last_gae * m)
    advantages = torch.stack(adv_rev[::-1], dim=1)
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, mask) * mask
    return advantages, returns * mask


def ppo_clip_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, *, clip_low: float, clip_high: float, clip_c: float = 0.0,
                  agg_mode: str = "token-mean", norm_length: int | None = None,
                  token_weights: torch.Tensor | None = None,
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al., arXiv:1707.06347), asymmetric clip (DAPO) and
    optional dual clip for negative advantages (Ye et al., arXiv:1912.09729). ``norm_length`` is
    passed to :func:`agg_loss`; ``token_weights`` (e.g. :func:`truncated_is_weights`) scale each
    token's loss before aggregation."""
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    if clip_c > 0:
        dual = torch.minimum(-advantages * clip_c, loss)
        loss = torch.where(advantages < 0, dual, loss)
    if token_weights is not None:
        loss = loss * token_weights.detach()
    mask = response_mask.to(loss.dtype)
    stats = {
        "clip_frac": masked_mean(clipped, mask).detach(),
        "approx_kl": masked_mean(-log_ratio, mask).detach(),
        "ratio_mean": masked_mean(ratio, mask).detach(),
    }
    return agg_loss(loss, mask, agg_mode, norm_length=norm_length), stats


def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                         *, cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(pi_train / pi_rollout, cap)`` per token, and their stats.

    When the rollout engine (vLLM, say) samples with probabilities slightly different from the
    trainer's, the samples are off-policy for the trainer; weighting each token's loss by the
    truncated ratio corrects that with bounded variance (Yao et al., 2025, "Your efficient RL
    framework secretly brings you off-policy RL training"; Ionides, 2008). No gradient flows
    through the weights.
    """
    ratio = torch.exp((old_log_probs - rollout_log_probs).clamp(-20.0, 20.0)).detach()
    weights = ratio.clamp(max=cap)
    mask = response_mask.to(weights.dtype)
    return weights, {"ppo/rollout_is_weight_mean": float(masked_mean(weights, mask)),
                     "ppo/rollout_is_clip_frac": float(masked_mean((ratio > cap).to(mask.dtype), mask))}


def rollout_is_weights(config: Any, batch: Batch, *, trainer_log_probs: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The truncated importance weights ``config.rollout_is_cap`` asks for (``None`` when it is 0).

    ``trainer_log_probs``: the trainer's log-probs of the sampled tokens under the policy that
    generated them; the batch's old log-probs by default (an on-policy loss without old log-probs
    passes its current, detached ones).
    """
    if config.rollout_is_cap <= 0:
        return None, {}
    if batch.rollout_log_probs is None:
        raise ValueError("algorithm.rollout_is_cap needs the rollout engine's log-probs, but the batch has none")
    reference = batch.old_log_probs if trainer_log_probs is None else trainer_log_probs
    return truncated_is_weights(reference, batch.rollout_log_probs, batch.response_mask, cap=config.rollout_is_cap)


def policy_regularizers(config: Any, *, batch: Batch, log_probs: torch.Tensor, entropy: torch.Tensor | None,
                        ) -> tuple[torch.Tensor, dict[str, float]]:
    """The KL-to-reference loss and entropy bonus an :class:`AlgorithmConfig` asks for.

    Returns the term to add to any policy-gradient loss (0 when neither is enabled) and its
    metrics, so that a new loss gets the usual ``kl_coef``/``entropy_coef`` knobs for free.
    """
    mask = batch.response_mask
    norm = batch.info.get("max_new_tokens")
    term = log_probs.new_zeros(())
    metrics: dict[str, float] = {}
    if config.kl_coef > 0 and not config.kl_in_reward:
        if batch.ref_log_probs is None:
            raise ValueError("kl_coef > 0 needs reference log-probs, but the batch has none")
        kl = agg_loss(kl_penalty(log_probs, batch.ref_log_probs, config.kl_estimator), mask, config.loss_agg_mode,
                      norm_length=norm)
        term = term + config.kl_coef * kl
        metrics["ppo/kl_loss"] = float(kl.detach())
    if entropy is not None:
        # Logged in the loss's own aggregation (as verl does), so that it, too, is a mean over the
        # mini-batch however the backend cuts it.
        ent = agg_loss(entropy, mask, config.loss_agg_mode, norm_length=norm)
        if config.entropy_coef != 0:
            term = term - config.entropy_coef * ent
        metrics["ppo/entropy"] = float(ent.detach())
    return term, metrics


def ppo_policy_loss(config: Any, *, batch: Batch, log_probs: torch.Tensor,
                    entropy: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The full actor loss: PPO-clip, plus KL-to-reference loss and entropy bonus when enabled.

    ``seq-mean-token-sum-norm`` divides by the rollout's response budget, which the batch records
    (``info["max_new_tokens"]``): a constant, as Dr. GRPO prescribes, not the batch's width.
    """
    mask = batch.response_mask
    weights, is_metrics = rollout_is_weights(config, batch)
    loss, stats = ppo_clip_loss(log_probs, batch.old_log_probs, batch.advantages, mask,
                                clip_low=config.clip_ratio_low, clip_high=config.clip_ratio_high,
                                clip_c=config.clip_ratio_c, agg_mode=config.loss_agg_mode,
                                norm_length=batch.info.get("max_new_tokens"), token_weights=weights)
    return with_regularizers(config, batch=batch, log_probs=log_probs, entropy=entropy, loss=loss, stats=stats,
                             is_metrics=is_metrics)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       response_mask: torch.Tensor, *, clip: float, agg_mode: str = "token-mean",
                       norm_length: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss: ``0.5 * max((v - R)^2, (clip(v) - R)^2)``, aggregated as :func:`agg_loss`."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss = 0.5 * torch.maximum((values - returns).square(), (clipped - returns).square())
    mask = response_mask.to(loss.dtype)
    out = agg_loss(loss, mask, agg_mode, norm_length=norm_length)
    frac = masked_mean(((values - returns).square() < (clipped - returns).square()).float(), mask)
    return out, {"critic/value_loss": float(out.detach()), "critic/clip_frac": float(frac),
                 "critic/values_mean": float(masked_mean(values.detach(), mask))}


def with_regularizers(config: Any, *, batch: Batch, log_probs: torch.Tensor, entropy: torch.Tensor | None,
                      loss: torch.Tensor, stats: dict[str, torch.Tensor],
                      is_metrics: dict[str, float] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """A policy-gradient loss plus the KL/entropy terms ``config`` asks for, with ``ppo/*`` metrics.

    The metric names are verl-algorithms' (``ppo/pg_loss``, ``ppo/actor_loss``, ``ppo/<stat>``), so
    dashboards and the console line read every algorithm the same way.
    """
    metrics = {"ppo/pg_loss": float(loss.detach()), **(is_metrics or {})}
    extra, extra_metrics = policy_regularizers(config, batch=batch, log_probs=log_probs, entropy=entropy)
    loss = loss + extra
    metrics.update(extra_metrics)
    metrics.update({f"ppo/{k}": float(v) for k, v in stats.items()})
    metrics["ppo/actor_loss"] = float(loss.detach())
    return loss, metrics
