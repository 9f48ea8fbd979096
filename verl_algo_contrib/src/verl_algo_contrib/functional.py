"""Reusable pieces of the contributed algorithms, as small pure functions over tensors.

They sit next to verl-algorithms' :mod:`verl_algorithms.functional` (KL estimators, loss
aggregation modes, the PPO-clip loss, GRPO and GAE advantages) and follow its conventions: masks
are explicit, tokens with mask 0 (padding, tool outputs) never contribute, and every function
stays finite on degenerate input (one-sample groups, empty responses, all-equal rewards).

* Baselines and advantage estimators: :func:`group_mean`, :func:`leave_one_out_advantages`,
  :func:`length_weighted_baseline_advantages`, :func:`group_mean_whitened_advantages`,
  :func:`returns_to_go`, :func:`baseline_advantages`, :func:`gpg_advantages`.
* Policy losses: :func:`sequence_clip_loss` (GSPO), :func:`clipped_is_weight_loss` (CISPO),
  :func:`vanilla_pg_loss` (GPG), and :func:`with_regularizers` to add the configured KL and
  entropy terms to any of them.
* Batch filters and reward shaping: :func:`drop_equal_reward_groups`, :func:`overlong_penalty`.
* Preference losses: :func:`preference_pairs`, :func:`sequence_log_probs`, :func:`dpo_loss`,
  :func:`kto_loss`, :func:`odds_ratio_loss`.
"""

from __future__ import annotations


import torch
import torch.nn.functional as torch_f

from verl_algorithms.functional import agg_loss, masked_mean, masked_whiten, sequence_rewards, with_regularizers
from verl_core.batch import Batch

__all__ = [
    "sequence_rewards",
    "group_mean",
    "leave_one_out_advantages",
    "length_weighted_baseline_advantages",
    "group_mean_whitened_advantages",
    "returns_to_go",
    "baseline_advantages",
    "gpg_advantages",
    "sequence_clip_loss",
    "clipped_is_weight_loss",
    "vanilla_pg_loss",
    "with_regularizers",
    "drop_equal_reward_groups",
    "overlong_penalty",
    "preference_pairs",
    "sequence_log_probs",
    "dpo_loss",
    "kto_loss",
    "odds_ratio_loss",
]


# ----------------------------------------------------------------------------- baselines and advantages
def group_mean(values: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean of ``values`` over its group, and the group's size (both ``[B]``)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inverse, values)
    counts = torch.zeros(n_groups, dtype=values.dtype).index_add_(0, inverse, torch.ones_like(values))
    return (sums / counts)[inverse], counts[inverse]


def leave_one_out_advantages(scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor,
                             ) -> torch.Tensor:
    """RLOO: ``r_i - mean_{j != i} r_j`` over the other samples of the group (0 for a lone sample).

    Kool et al., "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (2019); Ahmadian et al.,
    arXiv:2402.14740. Equal to ``n / (n - 1) * (r_i - mean)``.
    """
    scores = scores.float()
    mean, count = group_mean(scores, group_ids)
    others = (mean * count - scores) / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scores - others, torch.zeros_like(scores))
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)


def length_weighted_baseline_advantages(scores: torch.Tensor, group_ids: torch.Tensor,
                                        response_mask: torch.Tensor) -> torch.Tensor:
    """OPO: ``r_i - sum_j l_j r_j / sum_j l_j`` with ``l`` the response lengths in the group.

    Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv:2505.23585: for sequence
    rewards and a policy gradient whose per-sample norm grows with length, this length-weighted
    mean is the variance-minimising baseline. A lone sample, or a group of empty responses, gets 0.
    """
    scores = scores.float()
    lengths = response_mask.float().sum(-1)
    weighted, _ = group_mean(lengths * scores, group_ids)
    total, count = group_mean(lengths, group_ids)
    baseline = weighted / total.clamp(min=1e-8)
    adv = torch.where((count > 1) & (total > 0), scores - baseline, torch.zeros_like(scores))
    return adv.unsqueeze(-1) * response_mask.to(adv.dtype)


