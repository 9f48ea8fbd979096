"""Advantage and loss math of GRPO and PPO (verl_algorithms.functional) against hand-computed values."""

import math

import pytest
import torch

from verl_core.batch import Batch
from verl_core.testing import make_batch

from verl_algorithms import functional as F
from verl_algorithms.base import PPOFamilyConfig
from verl_algorithms.grpo import GRPO, GRPOConfig
from verl_algorithms.ppo import PPO, PPOConfig


def test_grpo_advantages_by_hand():
    # Group 0: rewards 1, 0 -> mean 0.5, std (unbiased) 0.7071 -> +-0.7071.
    # Group 1: rewards 1, 1 -> all equal -> 0.
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]])
    adv = F.group_normalized_advantages(scores, groups, mask, eps=0.0)
    s = 1 / math.sqrt(0.5)
    expected = torch.tensor([[0.5 * s, 0.5 * s, 0], [-0.5 * s, 0, 0], [0, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(adv, expected)


def test_grpo_without_std_is_centred_reward():
    adv = F.group_normalized_advantages(torch.tensor([3.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 1),
                                        norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[1.0], [-1.0]]))


def test_single_sample_group_has_zero_advantage():
    adv = F.group_normalized_advantages(torch.tensor([5.0]), torch.tensor([0]), torch.ones(1, 2))
    assert adv.abs().sum() == 0


def test_gae_by_hand():
    # gamma=1, lam=1: advantage_t = sum of future rewards - V_t; returns = sum of future rewards.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.1]])
    mask = torch.ones(1, 3)
    adv, ret = F.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.8, 0.9]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_discounting_by_hand():
    rewards = torch.tensor([[0.0, 1.0]])
    values = torch.tensor([[0.0, 0.0]])
    adv, _ = F.gae_advantages(rewards, values, torch.ones(1, 2), gamma=0.5, lam=0.5, whiten=False)
    # t=1: delta=1; t=0: delta = 0 + 0.5*0 - 0 = 0, gae = 0 + 0.25*1
    torch.testing.assert_close(adv, torch.tensor([[0.25, 1.0]]))


def test_gae_skips_masked_tool_tokens():
    # A masked token in the middle must neither add reward nor break the chain.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.0, 9.0, 0.0]])
    adv, _ = F.gae_advantages(rewards, values, torch.tensor([[1.0, 0.0, 1.0]]), gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 0.0, 1.0]]))


def test_ppo_clip_loss_by_hand():
    lp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5 against old log-prob 0
    old = torch.zeros(1, 2)
    adv = torch.tensor([[1.0, -1.0]])
    loss, stats = F.ppo_clip_loss(lp, old, adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    # token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert stats["clip_frac"].item() == pytest.approx(1.0)


def test_ppo_clip_higher_is_asymmetric():
    lp = torch.log(torch.tensor([[1.25]]))
    loss_sym, _ = F.ppo_clip_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2,
                                  clip_high=0.2)
    loss_high, _ = F.ppo_clip_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2,
                                   clip_high=0.28)
    assert loss_sym.item() == pytest.approx(-1.2)
    assert loss_high.item() == pytest.approx(-1.25)


