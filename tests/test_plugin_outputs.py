"""Nothing a plugin returns is trained on unchecked (#30, part 3).

A throw-away distribution ("verl-broken-plugins", written as dist-info metadata on PYTHONPATH, found
by the real entry-point discovery) holds an environment for each bug a third-party author planted
when writing one from the docs, a scorer that returns NaN and a rollout engine that returns a token
outside the vocabulary. Each `verl run` must stop before the step trains, exit 1, name the plugin
(kind, entry-point name, distribution) and what it returned, and keep no checkpoint of that step;
with `reward.on_invalid = "skip"` a NaN reward's rows are dropped and counted instead.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

MODULE = '''
import torch

from verl_core.contracts import RolloutOutput, StepResult
from verl_env_kit import MultiTurnEnvironment
from verl_rewards.manager import RewardManager
from verl_rollout_hf import HFRollout


class _Env(MultiTurnEnvironment):
    """One turn: the prompt as given, then the planted value."""
    def reset(self, *, prompt, extra_info):
        return list(prompt)

    def step(self, response):
        return self.result()


class NanReward(_Env):
    def result(self):
        return StepResult(observation=None, reward=float("nan"), done=True)


class StringReward(_Env):
    def result(self):
        return StepResult(observation=None, reward="1", done=True)


class WordReward(_Env):
    def result(self):
        return StepResult(observation=None, reward="correct", done=True)


class DictReward(_Env):
    def result(self):
        return StepResult(observation=None, reward={"score": 1.0}, done=True)


class TextObservation(_Env):
    def result(self):
        return StepResult(observation="try again", reward=0.0, done=False)


class TextReset(_Env):
    def reset(self, *, prompt, extra_info):
        return "what is 1+1?"


class NoBudget(_Env):
    """An episode runner that loses the response budget Dr. GRPO's loss divides by."""
    def result(self):
        return StepResult(observation=None, reward=1.0, done=True)

    @classmethod
    def run_episodes(cls, *args, **kwargs):
        batch = super().run_episodes(*args, **kwargs)
        del batch.info["max_new_tokens"]
        return batch


class NanScorer(RewardManager):
    def score(self, batch):
        scores, metrics = super().score(batch)
        scores[1] = float("nan")
        return scores, metrics


class OutOfVocab(HFRollout):
    def generate(self, prompt_ids, *, sampling):
        out = super().generate(prompt_ids, sampling=sampling)
        out.response_ids[0] = [*out.response_ids[0][:-1], 10 ** 6]
        return out
'''

ENTRY_POINTS = {
    "verl.environments": {"nan_reward": "NanReward", "string_reward": "StringReward", "word_reward": "WordReward",
                          "dict_reward": "DictReward", "text_observation": "TextObservation",
                          "text_reset": "TextReset", "no_budget": "NoBudget"},
    "verl.scorers": {"nan_scorer": "NanScorer"},
    "verl.rollouts": {"out_of_vocab": "OutOfVocab"},
    "verl.plugin_api": {"v3": "unused"},
}

# The default task and model, small; no validation before the first step, so step 1 meets the bug.
FAST = ["--max-steps", "2", "data.batch_size=8", "rollout.n=4", "data.max_val_samples=16", "run.val_every=0",
        "run.threads=1", "run.val_before_train=false", "run.save_every=1"]


@pytest.fixture(scope="module")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = tmp_path_factory.mktemp("site")
    (site / "verl_broken_plugins.py").write_text(textwrap.dedent(MODULE))
    info = site / "verl_broken_plugins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verl-broken-plugins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = verl_broken_plugins:{attr}\n" for name, attr in eps.items()) + "\n"
        for group, eps in ENTRY_POINTS.items()))
    return site


def run_broken(run_verl, site: Path, out: Path, *args: str):
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return run_verl("run", "--output-dir", str(out), *FAST, *args, env=env)


def trained_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r["step"] for r in rows if "actor/grad_norm" in r]


CASES = {
    # name: (arguments, the plugin named, what it returned)
    "nan_reward": (["--env", "nan_reward"], "environment 'nan_reward' (verl-broken-plugins 1.0)",
                   "gave a non-finite reward (nan) at step 1"),
    "string_reward": (["--env", "string_reward"], "environment 'string_reward' (verl-broken-plugins 1.0)",
                      "returned str '1' as the reward from step() at step 1"),
    "word_reward": (["--env", "word_reward"], "environment 'word_reward'", "returned str 'correct' as the reward"),
    "dict_reward": (["--env", "dict_reward"], "environment 'dict_reward'", "returned dict {'score': 1.0} as the reward"),
    "text_observation": (["--env", "text_observation"], "environment 'text_observation'",
                         "returned str 'try again' as the observation"),
    "text_reset": (["--env", "text_reset"], "environment 'text_reset'", "returned str 'what is 1+1?' from reset()"),
    "no_budget": (["--env", "no_budget"], "environment 'no_budget' (verl-broken-plugins 1.0)",
                  "returned NoneType None as the batch's info['max_new_tokens'] at step 1"),
    "nan_scorer": (["reward.scorer=nan_scorer"], "scorer 'nan_scorer' (verl-broken-plugins 1.0)",
                   "gave a non-finite reward (nan) at step 1, row 1"),
    "out_of_vocab": (["--rollout", "out_of_vocab"], "rollout 'out_of_vocab' (verl-broken-plugins 1.0)",
                     "returned list [1000000] as token ids at step 1, row 0; expected integers in [0, "),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_plugin_stops_the_run_before_it_trains(case, broken_site, tmp_path, run_verl):
    args, plugin, returned = CASES[case]
    out = tmp_path / case
    res = run_broken(run_verl, broken_site, out, *args)
    assert res.returncode == 1, (res.returncode, res.stderr[-3000:])
    assert plugin in res.stderr and returned in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert trained_steps(out) == []  # the step with the bad value never trained
    assert not (out / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_skipping_invalid_rewards_drops_the_rows_and_says_so(broken_site, tmp_path, run_verl):
    """The scorer's row 1 is NaN at every step: with on_invalid = "skip" that row is dropped (one of 32),
    counted, reported by the health checks, and the run trains on the rest."""
    out = tmp_path / "skip"
    res = run_broken(run_verl, broken_site, out, "reward.scorer=nan_scorer", "reward.on_invalid=skip")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "actor/grad_norm" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(r["reward/invalid_rows"] == 1.0 for r in train)
    assert all(r["reward/mean"] == r["reward/mean"] for r in train)  # not NaN
    health = (out / "health.jsonl").read_text()
    assert "invalid_rewards" in health and "reward.on_invalid" in health
