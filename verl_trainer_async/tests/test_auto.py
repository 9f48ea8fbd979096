"""``trainer.mode = "auto"`` (issue 33): the decision rule over figures, both ways; a real ``verl run`` that
logs its choice and trains; the hand-over to colocate_async (same prompts, in order, as a sync run draws
them); a crashed run that resumes in the mode it picked and ends as the uninterrupted one; the conformance
suite, staying sync and handing over.

The choice depends on the machine's cores and speed, so the tests that need the hand-over force it with a
margin no overlap can miss and cores to spare; the rule itself is tested over figures.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from verl_core.testing import StepSourceConformance

import verl_trainer_async.auto as auto
from test_async_trainer import _crash_at, _prompts_by_step  # this directory's helpers (pytest puts it on the path)
from verl_trainer_async.auto import AutoChoice, pick_mode

FAST = ["data.batch_size=8", "rollout.n=4", "run.val_every=0", "run.val_before_train=false", "run.threads=1",
        "reward.isolation=\"none\"", "run.loggers=[]", "run.resume='never'"]
AUTO = ["trainer.mode='auto'", "trainer.auto_steps=1"]


def trainer(tmp: Path, *overrides: str, steps: int = 5) -> Any:
    from verl_core.trainer import Trainer

    return Trainer.from_config(overrides=[*FAST, f"run.max_steps={steps}", f"run.output_dir='{tmp}'", *overrides])


@pytest.fixture
def overlap(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto picks the overlapping mode whatever the figures: cores to spare, a margin no prediction misses."""
    def overlapping(*args: Any, **kwargs: Any) -> AutoChoice:
        return pick_mode(*args, **{**kwargs, "cores": 1024, "margin": -10.0})

    monkeypatch.setattr(auto, "pick_mode", overlapping)


def _metrics(t: Any) -> list[dict[str, float]]:
    seen: list[dict[str, float]] = []
    run_step = t.run_step
    t.run_step = lambda: (seen.append(run_step()), seen[-1])[1]
    return seen


# ------------------------------------------------------------------ the rule, over figures
def test_two_cores_stay_sync() -> None:
    """Issue 33's small job on 2 cores (sync generation ~12 ms, update ~19 ms): the producer shares the cores."""
    choice = pick_mode(0.012, 0.019, cores=2, trainer_threads=1, producer_threads=1)  # the defaults on 2 cores
    assert choice.mode == "sync"
    assert choice.line().startswith("trainer.mode=auto picked sync: generation 0.012 s, update 0.019 s per step, "
                                    "2 cores -> sync (overlapped, the trainer and a producer need 3 cores")
    # Even with generation and update balanced, where an overlap on cores of their own would halve the step.
    assert pick_mode(0.02, 0.02, cores=2, trainer_threads=1, producer_threads=1).mode == "sync"
    # Two trainer threads next to one producer thread: the issue measured 42-69 ms against 29-39 ms in sync.
    choice = pick_mode(0.012, 0.019, cores=2, trainer_threads=2, producer_threads=1)
    assert choice.mode == "sync" and choice.predicted_s == pytest.approx(0.048)
    # Three cores leave one for the Python work of both sides.
    assert pick_mode(0.02, 0.02, cores=3, trainer_threads=1, producer_threads=1).mode == "colocate_async"


def test_spare_cores_and_a_balanced_step_overlap() -> None:
    choice = pick_mode(0.5, 1.0, cores=16, trainer_threads=8, producer_threads=4)
    assert choice.mode == "colocate_async"
    assert choice.predicted_s == pytest.approx(1.0)  # generation on half the threads: 1.0 s, next to the update
    assert "33% under the sync step's 1.500 s" in choice.line()
    assert pick_mode(0.5, 1.0, cores=16, trainer_threads=8, producer_threads=4,
                     overlap_mode="separate_async").mode == "separate_async"


def test_a_gain_within_the_margin_stays_sync() -> None:
    """Generation 10% of the step: overlapping could save at most that, less than AUTO_MARGIN."""
    choice = pick_mode(0.1, 0.9, cores=64, trainer_threads=8, producer_threads=8)
    assert choice.mode == "sync" and "less than the 20% margin" in choice.reason
    assert choice.metrics()["auto/overlapped"] == 0.0


def test_a_producer_on_fewer_threads_must_still_keep_up() -> None:
    """Generation half the step on 8 threads takes 4x as long on 2: the producer would be the slow side."""
    assert pick_mode(1.0, 1.0, cores=64, trainer_threads=8, producer_threads=2).mode == "sync"
    assert pick_mode(1.0, 1.0, cores=64, trainer_threads=8, producer_threads=8).mode == "colocate_async"