def group_mean_whitened_advantages(scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor,
                                   ) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over all tokens of the batch.

    Hu et al., arXiv:2501.03262: the group mean removes the prompt's difficulty, and the
    normalisation uses the whole batch's statistics instead of each group's (GRPO), which keeps
    the estimate from blowing up in low-variance groups. A lone sample's baseline is 0.
    """
    scores = scores.float()
    mean, count = group_mean(scores, group_ids)
    centred = torch.where(count > 1, scores - mean, scores)
    mask = response_mask.to(centred.dtype)
    return _whiten_or_zero(centred.unsqueeze(-1) * mask, mask)


def returns_to_go(token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0) -> torch.Tensor:
    """``G_t = sum_{s >= t} gamma^(s-t) r_s`` over the policy's tokens ``[B, R]``.

    Masked positions (tool outputs inside a response, padding) neither add reward nor discount:
    the running return carries over them, like GAE's recursion in verl-algorithms.
    """
    mask = response_mask.to(token_rewards.dtype)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = m * (token_rewards[:, t] + gamma * running) + (1 - m) * running
        out[:, t] = running * m
    return out


def baseline_advantages(token_rewards: torch.Tensor, baseline: torch.Tensor, response_mask: torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: returns-to-go minus a per-sample baseline ``[B]``; returns ``(advantages, returns)``."""
    mask = response_mask.to(token_rewards.dtype)
    returns = returns_to_go(token_rewards, response_mask)
    return (returns - baseline.float().unsqueeze(-1)) * mask, returns


def gpg_advantages(scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor, *,
                   norm_by_std: bool = False, eps: float = 1e-6, correct_for_invalid: bool = True,
                   ) -> torch.Tensor:
    """GPG: ``alpha * (r - mean_group) / F_norm`` broadcast over tokens.

    Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for Model Reasoning",
    arXiv:2504.02546. ``F_norm`` is 1 (default) or the group's standard deviation. Groups whose
    rewards are all equal have zero advantage and so shrink a batch-mean gradient; ``alpha =
    B / (B - M)``, with ``M`` the samples in such groups, rescales it back ("accurate gradient
    estimation"). Lone samples count as such groups.
    """
    scores = scores.float()
    mean, count = group_mean(scores, group_ids)
    centred = scores - mean
    if norm_by_std:
        var, _ = group_mean(centred.square(), group_ids)
        std = (var * count / (count - 1).clamp(min=1)).sqrt()
        centred = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    spread, _ = group_mean(centred.abs(), group_ids)
    informative = (count > 1) & (spread > 0)
    centred = torch.where(informative, centred, torch.zeros_like(centred))
    if correct_for_invalid and informative.any():
        centred = centred * (scores.numel() / informative.sum().float())
    return centred.unsqueeze(-1) * response_mask.to(centred.dtype)


