"""GRPO's and PPO's dataflows: the nodes they declare, in the order their reads and writes give."""

import torch

from verl_core.dataflow import Dataflow, DataflowBuilder

from verl_algorithms.grpo import GRPO, GRPOConfig
from verl_algorithms.ppo import PPO, PPOConfig


def names(flow: Dataflow) -> list[list[str]]:
    return [[n.name for n in level] for level in flow.levels]


def test_grpo_and_ppo_declarations():
    df = DataflowBuilder()
    GRPO(GRPOConfig(kl_coef=0.1)).build_dataflow(df)
    grpo = names(df.build())
    # One rollout stage first; the trainer, not the algorithm, syncs weights after the update.
    assert grpo[0] == ["rollout"] and grpo[-1] == ["update_actor"]
    assert "sync_weights" not in {n for level in grpo for n in level}
    # Independent nodes land on one level and may run together.
    assert any({"old_log_probs", "ref_log_probs"} <= set(level) for level in grpo)
    df = DataflowBuilder()
    PPO(PPOConfig()).build_dataflow(df)
    ppo = names(df.build())
    assert any({"old_log_probs", "ref_log_probs", "values"} <= set(level) for level in ppo)
    flat = [n for level in ppo for n in level]
    assert flat.index("kl_reward") < flat.index("advantages") < flat.index("update_critic")
    assert flat.index("advantages") < flat.index("update_actor")


def test_grpo_kl_in_reward_reaches_the_advantages():
    """GRPO with kl_in_reward used to load the reference, log actor/ref_kl and apply no KL at all."""
    from verl_core.testing import make_batch

    df = DataflowBuilder()
    algo = GRPO(GRPOConfig(kl_coef=0.5, kl_in_reward=True, kl_estimator="k1"))
    algo.build_dataflow(df)
    flat = [n for level in names(df.build()) for n in level]
    assert flat.index("ref_log_probs") < flat.index("kl_reward") < flat.index("advantages")
    batch = make_batch(batch_size=8, group_size=4, ref_log_probs=True, tool_tokens=False)
    plain, _ = algo.compute_advantages(batch)
    # One sample's policy drifts from the reference: its KL-shaped reward, and so its advantage, drops.
    kl = torch.zeros_like(batch.old_log_probs)
    kl[0] = 1.0
    shaped = batch.replace(token_rewards=batch.token_rewards - 0.5 * kl * batch.response_mask)
    adv, _ = algo.compute_advantages(shaped)
    assert adv[0, 0] < plain[0, 0]
    # The loss then carries no second KL term.
    lp = batch.old_log_probs.clone().requires_grad_(True)
    _, metrics = algo.policy_loss(batch=shaped.replace(advantages=adv), log_probs=lp)
    assert "ppo/kl_loss" not in metrics
