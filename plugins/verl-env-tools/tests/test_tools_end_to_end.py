"""``verl run --env tools``: the built-in tool task learns, and beats the same model without tools."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _run(out: Path, *args: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "verl_cli", "run", "--env", "tools", "--output-dir", str(out),
                          *args], capture_output=True, text=True, env=env, timeout=3000)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.heavy
def test_tool_task_learns_and_beats_no_tools(tmp_path: Path) -> None:
    rows = _run(tmp_path / "tools")
    val = [r["val/reward_mean"] for r in rows if "val/reward_mean" in r]
    train = [r for r in rows if "env/turns_mean" in r and "ppo/pg_loss" in r]
    assert val[-1] - val[0] >= 0.15, f"greedy accuracy with tools {val[0]:.3f} -> {val[-1]:.3f}"
    assert all(r["env/template_mismatch"] == 0 for r in train)
    assert all(0 < r["env/env_token_frac"] < 1 for r in train)  # tool output is in the batch, masked
    # The same model, with the calculator taken away: its calls fail and it must answer alone.
    control = _run(tmp_path / "no-tools", "environment.tools=[]", "run.max_steps=0")
    no_tools = [r["val/reward_mean"] for r in control if "val/reward_mean" in r][-1]
    assert val[-1] > no_tools + 0.15, f"with tools {val[-1]:.3f}, without {no_tools:.3f}"


def test_tool_task_on_the_ray_executor(tmp_path: Path) -> None:
    rows = _run(tmp_path / "ray", "--executor", "ray", "--max-steps", "2", "data.batch_size=8", "rollout.n=2",
                "run.val_every=0", "run.val_before_train=false", "run.save_every=0")
    train = [r for r in rows if "env/turns_mean" in r and "ppo/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["env/template_mismatch"] == 0 and r["env/turns_mean"] >= 1 for r in train)
