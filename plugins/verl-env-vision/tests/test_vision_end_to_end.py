"""``verl run --env vision``: the tiny VLM learns the visual task, and the gain comes from the pixels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _run(out: Path, *args: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    res = subprocess.run([sys.executable, "-m", "verl_cli", "run", "--env", "vision", "--output-dir", str(out),
                          *args], capture_output=True, text=True, env=env, timeout=3000)
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _val(rows: list[dict]) -> list[float]:
    return [r["val/reward_mean"] for r in rows if "val/reward_mean" in r]


@pytest.mark.heavy
def test_vision_task_learns_from_the_images_and_not_from_the_text(tmp_path: Path) -> None:
    val = _val(_run(tmp_path / "vision"))
    # The better of the last two validations: one late dip (a different CPU's rounding is another trajectory)
    # does not hide that the run learned.
    late = max(val[-2:])
    assert late - val[0] >= 0.15, f"greedy accuracy {val[0]:.3f} -> {val}"
    # The same model and run with every image blank: the question alone does not tell the colour.
    control = _val(_run(tmp_path / "blank", "data.train=builtin:vision-shapes-blank"))
    assert max(control[-2:]) < 0.4, f"text-only control reached {control}"
    assert late > max(control[-2:]) + 0.15, f"with images {val}, images blanked {control}"


@pytest.mark.heavy
def test_vision_task_runs_on_the_ray_executor_with_two_ranks(tmp_path: Path) -> None:
    """Images follow their samples through Ray's split dispatch over two FSDP ranks (and the rollout)."""
    rows = _run(tmp_path / "ray", "--executor", "ray", "--max-steps", "2", "executor.world_size=2",
                "data.batch_size=8", "rollout.n=2", "run.val_every=0", "run.val_before_train=false",
                "run.save_every=0")
    train = [r for r in rows if "ppo/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2]


def _train_rows(rows: list[dict]) -> dict[int, dict]:
    # Everything but wall-clock figures (timings, throughput, peak memory).
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/", "memory/"))}
            for r in rows if "ppo/pg_loss" in r}


@pytest.mark.heavy
def test_resuming_from_a_checkpoint_trains_on_the_same_images_as_the_uninterrupted_run(tmp_path: Path) -> None:
    small = ["data.batch_size=8", "rollout.n=4", "run.val_every=0", "run.val_before_train=false", "run.save_every=2"]
    expected = _train_rows(_run(tmp_path / "full", *small, "run.max_steps=4"))
    _run(tmp_path / "split", *small, "run.max_steps=2")
    got = _train_rows(_run(tmp_path / "split", *small, "run.max_steps=4", "--resume", "auto"))
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):  # rewards, losses and log-prob figures depend on which image each sample had
        assert got[step] == expected[step], f"step {step} differs after the resume"
