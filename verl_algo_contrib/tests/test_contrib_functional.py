"""The reusable pieces in verl_algo_contrib.functional against small hand-computed cases."""

import math

import pytest
import torch

from verl_algo_contrib import functional as CF
from verl_core.testing import make_batch


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


ONES = torch.ones(4, 1)


def test_group_mean_and_sizes():
    mean, count = CF.group_mean(t(1, 3, 10, 5), torch.tensor([7, 7, 2, 7]))
    assert mean.tolist() == pytest.approx([3.0, 3.0, 10.0, 3.0])
    assert count.tolist() == [3, 3, 1, 3]


def test_leave_one_out():
    # Group [1, 0, 0]: baselines (0+0)/2 = 0 and (1+0)/2 = 0.5. A lone sample gets 0.
    adv = CF.leave_one_out_advantages(t(1, 0, 0, 0.7), torch.tensor([0, 0, 0, 1]), ONES)
    assert adv.flatten().tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0])


def test_length_weighted_baseline():
    # Lengths 2 and 4, rewards 1 and 0: baseline (2*1 + 4*0) / 6 = 1/3.
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    adv = CF.length_weighted_baseline_advantages(t(1, 0), torch.tensor([0, 0]), mask)
    assert adv[0].tolist() == pytest.approx([2 / 3, 2 / 3, 0, 0])
    assert adv[1].tolist() == pytest.approx([-1 / 3] * 4)


def test_group_mean_whitened():
    # Centred [0.5, -0.5, 0, 0]; mean 0, variance 0.125 over the batch: +-0.5 / sqrt(0.125) = +-sqrt(2).
    adv = CF.group_mean_whitened_advantages(t(1, 0, 1, 1), torch.tensor([0, 0, 1, 1]), ONES)
    assert adv.flatten().tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0, 0], abs=1e-4)
    # Nothing varies: zeros, not NaN.
    assert CF.group_mean_whitened_advantages(t(1, 1), torch.tensor([0, 0]), torch.ones(2, 1)).abs().sum() == 0


def test_returns_to_go_skips_masked_tokens():
    rewards = t(0, 1, 2).unsqueeze(0)
    assert CF.returns_to_go(rewards, torch.ones(1, 3), gamma=0.5).tolist() == [[1.0, 2.0, 2.0]]
    # A tool token in the middle neither adds reward nor discounts; its return is 0.
    assert CF.returns_to_go(t(0, 5, 2).unsqueeze(0), torch.tensor([[1, 0, 1]]), gamma=0.5).tolist() == [[1.0, 0.0, 2.0]]


def test_baseline_advantages():
    adv, returns = CF.baseline_advantages(t(0, 0, 1).unsqueeze(0), t(0.25), torch.tensor([[1, 1, 1]]))
    assert returns.tolist() == [[1.0, 1.0, 1.0]]
    assert adv.tolist() == [[0.75, 0.75, 0.75]]


def test_gpg_alpha_rescales_for_uninformative_groups():
    # Group 0: centred +-0.5; group 1 all equal (M = 2 of B = 4): alpha = 4 / 2 = 2.
    adv = CF.gpg_advantages(t(1, 0, 1, 1), torch.tensor([0, 0, 1, 1]), ONES)
    assert adv.flatten().tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])
    plain = CF.gpg_advantages(t(1, 0, 1, 1), torch.tensor([0, 0, 1, 1]), ONES, correct_for_invalid=False)
    assert plain.flatten().tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    # F_norm = std: the group's sample std is sqrt(0.5), so +-0.5 / 0.7071 = +-0.7071, times alpha 2.
    std = CF.gpg_advantages(t(1, 0, 1, 1), torch.tensor([0, 0, 1, 1]), ONES, norm_by_std=True)
    assert std.flatten().tolist() == pytest.approx([math.sqrt(2), -math.sqrt(2), 0.0, 0.0], abs=1e-4)


