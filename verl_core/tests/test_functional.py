"""Advantage and loss math of the built-in algorithms against hand-computed values."""

import math

import pytest
import torch

from verl_core.algorithms import functional as F
from verl_core.algorithms.grpo import GRPO, GRPOConfig
from verl_core.algorithms.ppo import PPO, PPOConfig
from verl_core.batch import Batch


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
    assert F.agg_loss(loss, mask, mode).item() == pytest.approx(expected)


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])
    d = math.log(2)
    assert F.kl_penalty(lp, ref, "k1").item() == pytest.approx(d)
    assert F.kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert F.kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 + d - 1)


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
