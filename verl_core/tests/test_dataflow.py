"""Ordering of dataflow nodes from their declared reads and writes."""

import pytest
import torch

from verl_core.algorithms.grpo import GRPO, GRPOConfig
from verl_core.algorithms.ppo import PPO, PPOConfig
from verl_core.dataflow import Dataflow, DataflowBuilder, DataflowError, Node


def names(flow: Dataflow) -> list[list[str]]:
    return [[n.name for n in level] for level in flow.levels]


def noop(ctx):
    return None


def test_independent_nodes_share_a_level():
    flow = Dataflow([
        Node("gen", noop, writes=("batch",)),
        Node("ref", noop, reads=("response_ids",), writes=("ref_log_probs",)),
        Node("values", noop, reads=("response_ids",), writes=("values",)),
        Node("adv", noop, reads=("ref_log_probs", "values"), writes=("advantages",)),
    ])
    assert names(flow) == [["gen"], ["ref", "values"], ["adv"]]


def test_reader_declared_before_writer_still_waits():
    flow = Dataflow([
        Node("gen", noop, writes=("batch",)),
        Node("adv", noop, reads=("values",), writes=("advantages",)),
        Node("values", noop, writes=("values",)),
    ])
    assert names(flow) == [["gen"], ["values"], ["adv"]]


def test_read_modify_write_keeps_declared_order():
    flow = Dataflow([
        Node("gen", noop, writes=("batch",)),
        Node("reward", noop, writes=("token_rewards",)),
        Node("kl", noop, reads=("token_rewards",), writes=("token_rewards",)),
        Node("adv", noop, reads=("token_rewards",), writes=("advantages",)),
    ])
    assert names(flow) == [["gen"], ["reward"], ["kl"], ["adv"]]


def test_batch_writer_is_a_barrier():
    flow = Dataflow([
        Node("gen", noop, writes=("batch",)),
        Node("reward", noop, writes=("scores",)),
        Node("filter", noop, reads=("scores",), writes=("batch",)),
        Node("lp", noop, writes=("old_log_probs",)),
    ])
    assert names(flow) == [["gen"], ["reward"], ["filter"], ["lp"]]


def test_missing_producer_is_an_error():
    with pytest.raises(DataflowError, match="reads 'values' but no node writes it"):
        Dataflow([Node("adv", noop, reads=("values",))])


def test_duplicate_and_unknown_after():
    with pytest.raises(DataflowError, match="duplicate"):
        Dataflow([Node("a", noop), Node("a", noop)])
    with pytest.raises(DataflowError, match="unknown node 'zz'"):
        Dataflow([Node("a", noop, after=("zz",))])


def test_undeclared_write_is_refused():
    from verl_core.dataflow import StepContext

    flow = Dataflow([Node("bad", lambda ctx: {"values": 1})])
    ctx = StepContext(step=1, prompts=[], algorithm=None, actor=None, rollout=None, reward=None, sampling=None)
    with pytest.raises(DataflowError, match="without declaring"):
        flow.run(ctx)


def test_run_parallel_gets_independent_nodes():
    seen = []

    def run_parallel(tasks):
        seen.append(len(tasks))
        return [t() for t in tasks]

    from verl_core.dataflow import StepContext

    flow = Dataflow([Node("a", noop, writes=("x",)), Node("b", noop, writes=("y",)),
                     Node("c", noop, reads=("x", "y"))])
    ctx = StepContext(step=1, prompts=[], algorithm=None, actor=None, rollout=None, reward=None, sampling=None)
    flow.run(ctx, run_parallel=run_parallel)
    assert seen == [2]
    assert set(ctx.metrics) == {"timing/a", "timing/b", "timing/c"}


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
