"""``verl run --rollout sglang`` through the real CLI: it learns, on one process and on Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FAST = ["data.batch_size=16", "rollout.n=4", "data.max_val_samples=40", "run.val_every=0", "run.threads=1"]


def _run(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "verl_cli", "run", "--rollout", "sglang", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.long  # ~7 min; the Ray test below and the conformance suite cover the engine in CI
def test_builtin_task_learns_with_sglang(tmp_path: Path) -> None:
    """The README's default run with the rollout swapped: +15 points at least, as with the HF rollout."""
    res = _run("--output-dir", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _rows(tmp_path / "run")
    val = [r["val/reward_mean"] for r in rows if "val/reward_mean" in r]
    train = [r for r in rows if "rollout/log_prob_diff_max" in r]
    assert val[-1] - val[0] >= 0.15, f"validation reward {val[0]:.3f} -> {val[-1]:.3f}"
    # Every step synced, and the server sampled with the trainer's weights (fp32 both sides).
    assert all(r["timing/sync_weights"] > 0 for r in train)
    assert max(r["rollout/log_prob_diff_max"] for r in train) < 1e-3


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.heavy
def test_sglang_on_the_ray_executor(tmp_path: Path) -> None:
    res = _run("--executor", "ray", "--max-steps", "2", "--output-dir", str(tmp_path / "run"), *FAST,
               timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    train = [r for r in _rows(tmp_path / "run") if "rollout/log_prob_diff_max" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["rollout/log_prob_diff_max"] < 1e-3 and r["timing/sync_weights"] > 0 for r in train)


def test_missing_server_python_is_a_config_error_before_any_model_loads(tmp_path: Path) -> None:
    res = _run("--output-dir", str(tmp_path / "run"), "rollout.server_python=/nonexistent/python", timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "rollout.server_python" in res.stderr and "/nonexistent/python" in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.long  # ~1.5 min; the vLLM run of the same mode and the engine-free partial tests run in CI
def test_partial_rollouts_resume_carried_samples_on_sglang(tmp_path: Path) -> None:
    """trainer.mode='partial' (issue 33): samples cut at 1 token a round are resumed on the next weights from prompt +
    partial response (SGLang's /generate takes input_ids), carried across steps, and weighed against its log-probs."""
    res = _run("--max-steps", "3", "--output-dir", str(tmp_path / "run"), *FAST, "run.val_before_train=false",
               "trainer.mode='partial'", "trainer.token_budget=1", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    train = [r for r in _rows(tmp_path / "run") if "ppo/actor_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(r["partial/rounds"] >= 2 and r["timing/sync_weights"] > 0 for r in train)
    assert max(r["partial/staleness"] for r in train) >= 1 and max(r["partial/stale_token_frac"] for r in train) > 0
    assert all(0.5 < r["ppo/rollout_is_weight_mean"] < 1.5 for r in train)