def test_sequence_clip_loss_value_and_gradient():
    old = torch.zeros(1, 2)
    lp = t(0.1, 0.3).unsqueeze(0).requires_grad_(True)
    # Sequence ratio exp(mean(0.1, 0.3)) = exp(0.2) = 1.2214 > 1.2: clipped for A > 0 (no gradient) ...
    loss, stats = CF.sequence_clip_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    assert float(loss.detach()) == pytest.approx(-1.2)
    loss.backward()
    assert lp.grad.abs().sum() == 0
    assert float(stats["seq_ratio_mean"]) == pytest.approx(math.exp(0.2))
    # ... but not for A < 0: loss = s, and each of the 2 tokens gets d/dlp (s * lp - sg) / 2 = s / 2.
    lp.grad = None
    loss, _ = CF.sequence_clip_loss(lp, old, -torch.ones(1, 2), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    assert float(loss) == pytest.approx(math.exp(0.2))
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([math.exp(0.2) / 2] * 2)


def test_clipped_is_weight_loss_keeps_the_gradient_of_clipped_tokens():
    lp = torch.full((1, 1), -1.0, requires_grad=True)
    old = torch.full((1, 1), -1.5)  # ratio exp(0.5) = 1.6487, weight clipped to 1.2
    loss, stats = CF.clipped_is_weight_loss(lp, old, torch.full((1, 1), 2.0), torch.ones(1, 1), clip_low=0.2,
                                            clip_high=0.2)
    assert float(loss) == pytest.approx(-1.2 * 2.0 * -1.0)
    loss.backward()
    assert lp.grad.item() == pytest.approx(-2.4)  # PPO would give 0 here
    assert float(stats["clip_frac"]) == 1.0


def test_vanilla_pg_loss():
    lp = t(-1, -2).unsqueeze(0).requires_grad_(True)
    loss, _ = CF.vanilla_pg_loss(lp, t(1, 1).unsqueeze(0), torch.tensor([[1, 1]]))
    assert float(loss) == pytest.approx(1.5)
    loss.backward()
    assert lp.grad.tolist() == [[-0.5, -0.5]]


def test_drop_equal_reward_groups():
    batch = make_batch(batch_size=5, group_size=1, scores=[1, 1, 0, 1, 1])
    batch = batch.replace(group_ids=torch.tensor([0, 0, 1, 1, 2]))
    kept = CF.drop_equal_reward_groups(batch)
    assert kept.group_ids.tolist() == [1, 1] and kept.scores.tolist() == [0.0, 1.0]


def test_overlong_penalty():
    # Budget 10, buffer 4: no penalty up to 6 tokens, then -1/4 per token, -1 at and beyond 10.
    out = CF.overlong_penalty(t(5, 6, 8, 10, 12), max_length=10, buffer=4, factor=1.0)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    assert CF.overlong_penalty(t(8), max_length=10, buffer=4, factor=0.5).tolist() == [-0.25]
    with pytest.raises(ValueError, match="buffer"):
        CF.overlong_penalty(t(1), max_length=4, buffer=4)


def test_preference_pairs_and_sequence_log_probs():
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])
    chosen, rejected = CF.preference_pairs(t(1, 0, 0, 1), torch.tensor([0, 0, 1, 1]), mask)
    # Pair (3, 2) is skipped: row 3's response is empty.
    assert list(zip(chosen.tolist(), rejected.tolist())) == [(0, 1)]
    lp = t(-1, -2, -3, -5, -1, -1, -9, -9).view(4, 2)
    assert CF.sequence_log_probs(lp, mask).tolist() == [-3.0, -3.0, -2.0, 0.0]
    assert CF.sequence_log_probs(lp, mask, average=True).tolist() == [-1.5, -3.0, -1.0, 0.0]


def test_dpo_kto_and_odds_ratio_losses():
    losses, margins = CF.dpo_loss(t(1.0), t(-1.0), beta=0.5)
    assert margins.item() == pytest.approx(1.0)
    assert losses.item() == pytest.approx(math.log(1 + math.exp(-1)))
    smoothed, _ = CF.dpo_loss(t(1.0), t(-1.0), beta=0.5, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * math.log(1 + math.exp(-1)) + 0.1 * math.log(1 + math.exp(1)))

    kto = CF.kto_loss(t(2.0, 2.0), torch.tensor([True, False]), t(1.0), beta=1.0, undesirable_weight=2.0)
    sig1 = 1 / (1 + math.exp(-1))
    assert kto.tolist() == pytest.approx([1 - sig1, 2 * (1 - (1 - sig1))])
    # The reference point is clamped at 0 and never differentiated.
    z = torch.tensor(-3.0, requires_grad=True)
    ratio = t(0.0).requires_grad_(True)
    out = CF.kto_loss(ratio, torch.tensor([True]), z, beta=1.0)
    assert out.item() == pytest.approx(0.5)  # 1 - sigmoid(0 - max(z, 0))
    out.sum().backward()
    assert ratio.grad is not None and z.grad is None

    # p_w = 0.5 (odds 1), p_l = 0.2 (odds 0.25): log odds ratio log 4, loss log(1 + 1/4).
    loss, ratio = CF.odds_ratio_loss(t(math.log(0.5)), t(math.log(0.2)))
    assert ratio.item() == pytest.approx(math.log(4.0))
    assert loss.item() == pytest.approx(math.log(1.25))
    assert torch.isfinite(CF.odds_ratio_loss(t(0.0), t(0.0))[0]).all()  # p = 1 stays finite


