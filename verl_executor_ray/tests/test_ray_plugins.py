"""A third-party plugin, installed where only the controller looks, is found inside the Ray workers."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "verl-algo-marked"
version = "0.0.1"
dependencies = ["verl-core>=0.1,<0.2", "verl-algorithms>=0.1,<0.2"]

[project.entry-points."verl.plugin_api"]
v3 = "verl_algo_marked"

[project.entry-points."verl.algorithms"]
marked = "verl_algo_marked:Marked"
"""

MODULE = '''
"""GRPO whose loss leaves a file named after the process that computed it."""
import os
from dataclasses import dataclass
from pathlib import Path

from verl_algorithms.grpo import GRPO, GRPOConfig


@dataclass
class MarkedConfig(GRPOConfig):
    marker_dir: str = ""


class Marked(GRPO):
    Config = MarkedConfig

    def policy_loss(self, **kwargs):
        Path(self.config.marker_dir, str(os.getpid())).touch()
        return super().policy_loss(**kwargs)
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    src = tmp_path_factory.mktemp("pkg")
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "verl_algo_marked.py").write_text(textwrap.dedent(MODULE))
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True)
    return site


def test_third_party_algorithm_runs_inside_the_workers(ray_session, plugin_site, tmp_path, monkeypatch):
    # The Ray instance (and so every process it forks by default) started before the plugin was on
    # the path: only the executor's hand-over of the controller's sys.path can make it importable.
    monkeypatch.syspath_prepend(str(plugin_site))
    importlib.invalidate_caches()
    from verl_core.trainer import Trainer

    markers = tmp_path / "markers"
    markers.mkdir()
    trainer = Trainer.from_config(overrides=[
        'executor.name="ray"', "executor.world_size=2", 'algorithm.name="marked"',
        f"algorithm.marker_dir={str(markers)!r}", "run.max_steps=1", "data.batch_size=4", "rollout.n=2",
        "run.val_before_train=false", "data.max_val_samples=4", "run.loggers=[]", "run.threads=1",
        f"run.output_dir={str(tmp_path / 'run')!r}"])
    metrics = trainer.train()
    workers = {info["pid"] for info in trainer.executor._pools["default"].info}
    assert "ppo/actor_loss" in metrics
    computed_in = {int(p.name) for p in markers.iterdir()}
    assert computed_in == workers and os.getpid() not in computed_in