def test_auto_settings_name_their_key(tmp_path: Path) -> None:
    from verl_core.config import ConfigError

    with pytest.raises(ConfigError, match="auto_steps"):
        trainer(tmp_path, "trainer.mode='auto'", "trainer.auto_steps=0")
    with pytest.raises(ConfigError, match="producer.*colocate_async"):
        trainer(tmp_path, "trainer.mode='auto'", "trainer.producer='thread'")


# ------------------------------------------------------------------ real runs
def test_verl_run_auto_logs_its_choice_and_trains(tmp_path: Path) -> None:
    """The default tiny run through the CLI: a choice line with its figures, every step trained, the choice in
    the metrics and the checkpoint (this machine's cores decide which; on 2 cores it is sync)."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "verl_cli", "run", *FAST, "run.loggers=['jsonl']",
                           "trainer.mode='auto'", "trainer.auto_steps=2", "run.max_steps=4",
                           f"run.output_dir='{run_dir}'"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("trainer.mode=auto picked ")]
    assert len(lines) == 1, done.stderr[-3000:]
    picked = lines[0].split()[2].rstrip(":")
    assert picked in ("sync", "colocate_async") and " cores -> " in lines[0]
    if (os.cpu_count() or 1) <= 2:  # one trainer thread and one producer thread on 2 cores: no spare core
        assert picked == "sync"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "timing/step" in r}
    assert sorted(steps) == [1, 2, 3, 4]
    assert steps[4]["auto/overlapped"] == float(picked != "sync") and steps[4]["auto/generate_s"] > 0
    state = json.loads((run_dir / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["auto"]["choice"]["mode"] == picked and len(state["auto"]["figures"]) == 2


def test_the_hand_over_trains_the_prompts_a_sync_run_draws_in_order(tmp_path: Path, overlap: None,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    sync = trainer(tmp_path / "sync", "run.save_every=1")
    sync.train()
    t = trainer(tmp_path / "auto", *AUTO, "run.save_every=1")
    seen = _metrics(t)
    with caplog.at_level(logging.WARNING, logger="verl_trainer_async.auto"):
        t.train()
    # Step 1 warms up, step 2 is measured, the choice follows it; steps 3-5 come from the producer.
    assert [m.get("async/staleness") for m in seen] == [None, None, 0.0, 1.0, 1.0]
    assert seen[2]["auto/overlapped"] == 1.0 and "auto/overlapped" not in seen[3]
    assert [r.message for r in caplog.records if "picked" in r.message][0].startswith(
        "trainer.mode=auto picked colocate_async: generation ")
    assert _prompts_by_step(tmp_path / "auto") == _prompts_by_step(tmp_path / "sync")


@pytest.mark.parametrize("crash_at", [3, 4], ids=["from-the-hand-over-checkpoint", "from-an-async-checkpoint"])
def test_a_crashed_auto_run_resumes_in_the_mode_it_picked_and_ends_as_the_uninterrupted_run(
        tmp_path: Path, overlap: None, monkeypatch: pytest.MonkeyPatch, crash_at: int) -> None:
    common = [*AUTO, "run.save_every=1", "run.keep_checkpoints=0"]
    whole = trainer(tmp_path / "whole", *common)
    whole.train()
    expected = {k: v.clone() for k, v in whole.actor.iter_weights()}

    _crash_at(trainer(tmp_path / "crashed", *common, "run.resume='auto'"), crash_at)

    def no_second_choice(*args: Any, **kwargs: Any) -> AutoChoice:
        raise AssertionError("a resumed auto run chose again")

    monkeypatch.setattr(auto, "pick_mode", no_second_choice)
    resumed = trainer(tmp_path / "crashed", *common, "run.resume='auto'")
    seen = _metrics(resumed)
    resumed.train()
    assert resumed.resumed_from.name == f"step_{crash_at - 1:06d}"
    assert all("async/staleness" in m for m in seen)  # in the mode it picked from its first step
    for k, v in resumed.actor.iter_weights():
        assert torch.equal(v, expected[k]), k
    assert _prompts_by_step(tmp_path / "crashed") == _prompts_by_step(tmp_path / "whole")


# ------------------------------------------------------------------ the step-source contract
class TestAuto(StepSourceConformance):
    """Whatever this machine picks (sync on 2 cores)."""

    @pytest.fixture
    def overrides(self) -> list[str]:
        return ["trainer.mode='auto'", "trainer.auto_steps=1"]


class TestAutoHandingOver(StepSourceConformance):
    """The choice after step 2, colocate_async from step 3."""

    @pytest.fixture(autouse=True)
    def _overlap(self, overlap: None) -> None:
        pass

    @pytest.fixture
    def overrides(self) -> list[str]:
        return ["trainer.mode='auto'", "trainer.auto_steps=1"]