def test_sequence_rewards_include_kl_shaped_token_rewards():
    batch = make_batch(batch_size=2, group_size=2, scores=[1.0, 0.0], tool_tokens=False)
    assert CF.sequence_rewards(batch).tolist() == [1.0, 0.0]
    shaped = batch.replace(token_rewards=batch.token_rewards - 0.1 * batch.response_mask)
    lengths = batch.response_mask.sum(-1).float()
    assert CF.sequence_rewards(shaped).tolist() == pytest.approx((torch.tensor([1.0, 0.0]) - 0.1 * lengths).tolist())


# ----------------------------------------------------------------------------- Clip-Cov and KL-Cov
# One sequence of three loss tokens and a masked fourth (Cui et al., arXiv:2505.22617, section 4).
COV_LP = [[-1.0, -2.0, -0.5, -3.0]]
COV_OLD = [[-1.2, -1.5, -0.5, -3.0]]
COV_ADV = [[1.0, -1.0, 2.0, 5.0]]
COV_MASK = torch.tensor([[1, 1, 1, 0]])


def _cov_by_hand():
    """cov_t = (log pi_t - mean log pi)(A_t - mean A) over the three loss tokens."""
    lp, adv = COV_LP[0][:3], COV_ADV[0][:3]
    mlp, madv = sum(lp) / 3, sum(adv) / 3
    return [(a - mlp) * (b - madv) for a, b in zip(lp, adv)]  # ~[0.056, 1.389, 0.889]


def test_token_covariance_by_hand():
    cov = CF.token_covariance(torch.tensor(COV_LP), torch.tensor(COV_ADV), COV_MASK)
    assert cov[0, :3].tolist() == pytest.approx(_cov_by_hand())
    assert cov[0, 3].item() == float("-inf")


def test_kl_cov_penalises_the_top_covariance_token_by_hand():
    lp = torch.tensor(COV_LP, requires_grad=True)
    loss, stats = CF.kl_cov_loss(lp, torch.tensor(COV_OLD), torch.tensor(COV_ADV), COV_MASK, fraction=0.34,
                                 kl_coef=1.0)
    cov = _cov_by_hand()
    top = max(range(3), key=cov.__getitem__)
    assert top == 1
    # Unclipped surrogate -A exp(lp - old) on every token, + beta |lp - old| on the top one.
    terms = [-a * math.exp(p - o) for p, o, a in zip(COV_LP[0][:3], COV_OLD[0][:3], COV_ADV[0][:3])]
    terms[top] += 1.0 * abs(COV_LP[0][top] - COV_OLD[0][top])
    assert loss.item() == pytest.approx(sum(terms) / 3)
    assert stats["cov_penalised_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dlp of -A e^(lp-old) + |lp - old| at the top token (lp < old: the |.| slope is -1).
    assert lp.grad[0, top].item() == pytest.approx((1.0 * math.exp(-0.5) - 1.0) / 3)


def test_clip_cov_stops_the_gradient_of_a_covariance_token_the_clip_left_alone():
    lp = torch.tensor(COV_LP, requires_grad=True)
    # Wide clip range: token 1's ratio exp(-0.5) = 0.61 is inside [0.5, 1.5], and only its covariance
    # (1.39) lies in (1, 5).
    loss, stats = CF.clip_cov_loss(lp, torch.tensor(COV_OLD), torch.tensor(COV_ADV), COV_MASK, clip_low=0.5,
                                   clip_high=0.5, fraction=0.34, cov_low=1.0, cov_high=5.0)
    kept = [-a * math.exp(p - o) for p, o, a in zip(COV_LP[0][:3], COV_OLD[0][:3], COV_ADV[0][:3])]
    kept[1] = 0.0
    assert loss.item() == pytest.approx(sum(kept) / 3)  # still divided by all three loss tokens
    assert stats["cov_detached_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert lp.grad[0, 1].item() == 0.0 and lp.grad[0, 0].item() != 0.0


def test_clip_cov_leaves_tokens_the_clip_already_cut():
    # The default clip [0.8, 1.2] cuts token 1 (ratio 0.61 with A < 0): PPO gives it no gradient
    # already, so Clip-Cov draws no token and the loss is PPO-clip's.
    old, adv = torch.tensor(COV_OLD), torch.tensor(COV_ADV)
    loss, stats = CF.clip_cov_loss(torch.tensor(COV_LP), old, adv, COV_MASK, clip_low=0.2, clip_high=0.2,
                                   fraction=0.34, cov_low=1.0, cov_high=5.0)
    ratios = [math.exp(p - o) for p, o in zip(COV_LP[0][:3], COV_OLD[0][:3])]
    ppo = [max(-a * r, -a * min(max(r, 0.8), 1.2)) for r, a in zip(ratios, COV_ADV[0][:3])]
    assert loss.item() == pytest.approx(sum(ppo) / 3)
    assert stats["cov_detached_frac"].item() == 0.0
