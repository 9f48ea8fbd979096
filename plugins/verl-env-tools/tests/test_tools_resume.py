"""kill -9 in the middle of a multi-turn step (between a model turn and its tool calls), then resume: the
run ends as the uninterrupted one did, every prompt trained on exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

SMALL = ["data.batch_size=8", "rollout.n=2", "run.val_every=0", "run.val_before_train=false", "run.save_every=1",
         'run.loggers=["jsonl"]', 'environment.parser="pausing_parser:parse"']
HERE = Path(__file__).parent  # pausing_parser.py: Hermes, and a pause at an exact turn of a step


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "verl_cli", "run", "--env", "tools", "--output-dir", str(out), *SMALL, *extra]


def _train_rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Everything but wall-clock figures (timings, throughput, peak memory).
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/", "memory/"))}
            for r in rows if "ppo/pg_loss" in r}


def test_kill_during_a_step_then_resume_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    subprocess.run(_cmd(tmp_path / "full", "run.max_steps=3"), check=True, env=env, capture_output=True, timeout=1800)
    expected = _train_rows(tmp_path / "full")

    # Step 3 (8 prompts x 2 samples: 16 model turns at least) stops at its 9th model turn, once the turn is
    # read and before its tool calls run: the kill lands there, whatever this machine's speed.
    out, paused = tmp_path / "killed", tmp_path / "paused"
    pause = {"VERL_TEST_PAUSE_AFTER": str(out / "checkpoints" / "step_000002" / "manifest.json"),
             "VERL_TEST_PAUSE_AT": "9", "VERL_TEST_PAUSED": str(paused)}
    proc = subprocess.Popen(_cmd(out, "run.max_steps=3"), env={**env, **pause}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 1200  # against a hang, not a measurement
        while not paused.exists():
            assert proc.poll() is None, "the run ended before step 3's 9th model turn"
            assert time.monotonic() < deadline, "no step 3 within 1200 s"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (out / "checkpoints" / "step_000002" / "manifest.json").exists()
    assert not (out / "checkpoints" / "step_000003").exists()  # killed inside step 3
    subprocess.run(_cmd(out, "run.max_steps=3", "--resume", "auto"), check=True, env=env, capture_output=True,
                   timeout=1800)
    got = _train_rows(out)
    assert sorted(got) == [1, 2, 3]  # step 3 once, from the resume
    for step in (1, 2, 3):
        assert got[step] == expected[step], f"step {step} differs after the resume"