def test_dual_clip_bounds_negative_advantage_loss():
    lp = torch.log(torch.tensor([[10.0]]))
    loss, _ = F.ppo_clip_loss(lp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2,
                              clip_high=0.2, clip_c=3.0)
    assert loss.item() == pytest.approx(3.0)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (1 + 2 + 3) / 3),
    ("seq-mean-token-sum", ((1 + 2) + 3) / 2),
    ("seq-mean-token-mean", ((1 + 2) / 2 + 3) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2) / 4 + 3 / 4) / 2),
])
def test_loss_aggregation_modes(mode, expected):
    loss = torch.tensor([[1.0, 2.0, 7.0, 7.0], [3.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    assert F.agg_loss(loss, mask, mode, norm_length=4).item() == pytest.approx(expected)


def test_the_constant_length_mode_refuses_to_divide_by_the_width():
    # A backend trims each micro-batch's padding, so the width would change the gradient with the cut (issue #30's bug).
    with pytest.raises(ValueError, match="max_new_tokens"):
        F.agg_loss(torch.ones(2, 4), torch.ones(2, 4), "seq-mean-token-sum-norm")


def test_kl_estimators_by_hand():
    # Policy p = 1 on the sampled token, reference q = 0.5: r = log p - log q = log 2 (Schulman 2020).
    lp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])
    d = math.log(2)
    for names, expected in ((("k1", "kl"), d), (("abs",), d), (("k2", "mse"), 0.5 * d * d),
                            (("k3", "low_var_kl"), 0.5 + d - 1)):  # q/p - log(q/p) - 1
        for name in names:
            assert F.kl_penalty(lp, ref, name).item() == pytest.approx(expected), name
    # abs differs from k1 where the policy is less likely than the reference.
    assert F.kl_penalty(ref, lp, "abs").item() == pytest.approx(d)
    assert F.kl_penalty(ref, lp, "k1").item() == pytest.approx(-d)


def test_k3_is_verls_clamped_estimator_and_finite_on_minus_inf():
    """verl's k3 is low_var_kl: the log-ratio clamped to [-20, 20], the estimate to [-10, 10]."""
    lp = torch.tensor([float("-inf"), 0.0, -50.0, 0.0, -1.0])
    ref = torch.tensor([-1.0, float("-inf"), 0.0, -50.0, -1.5])
    for name in ("k3", "low_var_kl", "k3+"):
        out = F.kl_penalty(lp, ref, name)
        assert torch.isfinite(out).all(), (name, out)
        # q/p = exp(20) at most: exp(20) - 20 - 1 is past the clamp, so 10.
        assert out[0].item() == 10.0 and out[2].item() == 10.0
        # q/p = exp(-20) at least: exp(-20) + 20 - 1 = 19, clamped to 10 as well.
        assert out[1].item() == 10.0 and out[3].item() == 10.0
        assert out[4].item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def test_straight_through_estimators_have_the_value_of_theirs_and_the_gradient_of_k2():
    ref = torch.tensor([-1.0, -2.0, -0.3])
    for name, base in (("k1+", "k1"), ("k3+", "k3")):
        lp = torch.tensor([-0.5, -2.5, -0.1], requires_grad=True)
        value = F.kl_penalty(lp, ref, name)
        torch.testing.assert_close(value.detach(), F.kl_penalty(lp.detach(), ref, base))
        value.sum().backward()
        # d/dlp of (lp - ref)^2 / 2 is lp - ref.
        torch.testing.assert_close(lp.grad, (lp - ref).detach())


def test_unknown_kl_estimator_lists_the_names():
    with pytest.raises(ValueError, match="low_var_kl"):
        F.kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    with pytest.raises(ValueError, match="kl_estimator"):
        GRPOConfig(kl_estimator="k2+").validate()


@pytest.mark.parametrize("mode,expected", [("token-mean", 3.0), ("seq-mean-token-sum", 2.0),
                                           ("seq-mean-token-mean", 2.0), ("seq-mean-token-sum-norm", 2.0)])
def test_loss_units_are_what_each_mode_divides_by(mode, expected):
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert F.agg_units(mask, mode) == expected


def test_scores_land_on_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    out = F.scores_to_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]))


def test_grpo_loss_has_kl_term_when_enabled():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    batch = Batch(prompt_ids=torch.ones(4, 3, dtype=torch.long), prompt_mask=torch.ones(4, 3, dtype=torch.long),
                  response_ids=torch.ones(4, 4, dtype=torch.long), response_attention_mask=mask, response_mask=mask,
                  group_ids=torch.tensor([0, 0, 1, 1]), scores=torch.tensor([1.0, 0.0, 0.0, 1.0]),
                  old_log_probs=-torch.rand(4, 4, generator=g))
    algo = GRPO(GRPOConfig(kl_coef=0.5, kl_estimator="k1"))
    adv, _ = algo.compute_advantages(batch)
    batch = batch.replace(advantages=adv, old_log_probs=batch.old_log_probs, ref_log_probs=batch.old_log_probs - 1)
    loss_kl, metrics = algo.policy_loss(batch=batch, log_probs=batch.old_log_probs)
    loss_plain, _ = GRPO(GRPOConfig()).policy_loss(batch=batch, log_probs=batch.old_log_probs)
    # On-policy the clip loss is -mean(adv); k1 KL is exactly 1 on every valid token.
    assert metrics["ppo/kl_loss"] == pytest.approx(1.0)
    assert loss_kl.item() == pytest.approx(loss_plain.item() + 0.5)


