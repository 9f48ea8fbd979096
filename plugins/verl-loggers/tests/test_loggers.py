"""The tensorboard and wandb sinks: registered from this package, writing what a run emits."""

from pathlib import Path

import pytest

from verl_core.registry import PluginRegistry


def test_both_sinks_are_registered_from_this_package():
    registry = PluginRegistry()
    for name in ("tensorboard", "wandb"):
        assert registry.info("logger", name).distribution == "verl-loggers"


def test_tensorboard_writes_the_scalars(tmp_path: Path):
    pytest.importorskip("tensorboard")
    from verl_loggers import TensorBoardLogger

    sink = TensorBoardLogger()
    sink.verl_run_start(config=None, run_dir=tmp_path, start_step=0, max_steps=2)
    sink.verl_metrics(step=1, metrics={"reward/mean": 0.5, "note": "skipped", "flag": True})
    sink.verl_run_end(step=1, status="completed", error=None)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["reward/mean"]
    assert [e.value for e in events.Scalars("reward/mean")] == [0.5]


def test_wandb_without_the_package_says_what_to_install(tmp_path: Path, monkeypatch):
    import sys

    from verl_loggers import WandbLogger

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError, match="pip install wandb"):
        WandbLogger().verl_run_start(config=None, run_dir=tmp_path, start_step=0, max_steps=1)
