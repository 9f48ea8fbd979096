"""Real datasets and rewards through `verl run`: a prepared GSM8K sample, a reward plugin package, a reward model."""

import json
import subprocess
import sys
import textwrap

import pytest

from verl_core.testing import tiny_reward_model_dir, tiny_text_model_dir
from verl_data_prepare.prepare import sample_path

# A tiny random model will not learn GSM8K; these runs check that everything is wired, not that it learns.
SMALL = ["rollout.n=2", "rollout.max_new_tokens=8", "run.threads=1", "run.val_every=0", "data.max_val_samples=4",
         "data.batch_size=10"]


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    src = sample_path("gsm8k")
    args = ["data", "prepare", "gsm8k", "-i", str(src / "train.jsonl"), "-i", str(src / "test.jsonl"), "-o", str(out)]
    res = subprocess.run([sys.executable, "-m", "verl_cli", *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return tiny_text_model_dir(tmp_path_factory.mktemp("text-model"))


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_gsm8k_sample_runs_end_to_end_and_resumes_at_an_epoch_boundary(gsm8k_dir, text_model, tmp_path, run_verl):
    out = tmp_path / "run"
    common = ["--model", text_model, "--data", str(gsm8k_dir / "train.parquet"), "--output-dir", str(out),
              f"data.val={json.dumps(str(gsm8k_dir / 'test.parquet'))}", *SMALL]
    # 30 prompts, 10 per step: step 3 ends epoch 0 exactly, and the checkpoint is taken there.
    res = run_verl("run", *common, "--max-steps", "3", "--save-every", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = _metrics(out)
    data = [r for r in rows if "data/train_prompts" in r]
    assert data[0]["data/train_prompts"] == 30 and data[0]["data/val_prompts"] == 4
    train = [r for r in rows if "ppo/actor_loss" in r]
    assert [(r["step"], r["epoch"]) for r in train] == [(1, 0), (2, 0), (3, 0)]
    assert "reward/source/openai/gsm8k/mean" in train[0] and train[0]["reward/errors"] == 0
    assert [r["step"] for r in rows if "val/reward_mean" in r] == [0, 3]

    res = run_verl("run", *common, "--max-steps", "5")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed at step 3" in res.stdout
    train = [r for r in _metrics(out) if "ppo/actor_loss" in r]
    assert [(r["step"], r["epoch"]) for r in train] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1)]


def test_a_data_source_without_a_reward_fails_before_the_model_loads(text_model, tmp_path, run_verl):
    rows = [{"prompt": "Say hi.", "answer": "hi"}] * 4
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run_verl("run", "--model", text_model, "--data", str(path), "--output-dir", str(tmp_path / "r"),
                   "data.data_source=my/greetings", "data.batch_size=2")
    assert res.returncode == 2, res.stderr[-2000:]
    assert "no reward for data_source 'my/greetings'" in res.stderr and "reward.aliases" in res.stderr
    assert "Traceback" not in res.stderr


PLUGIN_PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "verl-reward-indexed"
version = "0.0.1"
dependencies = ["verl-core>=0.1,<0.2"]

[project.entry-points."verl.plugin_api"]
v3 = "verl_reward_indexed"

[project.entry-points."verl.rewards"]
indexed = "verl_reward_indexed:IndexedReward"
"""

PLUGIN_MODULE = '''
"""A reward from outside the core: reads the row's extra_info (so it fails if extra info is not passed through)."""
from dataclasses import dataclass


@dataclass
class IndexedConfig:
    scale: float = 1.0


class IndexedReward:
    Config = IndexedConfig

    def __init__(self, config):
        self.config = config

    def __call__(self, inputs):  # a batch reward
        return [self.config.scale * (extra["index"] + 1) / 100 for extra in inputs.extra_infos]
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    src = tmp_path_factory.mktemp("pkg")
    (src / "pyproject.toml").write_text(PLUGIN_PYPROJECT)
    (src / "verl_reward_indexed.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True)
    return site


@pytest.mark.slow
def test_reward_plugin_package_rule_and_reward_model_combined_through_verl_run(gsm8k_dir, text_model, plugin_site,
                                                                               tmp_path, run_verl):
    env = {"PYTHONPATH": str(plugin_site)}
    listed = {(r["kind"], r["name"]): r for r in json.loads(run_verl("plugins", "list", "--json", env=env).stdout)}
    assert listed[("reward", "indexed")]["distribution"] == "verl-reward-indexed"
    assert listed[("reward", "gsm8k")]["distribution"] == "verl-reward-rules"

    reward_model = tiny_reward_model_dir(tmp_path)
    out = tmp_path / "run"
    components = ('reward.components=[{name="gsm8k", weight=1.0}, {name="indexed", weight=0.5}, '
                  '{name="reward_model", weight=2.0}]')
    res = run_verl("run", "--model", text_model, "--data", str(gsm8k_dir / "train.parquet"), "--output-dir", str(out),
                   "--max-steps", "1", *SMALL, components, "reward.options={indexed={scale=3.0}}",
                   f"reward.model_path={json.dumps(reward_model)}", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    [step] = [r for r in _metrics(out) if "ppo/actor_loss" in r]
    indexed, rm, gsm8k = step["reward/indexed/mean"], step["reward/reward_model/mean"], step["reward/gsm8k/mean"]
    # extra_info["index"] of the drawn rows, scaled by the option: between 3 * 1/100 and 3 * 30/100.
    assert 0.03 <= indexed <= 0.9
    assert rm != 0.0  # a (random) reward model scores every sample
    assert step["reward/mean"] == pytest.approx(gsm8k + 0.5 * indexed + 2.0 * rm, abs=1e-4)
    assert 'components = [{ name = "gsm8k", weight = 1.0 }' in (out / "config.toml").read_text()
