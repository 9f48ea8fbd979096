"""Truncated importance sampling between rollout-engine and trainer log-probs (``rollout_is_cap``)."""

from __future__ import annotations

import math

import pytest
import torch

from verl_core.testing import make_batch

from verl_algorithms import functional as F
from verl_algorithms.grpo import GRPOConfig


def test_weights_are_the_truncated_ratio_by_hand() -> None:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.4, 0.1]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    weights, stats = F.truncated_is_weights(old, rollout, mask, cap=1.5)
    # ratios 2, 1, 0.5, 9 -> capped at 1.5; the last token is masked out of the stats.
    assert torch.allclose(weights, torch.tensor([[1.5, 1.0, 0.5, 1.5]]))
    assert stats["ppo/rollout_is_weight_mean"] == pytest.approx(1.0)
    assert stats["ppo/rollout_is_clip_frac"] == pytest.approx(1 / 3)


def test_policy_loss_weights_each_token() -> None:
    batch = make_batch(advantages=True, tool_tokens=False)
    log_probs = batch.old_log_probs + 0.05
    plain, _ = F.ppo_policy_loss(GRPOConfig(), batch=batch, log_probs=log_probs, entropy=None)
    config = GRPOConfig(rollout_is_cap=2.0)
    weighted, metrics = F.ppo_policy_loss(config, batch=batch, log_probs=log_probs, entropy=None)
    weights, _ = F.truncated_is_weights(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask, cap=2.0)
    ratio = torch.exp(log_probs - batch.old_log_probs)
    per_token = torch.maximum(-batch.advantages * ratio, -batch.advantages * ratio.clamp(0.8, 1.2)) * weights
    expected = F.masked_mean(per_token, batch.response_mask)
    assert float(weighted) == pytest.approx(float(expected), rel=1e-6)
    assert not math.isclose(float(weighted), float(plain))
    assert "ppo/rollout_is_weight_mean" in metrics


def test_policy_loss_without_rollout_log_probs_says_so() -> None:
    batch = make_batch(advantages=True).replace(rollout_log_probs=None)
    with pytest.raises(ValueError, match="rollout_is_cap needs the rollout engine's log-probs"):
        F.ppo_policy_loss(GRPOConfig(rollout_is_cap=2.0), batch=batch, log_probs=batch.old_log_probs, entropy=None)


def test_config_refuses_a_correction_that_cannot_act() -> None:
    from verl_core.config import ConfigError, resolve_config
    from verl_core.registry import PluginRegistry

    with pytest.raises(ConfigError, match=r"algorithm\.rollout_is_cap"):
        resolve_config({"algorithm": {"rollout_is_cap": 2.0, "use_rollout_log_probs": True}}, PluginRegistry())
    with pytest.raises(ConfigError, match=r"algorithm\.rollout_is_cap"):
        resolve_config({"algorithm": {"rollout_is_cap": -1.0}}, PluginRegistry())
