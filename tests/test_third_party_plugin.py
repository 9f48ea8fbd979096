"""A throw-away third-party algorithm package, installed with pip, used through `verl run`."""

import json
import subprocess
import sys
import textwrap

import pytest

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "verl-algo-signonly"
version = "0.0.1"
dependencies = ["verl-core>=0.1,<0.2", "verl-algorithms>=0.1,<0.2"]

[project.entry-points."verl.plugin_api"]
v3 = "verl_algo_signonly"

[project.entry-points."verl.algorithms"]
signonly = "verl_algo_signonly:SignOnly"

[project.entry-points."verl.hooks"]
recorder = "verl_algo_signonly:Recorder"
"""

MODULE = '''
"""Advantage = sign(reward - group mean): a toy algorithm from outside the core."""
from dataclasses import dataclass

import torch

from verl_algorithms import functional as F
from verl_algorithms.base import PolicyGradient, PPOFamilyConfig
from verl_core.hooks import hookimpl


@dataclass
class SignOnlyConfig(PPOFamilyConfig):
    scale: float = 1.0


class SignOnly(PolicyGradient):
    """The standard step and PPO-clip loss of verl-algorithms' PolicyGradient; only the advantages are its own."""

    Config = SignOnlyConfig

    def compute_advantages(self, batch):
        scores = F.sequence_rewards(batch)  # the token rewards summed, so kl_in_reward reaches them
        adv = torch.zeros_like(scores)
        for g in batch.group_ids.unique():
            m = batch.group_ids == g
            adv[m] = torch.sign(scores[m] - scores[m].mean()) * self.config.scale
        adv = adv.unsqueeze(-1) * batch.response_mask
        return adv, adv


class Recorder:
    \"\"\"Appends the name of every hook it receives to $RECORD_HOOKS (when set).\"\"\"

    def _note(self, name):
        import os

        if os.environ.get("RECORD_HOOKS"):
            with open(os.environ["RECORD_HOOKS"], "a") as f:
                f.write(name + "\\n")

    @hookimpl
    def verl_run_start(self, config, run_dir, start_step, max_steps):
        self._note("verl_run_start")

    @hookimpl
    def verl_step_start(self, step):
        self._note("verl_step_start")

    @hookimpl
    def verl_step_end(self, step, metrics):
        self._note("verl_step_end")

    @hookimpl
    def verl_step_batch(self, step, batch):
        self._note("verl_step_batch")
        return {"recorder/batch_rows": float(len(batch))}  # joins the step's metrics

    @hookimpl
    def verl_metrics(self, step, metrics):
        self._note("verl_metrics")

    @hookimpl
    def verl_validation_start(self, step, samples):
        self._note("verl_validation_start")

    @hookimpl
    def verl_validation_end(self, step, metrics):
        self._note("verl_validation_end")

    @hookimpl
    def verl_samples(self, step, split, samples):
        self._note("verl_samples")

    @hookimpl
    def verl_checkpoint_saved(self, step, path):
        self._note("verl_checkpoint_saved")

    @hookimpl
    def verl_run_end(self, step, status, error):
        self._note("verl_run_end")
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    src = tmp_path_factory.mktemp("pkg")
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "verl_algo_signonly.py").write_text(textwrap.dedent(MODULE))
    site = tmp_path_factory.mktemp("site")
    # No build isolation: setuptools is already in the environment, and the test stays offline.
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True)
    return site


@pytest.mark.slow
def test_third_party_algorithm_runs_through_cli(plugin_site, tmp_path, run_verl):
    env = {"PYTHONPATH": str(plugin_site)}
    listed = run_verl("plugins", "list", "--json", env=env)
    rows = {(r["kind"], r["name"]): r for r in json.loads(listed.stdout)}
    assert rows[("algorithm", "signonly")]["distribution"] == "verl-algo-signonly"
    assert rows[("algorithm", "signonly")]["status"] == "available"

    out = tmp_path / "run"
    env["RECORD_HOOKS"] = str(tmp_path / "hooks.txt")
    res = run_verl("run", "--algo", "signonly", "--max-steps", "2", "--output-dir", str(out), "algorithm.scale=0.5",
                   "data.batch_size=8", "rollout.n=4", "data.max_val_samples=16", "run.threads=1", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    config = (out / "config.toml").read_text()
    assert 'name = "signonly"' in config and "scale = 0.5" in config
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "ppo/actor_loss" in r] == [1, 2]
    assert [r["recorder/batch_rows"] for r in steps if "ppo/actor_loss" in r] == [32.0, 32.0]  # 8 prompts x 4
    # Every documented hook reached the installed hook plugin during the run.
    from verl_core.hooks import HookSpecs

    fired = set((tmp_path / "hooks.txt").read_text().split())
    specs = {name for name in vars(HookSpecs) if name.startswith("verl_")}
    # verl_run_rewound comes only after a worker restart (tests/test_faults.py), verl_health only when a
    # health check fails (plugins/verl-loggers/tests/test_samples_and_health.py).
    assert fired == specs - {"verl_run_rewound", "verl_health"}


def test_every_hook_is_documented():
    from pathlib import Path

    from verl_core.hooks import HookSpecs

    doc = (Path(__file__).parents[1] / "docs" / "hooks.md").read_text()
    for name in (n for n in vars(HookSpecs) if n.startswith("verl_")):
        assert f"### `{name}(" in doc, f"{name} is not documented in docs/hooks.md"
