"""Conformance tests for :class:`~verl_core.contracts.StepSource` implementations (``trainer.mode``).

Subclass :class:`StepSourceConformance` and provide the fixture ``overrides``: the config overrides that
select the source (``["trainer.mode='my_mode'", ...]``). The suite runs the real default run (the built-in
task, model, GRPO and HF rollout, which ``pip install verl`` installs) for a few steps in process, with the
source's methods watched, and resumes it from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from verl_core.contracts import SourcedStep, StepSource

__all__ = ["StepSourceConformance"]

#: A small, fast run of the default task (2 CPU threads at most, no loggers, no validation).
FAST = ["data.batch_size=4", "rollout.n=2", "run.val_every=0", "run.val_before_train=false", "run.threads=1",
        "reward.isolation=\"none\"", "run.loggers=[]", "run.resume='never'", "data.max_val_samples=4"]


class StepSourceConformance:
    """Contract tests every step source must pass."""

    @pytest.fixture
    def overrides(self) -> list[str]:
        pytest.fail(f"{type(self).__name__} must provide an `overrides` fixture selecting trainer.mode")

    def _trainer(self, overrides: list[str], run_dir: Path, steps: int, *extra: str) -> Any:
        from verl_core.trainer import Trainer

        return Trainer.from_config(overrides=[*FAST, *overrides, f"run.max_steps={steps}",
                                              f"run.output_dir={json.dumps(str(run_dir))}", *extra])

    def test_its_config_is_a_dataclass_and_its_defaults_a_pair(self, overrides: list[str], tmp_path: Path) -> None:
        t = self._trainer(overrides, tmp_path, 1)
        source_cls = t.registry.load("step_source", t.config.trainer.name)
        assert issubclass(source_cls, StepSource)
        assert dataclasses.is_dataclass(source_cls.Config) and callable(source_cls.Config().validate)
        recommended, note = source_cls.defaults({"trainer": {"mode": t.config.trainer.name}}, t.registry)
        assert isinstance(recommended, dict) and isinstance(note, str)
        assert source_cls.torch_threads(t.config.trainer.config, 4) in range(1, 5)

    def test_each_step_takes_one_batch_and_hands_its_weights_on(self, overrides: list[str], tmp_path: Path) -> None:
        """next(s) then after_update(s) for s = 1, 2, 3 in order; the prompts are a batch of the batch size
        (a produced batch has its samples); close() is called once with the run, and again is harmless."""
        t = self._trainer(overrides, tmp_path, 3)
        t.setup()
        source, calls, sourced = t.source, [], []
        take, hand = source.next, source.after_update

        def next_(step: int) -> SourcedStep:
            calls.append(("next", step))
            sourced.append(take(step))
            return sourced[-1]

        def after(step: int) -> None:
            calls.append(("after_update", step))
            hand(step)

        source.next, source.after_update = next_, after
        t.train()
        assert calls == [(kind, s) for s in (1, 2, 3) for kind in ("next", "after_update")]
        for item in sourced:
            assert isinstance(item, SourcedStep) and len(item.prompts) == t.config.data.batch_size
            assert item.staleness >= 0 and all(isinstance(v, float) for v in item.metrics.values())
            if item.produced is not None:
                assert len(item.produced) == t.config.data.batch_size * t.config.rollout.config.n
        assert t.source is None  # closed with the run
        source.close()  # again: harmless

    def test_a_checkpoint_holds_its_state_and_a_resume_goes_on_from_it(self, overrides: list[str],
                                                                       tmp_path: Path) -> None:
        first = self._trainer(overrides, tmp_path, 2, "run.save_every=1")
        first.train()
        ckpt = tmp_path / "checkpoints" / "step_000002"
        state = json.loads((ckpt / "trainer_state.json").read_text())  # the source's part is JSON
        assert state["step"] == 2 and len(state["prompts"]) >= first.config.data.batch_size
        again = self._trainer(overrides, tmp_path, 3, "run.resume='auto'")
        steps: list[int] = []
        run_step = again.run_step
        again.run_step = lambda: (steps.append(again.step), run_step())[1]
        again.train()
        assert steps == [3] and again.step == 3
