"""The real reasoning-gym package: rows of a task or a mixture, its verifier as the reward, routing by
data_source, and ``verl run --data reasoning_gym:<tasks>`` end to end."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import reasoning_gym

from verl_data import DataError, check_data_source, load_rows
from verl_core.registry import PluginRegistry

from verl_reasoning_gym.tasks import (DATA_SOURCE, TEST_SEED, ReasoningGymReward, mixture_rows, parse_spec,
                                      parse_tasks, task_rows)

#: Two-term sums and differences of two-digit numbers: the additions are the built-in model's own task.
SMALL_CHAIN_SUM = 'chain_sum{"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}'


def test_rows_are_verl_rows_and_seeded():
    rows = task_rows("chain_sum", size=5, seed=3)
    assert rows == task_rows("chain_sum", size=5, seed=3)
    assert rows != task_rows("chain_sum", size=5, seed=4)
    row = rows[0]
    assert row["data_source"] == f"{DATA_SOURCE}/chain_sum"
    assert row["prompt"][0]["role"] == "user" and "=" in row["prompt"][0]["content"]
    assert row["reward_model"]["ground_truth"] == row["extra_info"]["entry"]["answer"]


def test_the_spec_parses_one_task_a_mixture_and_refuses_bad_ones():
    assert parse_tasks("chain_sum") == {"chain_sum": 1.0}
    assert parse_tasks("chain_sum=0.7, basic_arithmetic=0.3") == {"chain_sum": 0.7, "basic_arithmetic": 0.3}
    assert parse_tasks("chain_sum,basic_arithmetic=2") == {"chain_sum": 1.0, "basic_arithmetic": 2.0}
    for argument, message in (("chain_sums", r"no task 'chain_sums'; did you mean chain_sum or decimal_chain_sum\? "
                                             r"its \d+ tasks: ab, "),
                              ("chain_sum=lots", r"the weight 'lots' of chain_sum is not a number; write one task"),
                              ("chain_sum=-1", r"weights are numbers >= 0"),
                              ("chain_sum=0,basic_arithmetic=0", r"the weights sum to 0"),
                              ("chain_sum,chain_sum", r"chain_sum is named twice"),
                              ("chain_sum,", r"an empty task name")):
        with pytest.raises(ValueError, match=message):
            parse_tasks(argument)


def test_a_task_takes_its_own_reasoning_gym_config():
    weights, configs = parse_spec(f'{SMALL_CHAIN_SUM}=0.7, basic_arithmetic{{"operators": ["+"]}}')
    assert weights == {"chain_sum": 0.7, "basic_arithmetic": 1.0}
    assert configs == {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
                       "basic_arithmetic": {"operators": ["+"]}}
    assert parse_spec("chain_sum") == ({"chain_sum": 1.0}, {"chain_sum": {}})
    rows = load_rows(f"reasoning_gym:{SMALL_CHAIN_SUM}", size=20, registry=PluginRegistry())
    expressions = [r["extra_info"]["entry"]["metadata"]["expression"].split() for r in rows]
    assert all(len(e) == 3 and len(e[0]) == len(e[2]) == 2 for e in expressions)
    assert rows[0]["extra_info"]["config"] == configs["chain_sum"]
    for argument, message in (('chain_sum{"min_term": 2}', r"chain_sum has no config field 'min_term'; did you mean "
                                                             r"min_terms or max_terms\? ChainSumConfig's fields: "),
                              ('chain_sum{"seed": 3}', r"'seed' is set by verl"),
                              ('chain_sum{"size": 3}', r"'size' is set by verl \(data.size"),
                              ('chain_sum{"min_terms": 3, "max_terms": 2}', r"refuses the config .*max_terms must be"),
                              ('chain_sum{"min_terms": "two"}', r"refuses the config .*TypeError"),
                              ('chain_sum{"min_terms": 2', r"the config of chain_sum is not a JSON object"),
                              ('chain_sum[2]', r"no task 'chain_sum\[2\]'"),
                              ('chain_sum{} 2', r"' 2' after chain_sum"),
                              ('chain_sum["min_terms"]', r"no task"),
                              ('chain_sum{"min_terms": 2}=x', r"the weight 'x' of chain_sum")):
        with pytest.raises(ValueError, match=message):
            parse_spec(argument)


def test_the_reward_grades_with_the_rows_config():
    # The grader is the task built with the row's config (some tasks' score_answer reads their config).
    reward = ReasoningGymReward()
    for row in task_rows("basic_arithmetic", size=4, seed=0, operators=["+"], allow_parentheses=False):
        truth = row["reward_model"]["ground_truth"]
        assert row["extra_info"]["config"] == {"operators": ["+"], "allow_parentheses": False}
        assert reward(truth, truth, row["extra_info"]) == 1.0
        assert reward(str(int(truth) + 1), truth, json.loads(json.dumps(row["extra_info"]))) < 1.0


def test_the_core_checks_the_spec_naming_the_key():
    registry = PluginRegistry()
    check_data_source("reasoning_gym:chain_sum=0.7,basic_arithmetic=0.3", "data.train", registry=registry)
    with pytest.raises(DataError, match=r"^data.val: 'reasoning_gym:chain_sum=x': the weight 'x'"):
        check_data_source("reasoning_gym:chain_sum=x", "data.val", registry=registry)


def test_rows_hold_the_tasks_own_questions_and_answers_in_proportion():
    registry = PluginRegistry()
    rows = load_rows("reasoning_gym:chain_sum", size=8, registry=registry)
    entries = list(reasoning_gym.create_dataset("chain_sum", size=8, seed=0))
    assert sorted(r["prompt"][0]["content"] for r in rows) == sorted(e["question"] for e in entries)
    assert sorted(r["reward_model"]["ground_truth"] for r in rows) == sorted(e["answer"] for e in entries)
    mixed = load_rows("reasoning_gym:chain_sum=0.7,basic_arithmetic=0.3", size=10, registry=registry)
    assert Counter(r["data_source"] for r in mixed) == {"reasoning_gym/chain_sum": 7,
                                                        "reasoning_gym/basic_arithmetic": 3}
    sources = [r["data_source"] for r in mixed]
    assert sources not in (sorted(sources), sorted(sources, reverse=True))  # shuffled: any prefix is mixed
    # The test split is held out: other entries than the training rows (Random(seed + index) per entry).
    test = load_rows("reasoning_gym:chain_sum", split="test", size=200, val_size=50, registry=registry)
    train = {r["extra_info"]["entry"]["metadata"]["source_index"] for r in load_rows("reasoning_gym:chain_sum",
                                                                                      size=200, registry=registry)}
    assert len(test) == 50 and test == mixture_rows({"chain_sum": 1.0}, size=50, seed=TEST_SEED)
    assert not train & {r["extra_info"]["entry"]["metadata"]["source_index"] + TEST_SEED for r in test}


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
    from verl_rewards.functions import resolve_data_source

    registry = PluginRegistry()
    rows = load_rows("builtin:reasoning-gym-chain-sum", split="test", registry=registry)
    assert len(rows) == 200 and rows[0]["data_source"] == "reasoning_gym/chain_sum"
    for source in (DATA_SOURCE, "reasoning_gym/chain_sum", "reasoning_gym/basic_arithmetic"):
        assert resolve_data_source(source, registry=registry) == "reasoning_gym"


def _verl(*args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "verl_cli", *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)


def test_bad_weights_stop_a_dry_run_with_exit_2(tmp_path):
    out = _verl("run", "--data", "reasoning_gym:chain_sum=0", "--dry-run", tmp_path=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "data.train: 'reasoning_gym:chain_sum=0': the weights sum to 0" in out.stdout + out.stderr


def test_a_bad_task_config_stops_a_dry_run_with_exit_2(tmp_path):
    out = _verl("run", "--data", 'reasoning_gym:chain_sum{"max_term": 2}', "--dry-run", tmp_path=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert ("data.train: 'reasoning_gym:chain_sum{\"max_term\": 2}': chain_sum has no config field 'max_term'; "
            "did you mean max_terms or min_terms?") in out.stdout + out.stderr


def test_a_two_step_run_on_a_reasoning_gym_task(tmp_path):
    # The built-in tiny model keeps prompts to 16 tokens (its preset): 44 of these 64 fit, so 16 per step.
    out = _verl("run", "--data", "reasoning_gym:chain_sum=0.7,basic_arithmetic=0.3", "data.size=64",
                "data.val_size=20", "data.batch_size=16", "--max-steps", "2", "--output-dir", str(tmp_path / "run"),
                "run.threads=1", tmp_path=tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "verl: run completed at step 2" in log
    assert "val/source/reasoning_gym/chain_sum/mean" in log and "val/source/reasoning_gym/basic_arithmetic/mean" in log


@pytest.mark.heavy
def test_the_built_in_model_learns_two_term_chain_sums(tmp_path):
    """The README's figure: validation reward 0.124 -> 0.152 -> 0.175 at steps 0/20/40 (about 30 s on one core)."""
    out = _verl("run", "--data", f"reasoning_gym:{SMALL_CHAIN_SUM}", "data.size=2000", "data.val_size=500",
                "backend.lr=5e-5", "run.max_steps=40", "run.val_every=20", "run.save_every=0", "run.threads=1",
                "--output-dir", str(tmp_path / "run"), tmp_path=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = {m["step"]: round(m["val/reward_mean"], 3) for m in steps if "val/reward_mean" in m}
    print("val/reward_mean by step:", val)
    assert val[40] >= val[0] + 0.03, val
