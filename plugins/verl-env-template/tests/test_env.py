"""my_env against the core's environment conformance suite, its own rules, and a 2-step run through the CLI."""

import json
import os
import subprocess
import sys

import pytest

from verl_core.registry import PluginRegistry
from verl_core.testing import EnvironmentConformance

from verl_env_template.env import MyEnvironment, MyEnvironmentConfig

#: The name `verl run --env` selects this environment by (the entry point's key in pyproject.toml).
ENV_NAME = "my_env"
ROW = {"prompt": [{"role": "user", "content": "12+30="}], "ground_truth": "42", "extra_info": {}}


class TestMyEnvironmentConformance(EnvironmentConformance):
    """Types of every value, garbage turns, close at any point, tool schemas: as a run checks them."""

    @pytest.fixture
    def environment(self):
        # Loaded the way `verl run --env my_env` loads it: through the installed entry point.
        cls = PluginRegistry().load("environment", ENV_NAME)
        return lambda: cls(cls.Config())

    @pytest.fixture
    def task_row(self):
        return ROW


def test_a_wrong_answer_is_asked_again_and_a_right_one_rewarded():
    env = MyEnvironment(MyEnvironmentConfig(correct_reward=0.5))
    assert env.reset(prompt=ROW["prompt"], extra_info={"ground_truth": "42"}) == ROW["prompt"]
    wrong = env.step("41")
    assert (wrong.observation, wrong.reward, wrong.done) == (ROW["prompt"], 0.0, False)
    right = env.step(" 42 ")
    assert (right.observation, right.reward, right.done) == (None, 0.5, True)


def test_a_row_without_ground_truth_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="ground truth"):
        MyEnvironment().reset(prompt=ROW["prompt"], extra_info={"ground_truth": None})


@pytest.mark.slow
def test_verl_run_env_trains_two_steps(tmp_path):
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "verl_cli", "run", "--env", ENV_NAME, "--output-dir", str(out),
                          "run.max_steps=2", "run.save_every=0", "data.max_val_samples=50"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "run completed at step 2" in res.stdout + res.stderr
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in steps if "env/reward_mean" in m]
    assert [m["step"] for m in trained] == [1, 2]  # the environment's rewards reached both steps
    assert all(m["env/turns_mean"] >= 1.0 for m in trained)
