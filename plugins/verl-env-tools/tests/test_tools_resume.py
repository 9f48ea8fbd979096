"""kill -9 in the middle of a multi-turn step (generation or tool calls), then resume: the run ends
as the uninterrupted one did, every prompt trained on exactly once."""

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
         'run.loggers=["jsonl"]']


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "verl_core.cli", "run", "--env", "tools", "--output-dir", str(out), *SMALL, *extra]


def _train_rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # Everything but wall-clock figures (timings, throughput, peak memory).
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/", "memory/"))}
            for r in rows if "ppo/pg_loss" in r}


def test_kill_during_a_step_then_resume_matches_the_uninterrupted_run(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(_cmd(tmp_path / "full", "run.max_steps=3"), check=True, env=env, capture_output=True, timeout=1800)
    expected = _train_rows(tmp_path / "full")
    # Step 3 takes under a second on a fast machine: kill partway through it as this machine ran it.
    rows = map(json.loads, (tmp_path / "full" / "metrics.jsonl").read_text().splitlines())
    [step_3_s] = [r["timing/step"] for r in rows if r.get("step") == 3 and "timing/step" in r]

    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(out, "run.max_steps=3"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 1200
        while not (out / "checkpoints" / "step_000002" / "manifest.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before step 2's checkpoint"
            time.sleep(0.02)
        time.sleep(0.4 * step_3_s)  # inside step 3: generating, or running the turns' tool calls
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (out / "checkpoints" / "step_000003" / "manifest.json").exists(), "killed too late to test anything"
    subprocess.run(_cmd(out, "run.max_steps=3", "--resume", "auto"), check=True, env=env, capture_output=True,
                   timeout=1800)
    got = _train_rows(out)
    assert sorted(got) == [1, 2, 3]  # step 3 once, from the resume
    for step in (1, 2, 3):
        assert got[step] == expected[step], f"step {step} differs after the resume"