def _whiten_or_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked whitening, but 0 (not NaN or a huge number) when the values do not vary."""
    var = masked_mean((x - masked_mean(x, mask)).square(), mask)
    if float(var) < 1e-12:
        return torch.zeros_like(x)
    return masked_whiten(x, mask) * mask


# ----------------------------------------------------------------------------- policy losses
def sequence_clip_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                       response_mask: torch.Tensor, *, clip_low: float, clip_high: float,
                       agg_mode: str = "seq-mean-token-mean", token_weights: torch.Tensor | None = None,
                       norm_length: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's clipped objective with the sequence-level, length-normalised importance ratio.

    Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071. The ratio of sequence
    ``i`` is ``s_i = exp(mean_t (log pi - log pi_old))``; every token uses it in the GSPO-token
    form ``sg[s_i] * pi(y_t) / sg[pi(y_t)]``, which has the value of ``s_i`` and the gradient of
    ``s_i`` spread over the tokens, so a whole sequence is clipped or kept together.
    """
    mask = response_mask.to(log_probs.dtype)
    # Garbage at masked positions must not reach the sequence ratio.
    diff = torch.where(mask > 0, log_probs - old_log_probs, torch.zeros_like(log_probs))
    seq_log_ratio = (diff * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_probs - log_probs.detach()
    ratio = torch.exp(token_log_ratio.clamp(max=10.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(loss1, loss2)
    if token_weights is not None:
        loss = loss * token_weights.detach()
    seq_valid = (mask.sum(-1) > 0).to(log_probs.dtype)
    stats = {
        "clip_frac": masked_mean((loss2 > loss1).float(), mask).detach(),
        "approx_kl": masked_mean(-diff, mask).detach(),
        "seq_ratio_mean": ((seq_log_ratio.exp() * seq_valid).sum() / seq_valid.sum().clamp(min=1.0)).detach(),
    }
    return agg_loss(loss, mask, agg_mode, norm_length=norm_length), stats


def clipped_is_weight_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                           response_mask: torch.Tensor, *, clip_low: float, clip_high: float,
                           agg_mode: str = "token-mean", token_weights: torch.Tensor | None = None,
                           norm_length: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: ``-sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * log pi(y_t)``.

    MiniMax, "MiniMax-M1", arXiv:2506.13585. PPO's clip zeroes the gradient of clipped tokens;
    clipping the (detached) importance weight instead keeps every token's gradient and only bounds
    its weight, which matters for rare tokens whose ratio moves fast.
    """
    mask = response_mask.to(log_probs.dtype)
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high).detach()
    loss = -weight * advantages * log_probs
    if token_weights is not None:
        loss = loss * token_weights.detach()
    stats = {
        "clip_frac": masked_mean((weight != ratio.detach()).float(), mask).detach(),
        "approx_kl": masked_mean(-log_ratio, mask).detach(),
        "is_weight_mean": masked_mean(weight, mask).detach(),
    }
    return agg_loss(loss, mask, agg_mode, norm_length=norm_length), stats


def token_covariance(log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each loss token's centred covariance term ``(log pi_t - mean log pi) (A_t - mean A)`` (means over
    the loss tokens, no gradient), ``-inf`` elsewhere.

    Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv:2505.22617: the policy's entropy falls by the covariance between a token's log-probability
    and its advantage, concentrated in a small fraction of tokens.
    """
    mask = response_mask > 0
    lp, adv = log_probs.detach().float(), advantages.detach().float()
    cov = (lp - masked_mean(lp, mask)) * (adv - masked_mean(adv, mask))
    return torch.where(mask, cov, torch.full_like(cov, float("-inf")))


def clip_cov_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                  response_mask: torch.Tensor, *, clip_low: float, clip_high: float, fraction: float,
                  cov_low: float, cov_high: float, clip_c: float = 0.0, agg_mode: str = "token-mean",
                  token_weights: torch.Tensor | None = None, norm_length: int | None = None,
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO-clip, except that ``fraction`` of the loss tokens, drawn at random among those
    whose :func:`token_covariance` lies in ``(cov_low, cov_high)`` and that PPO's clip left alone, add
    nothing (their loss term and gradient are 0; they still count in the denominator).

    Cui et al., arXiv:2505.22617, section 4 (the paper's ``r = 2e-4``, ``omega_low = 1``,
    ``omega_high = 5``). At least one token is drawn when any qualifies. The draw is seeded by the
    candidates' positions: the same batch draws the same tokens. ``clip_c`` > 1 adds PPO's dual clip for negative
    advantages, as in :func:`~verl_algorithms.functional.ppo_clip_loss`.
    """
    mask = response_mask.to(log_probs.dtype)
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = (loss2 > loss1) & (mask > 0)
    cov = token_covariance(log_probs, advantages, response_mask)
    candidates = torch.nonzero((cov > cov_low) & (cov < cov_high) & (mask > 0) & ~clipped)
    count = min(len(candidates), max(int(fraction * float(mask.sum())), 1))
    keep = torch.ones_like(mask)
    if count:
        # A draw seeded by where the candidates are: random over batches, the same for the same batch
        # (a rerun, a resumed run, a measurement repeated), and torch's global generator is left alone.
        seed = int((candidates[:, 0] * 1_000_003 + candidates[:, 1]).sum()) % (2**31)
        order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed))
        chosen = candidates[order[:count]]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    loss = torch.maximum(loss1, loss2)
    if clip_c > 0:
        loss = torch.where(advantages < 0, torch.minimum(-advantages * clip_c, loss), loss)
    loss = loss * keep
    if token_weights is not None:
        loss = loss * token_weights.detach()
    stats = {
        "clip_frac": masked_mean(clipped.float(), mask).detach(),
        "cov_detached_frac": masked_mean(1.0 - keep, mask).detach(),
        "approx_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return agg_loss(loss, mask, agg_mode, norm_length=norm_length), stats


def kl_cov_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, *, fraction: float, kl_coef: float, agg_mode: str = "token-mean",
                token_weights: torch.Tensor | None = None, norm_length: int | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: the unclipped surrogate ``-A_t r_t`` on every loss token, plus ``kl_coef * |log r_t|``
    on the ``fraction`` of loss tokens with the largest :func:`token_covariance` (at least one).

    Cui et al., arXiv:2505.22617, section 4 (the paper's ``k = 2e-4`` for 7B models, ``2e-3`` for
    32B, and ``beta = 1``): a KL penalty on exactly the tokens whose updates drive the entropy down.
    """
    mask = response_mask.to(log_probs.dtype)
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    loss = -advantages * torch.exp(log_ratio)
    cov = token_covariance(log_probs, advantages, response_mask).flatten()
    valid = int(mask.sum())
    penalised = torch.zeros_like(mask)
    if valid:
        top = torch.topk(cov, min(valid, max(int(fraction * valid), 1))).indices
        penalised.view(-1)[top] = 1.0
    loss = loss + kl_coef * log_ratio.abs() * penalised
    if token_weights is not None:
        loss = loss * token_weights.detach()
    stats = {
        "cov_penalised_frac": masked_mean(penalised, mask).detach(),
        "approx_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return agg_loss(loss, mask, agg_mode, norm_length=norm_length), stats


def vanilla_pg_loss(log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, *,
                    agg_mode: str = "token-mean", token_weights: torch.Tensor | None = None,
                    norm_length: int | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The plain policy gradient ``-A_t * log pi(y_t)``: no ratio, no clip (GPG, on-policy only).
    ``token_weights`` (detached) scale each token's loss, e.g. truncated importance weights.

    ``norm_length`` here and in the other losses is :func:`~verl_algorithms.functional.agg_loss`'s:
    the constant ``seq-mean-token-sum-norm`` divides by (pass the batch's ``info["max_new_tokens"]``,
    as verl-algorithms' PPO loss does; without it that mode raises, since the tensor's width changes with
    each micro-batch).
    """
    mask = response_mask.to(log_probs.dtype)
    loss = -advantages * log_probs
    if token_weights is not None:
        loss = loss * token_weights.detach()
    return agg_loss(loss, mask, agg_mode, norm_length=norm_length), {}


# ----------------------------------------------------------------------------- filters and shaping
def drop_equal_reward_groups(batch: Batch, *, scores: torch.Tensor | None = None) -> Batch:
    """Keep only groups whose rewards differ (DAPO's dynamic-sampling filter).

    A group where every sample got the same reward (all right or all wrong) has zero
    group-relative advantage and only dilutes the batch. Lone samples are dropped too.
    """
    values = (batch.scores if scores is None else scores).float()
    mean, count = group_mean(values, batch.group_ids)
    spread, _ = group_mean((values - mean).abs(), batch.group_ids)
    keep = torch.nonzero((count > 1) & (spread > 1e-8)).flatten()
    return batch.select(keep)


def overlong_penalty(lengths: torch.Tensor, *, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward of each response.

    0 up to ``max_length - buffer`` tokens, then falling linearly to ``-factor`` at
    ``max_length`` (and ``-factor`` beyond). Yu et al., arXiv:2503.14476, eq. 13.
    """
    if buffer <= 0 or buffer >= max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}), got {buffer}")
    expected = max_length - buffer
    over = (lengths.float() - expected).clamp(min=0.0)
    return -factor * (over / buffer).clamp(max=1.0)


# ----------------------------------------------------------------------------- preference losses
def sequence_log_probs(log_probs: torch.Tensor, response_mask: torch.Tensor, *, average: bool = False,
                       ) -> torch.Tensor:
    """``log pi(y|x)`` per sequence: the masked sum of token log-probs (or their mean)."""
    mask = response_mask.to(log_probs.dtype)
    total = (torch.where(mask > 0, log_probs, torch.zeros_like(log_probs)) * mask).sum(-1)
    return total / mask.sum(-1).clamp(min=1.0) if average else total


def preference_pairs(scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (chosen, rejected) index pair inside a group where the chosen scored higher.

    A preference dataset gives each pair its own group with scores 1 (chosen) and 0 (rejected);
    scored samples of one prompt give all their ordered pairs. Empty responses take no part.
    """
    valid = response_mask.sum(-1) > 0
    same = group_ids.unsqueeze(1) == group_ids.unsqueeze(0)
    better = scores.unsqueeze(1) > scores.unsqueeze(0)
    both = valid.unsqueeze(1) & valid.unsqueeze(0)
    chosen, rejected = torch.nonzero(same & better & both, as_tuple=True)
    return chosen, rejected


def dpo_loss(chosen_log_ratio: torch.Tensor, rejected_log_ratio: torch.Tensor, *, beta: float,
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO per pair: ``-log sigmoid(beta * (chosen_log_ratio - rejected_log_ratio))``.

    Rafailov et al., arXiv:2305.18290. The log-ratios are ``log pi(y|x) - log pi_ref(y|x)``.
    ``label_smoothing`` > 0 is the conservative DPO variant that assumes that fraction of the
    labels is flipped. Returns ``(losses, margins)``, both per pair, margins in reward units.
    """
    logits = beta * (chosen_log_ratio - rejected_log_ratio)
    losses = -(1 - label_smoothing) * torch_f.logsigmoid(logits) - label_smoothing * torch_f.logsigmoid(-logits)
    return losses, logits


def kto_loss(log_ratio: torch.Tensor, desirable: torch.Tensor, kl_reference: torch.Tensor, *, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """KTO per sample: ``w_D (1 - sigma(beta (r - z)))`` or ``w_U (1 - sigma(beta (z - r)))``.

    Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization",
    arXiv:2402.01306. ``r`` is the sample's log-ratio to the reference and ``z`` the (detached,
    non-negative) KL reference point estimated on mismatched prompt/completion pairs.
    """
    z = kl_reference.detach().clamp(min=0.0)
    good = desirable_weight * (1 - torch.sigmoid(beta * (log_ratio - z)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z - log_ratio)))
    return torch.where(desirable, good, bad)


def odds_ratio_loss(chosen_mean_log_prob: torch.Tensor, rejected_mean_log_prob: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """ORPO's odds-ratio term per pair: ``-log sigmoid(log odds(y_w) - log odds(y_l))``.

    Hong et al., "ORPO: Monolithic Preference Optimization without Reference Model",
    arXiv:2403.07691. ``odds(y) = p / (1 - p)`` with ``p`` the length-normalised likelihood
    ``exp(mean log pi)``. Returns ``(losses, log_odds_ratios)``.
    """
    def log_odds(mean_lp: torch.Tensor) -> torch.Tensor:
        # log(p / (1 - p)) = lp - log(1 - exp(lp)); expm1 keeps it accurate as p approaches 1.
        lp = mean_lp.clamp(max=-1e-6)
        return lp - torch.log(-torch.expm1(lp))

    ratio = log_odds(chosen_mean_log_prob) - log_odds(rejected_mean_log_prob)
    return -torch_f.logsigmoid(ratio), ratio