def test_ppo_requires_critic_and_grpo_does_not():
    assert PPO(PPOConfig()).requirements().critic
    assert not GRPO(GRPOConfig()).requirements().critic
    assert GRPO(GRPOConfig(kl_coef=0.1)).requirements().reference
    assert not GRPO(GRPOConfig()).requirements().reference


def test_group_std_conventions_by_hand():
    # Group [1, 0, 0, 0]: mean 1/4; squared deviations sum to 9/16 + 3/16 = 3/4.
    scores, groups, mask = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), torch.ones(4, 1)
    bessel = F.group_normalized_advantages(scores, groups, mask, eps=0.0)
    population = F.group_normalized_advantages(scores, groups, mask, eps=0.0, unbiased_std=False)
    assert bessel[0, 0].item() == pytest.approx(0.75 / math.sqrt(0.75 / 3))
    assert population[0, 0].item() == pytest.approx(0.75 / math.sqrt(0.75 / 4))
    cfg = GRPOConfig(group_std="population")
    cfg.validate()
    batch = Batch(prompt_ids=torch.ones(4, 2, dtype=torch.long), prompt_mask=torch.ones(4, 2, dtype=torch.long),
                  response_ids=torch.ones(4, 1, dtype=torch.long), response_attention_mask=torch.ones(4, 1),
                  response_mask=torch.ones(4, 1), group_ids=groups, scores=scores)
    torch.testing.assert_close(GRPO(cfg).compute_advantages(batch)[0], population, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="group_std"):
        GRPOConfig(group_std="n-1").validate()



def test_seq_mean_token_sum_norm_divides_by_the_recorded_budget():
    batch = make_batch(batch_size=2, group_size=2, response_length=4, tool_tokens=False, advantages=True)
    cfg = GRPOConfig(loss_agg_mode="seq-mean-token-sum-norm")
    lp = batch.old_log_probs.clone()  # ratio 1: the loss is -sum(A) per sequence / length, mean over sequences
    with pytest.raises(ValueError, match="records none"):
        F.ppo_policy_loss(cfg, batch=batch.replace(info={}), log_probs=lp, entropy=None)
    budget, _ = F.ppo_policy_loss(cfg, batch=batch.replace(info={**batch.info, "max_new_tokens": 16}), log_probs=lp,
                                  entropy=None)
    per_seq = -(batch.advantages * batch.response_mask).sum(-1)
    torch.testing.assert_close(budget, per_seq.sum() / 16 / 2)


def test_policy_regularizers_add_kl_and_entropy_terms():
    batch = make_batch(batch_size=2, group_size=2, response_length=3, tool_tokens=False, ref_log_probs=True)
    lp = batch.old_log_probs.clone()
    ent = torch.full(lp.shape, 2.0)
    none, metrics = F.policy_regularizers(PPOFamilyConfig(), batch=batch, log_probs=lp, entropy=ent)
    assert float(none) == 0.0 and metrics["ppo/entropy"] == pytest.approx(2.0)
    cfg = PPOFamilyConfig(kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    term, metrics = F.policy_regularizers(cfg, batch=batch, log_probs=lp, entropy=ent)
    kl = F.masked_mean(lp - batch.ref_log_probs, batch.response_mask)
    torch.testing.assert_close(term, 0.5 * kl - 0.1 * 2.0)
    assert metrics["ppo/kl_loss"] == pytest.approx(float(kl))
