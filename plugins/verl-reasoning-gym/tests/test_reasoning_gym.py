"""The real reasoning-gym package: rows of a task, its verifier as the reward, routing by data_source."""

import pytest

from verl_core.registry import PluginRegistry

from verl_reasoning_gym.tasks import DATA_SOURCE, ReasoningGymReward, task_rows


def test_rows_are_verl_rows_and_seeded():
    rows = task_rows("chain_sum", size=5, seed=3)
    assert rows == task_rows("chain_sum", size=5, seed=3)
    assert rows != task_rows("chain_sum", size=5, seed=4)
    row = rows[0]
    assert row["data_source"] == DATA_SOURCE
    assert row["prompt"][0]["role"] == "user" and "=" in row["prompt"][0]["content"]
    assert row["reward_model"]["ground_truth"] == row["extra_info"]["entry"]["answer"]


@pytest.mark.parametrize("task", ["chain_sum", "basic_arithmetic"])
def test_the_reward_is_the_tasks_own_verifier(task):
    reward = ReasoningGymReward()
    for row in task_rows(task, size=4, seed=0):
        truth, extra = row["reward_model"]["ground_truth"], row["extra_info"]
        assert reward(f" {truth}\n", truth, extra) == 1.0
        assert reward(str(int(truth) + 1), truth, extra) < 1.0
        assert reward("no idea", truth, extra) == 0.0


def test_a_row_without_its_entry_is_refused_by_name():
    with pytest.raises(ValueError, match="extra_info lacks 'task' and 'entry'"):
        ReasoningGymReward()("3", "3", {})


def test_installed_plugins_serve_the_rows_and_route_them_to_the_reward():
    from verl_core.data import load_rows
    from verl_rewards.functions import resolve_data_source

    registry = PluginRegistry()
    rows = load_rows("builtin:reasoning-gym-chain-sum", split="test", registry=registry)
    assert len(rows) == 200 and rows[0]["data_source"] == DATA_SOURCE
    assert resolve_data_source(DATA_SOURCE, registry=registry) == "reasoning_gym"
