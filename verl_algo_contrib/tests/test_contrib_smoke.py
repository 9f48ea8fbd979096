"""Every contributed algorithm runs a few steps of the built-in task through the real training loop.

The RL algorithms train on ``builtin:addition``; the offline preference algorithms train on pairs
derived from it (:func:`verl_algo_contrib.data.write_addition_preferences`) and validate on the
task's test split. Each run must finish, write its metrics for every step, validate before and
after, and show something only that algorithm's own code does - proof it was really used:

* a metric only its code emits (DAPO's overlong penalty, GSPO's sequence ratio, ...), or the shape of
  its step (GPG: no old log-prob pass and no clipping statistics);
* for the algorithms that differ from GRPO only in their advantage estimator (RLOO, Dr. GRPO, OPO)
  and so emit no metric of their own, the advantages of the real run's batches, recorded as the
  run computes them, against the estimator's formula computed here by hand.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from verl_algo_contrib.data import write_addition_preferences

# Small but real: the default model, backend and rollout, fewer prompts.
SMALL = {"data.batch_size": 8, "rollout.n": 4, "data.max_val_samples": 16, "run.threads": 1, "run.val_every": 0}
FAST = ["--max-steps", "2", *(f"{k}={v}" for k, v in SMALL.items())]


def has(metric):
    def check(row):
        assert metric in row, f"{metric} missing: {sorted(row)}"
    return check


def gpg_step(row):
    # GPG's loss has no ratio: no old log-probs are computed and nothing is clipped.
    assert "timing/advantages" in row and "timing/old_log_probs" not in row, sorted(row)
    assert "ppo/clip_frac" not in row and "ppo/pg_loss" in row, sorted(row)


# name -> (extra arguments, a check on each training step's metrics)
CASES = {
    # A budget of 8 tokens and a 3-token buffer switch DAPO's overlong shaping on.
    "dapo": (["rollout.max_new_tokens=8", "algorithm.overlong_buffer_len=3", "algorithm.max_extra_rounds=2"],
             has("dapo/overlong_penalty_mean")),
    "gspo": ([], has("ppo/seq_ratio_mean")),
    "reinforce_pp": ([], has("ppo/kl_in_reward")),
    "reinforce_pp_baseline": ([], has("ppo/kl_loss")),
    "remax": ([], has("baseline/greedy_reward_mean")),
    "cispo": ([], has("ppo/is_weight_mean")),
    "clip_cov": ([], has("ppo/cov_detached_frac")),
    "kl_cov": ([], has("ppo/cov_penalised_frac")),
    "gpg": ([], gpg_step),
    "spin": ([], has("spin/pairs")),
    "dpo": (["PAIRS"], has("preference/accuracy")),
    "kto": (["UNARY"], has("kto/kl_reference")),
    "orpo": (["PAIRS"], has("orpo/nll")),
}


def check_run(out, name):
    assert f'name = "{name}"' in (out / "config.toml").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "ppo/actor_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert math.isfinite(r["ppo/actor_loss"]), r
    val = [r for r in rows if "val/reward_mean" in r]
    assert [r["step"] for r in val] == [0, 2]
    assert 0.0 <= val[-1]["val/reward_mean"] <= 1.0
    return train


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_algorithm_runs_through_the_cli(name, tmp_path, run_verl):
    extra, check = CASES[name]
    if extra and extra[0] in ("PAIRS", "UNARY"):
        data = write_addition_preferences(tmp_path / "prefs.jsonl", rows=64, unary=extra[0] == "UNARY")
        extra = ["--data", str(data), 'data.val="builtin:addition"']
    out = tmp_path / "run"
    res = run_verl("run", "--algo", name, "--output-dir", str(out), *FAST, *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    for row in check_run(out, name):
        check(row)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dpo", "kto", "orpo"])
def test_preference_algorithms_run_on_the_builtin_task_with_no_data_of_their_own(name, tmp_path, run_verl):
    """``verl run --algo dpo``: the algorithm asks for preference pairs, builtin:addition derives them."""
    out = tmp_path / "run"
    res = run_verl("run", "--algo", name, "--output-dir", str(out), *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    assert 'train = "builtin:addition"' in (out / "config.toml").read_text()
    for row in check_run(out, name):
        CASES[name][1](row)


# ----------------------------------------------------------------------------- estimators on real batches
def group_baselines(rewards, lengths, groups, name):
    """The baseline each sample's reward is compared with, by the estimator's definition."""
    out = torch.zeros_like(rewards)
    for g in groups.unique():
        idx = (groups == g).nonzero().flatten()
        r, n = rewards[idx], len(idx)
        if n < 2:
            out[idx] = r  # a lone sample gets advantage 0
        elif name == "rloo":  # the mean of the *other* samples (Kool et al. 2019)
            out[idx] = (r.sum() - r) / (n - 1)
        elif name == "drgrpo":  # the group mean, nothing divided by a standard deviation
            out[idx] = r.mean()
        elif name == "opo":  # the length-weighted group mean (Hao et al. 2025)
            l = lengths[idx]
            out[idx] = (l * r).sum() / l.sum() if l.sum() > 0 else r
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rloo", "drgrpo", "opo"])
def test_advantages_of_a_real_run_follow_the_estimator(name, tmp_path, monkeypatch):
    """A 2-step run of the real trainer (what ``verl run --algo NAME`` builds), watching its advantages."""
    from verl_core.registry import PluginRegistry
    from verl_core.trainer import Trainer

    cls = PluginRegistry().load("algorithm", name)
    seen = []
    original = cls.compute_advantages

    def recording(self, batch):
        advantages, returns = original(self, batch)
        seen.append((batch, advantages.detach().clone()))
        return advantages, returns

    monkeypatch.setattr(cls, "compute_advantages", recording)
    out = tmp_path / "run"
    overrides = [f"algorithm.name={name}", "run.max_steps=2", f"run.output_dir={json.dumps(str(out))}",
                 *(f"{k}={v}" for k, v in SMALL.items())]
    Trainer.from_config(None, overrides).train()
    check_run(out, name)

    assert len(seen) == 2, "one advantage computation per step"
    informative = 0
    for batch, advantages in seen:
        mask = batch.response_mask.float()
        lengths = mask.sum(-1)
        rows = lengths > 0
        rewards = (batch.token_rewards * mask).sum(-1)  # no KL term by default: the scores
        expected = rewards - group_baselines(rewards, lengths, batch.group_ids, name)
        per_sample = advantages.sum(-1) / lengths.clamp(min=1)
        assert torch.allclose(per_sample[rows], expected[rows], atol=1e-5), (per_sample, expected)
        assert (advantages[mask == 0] == 0).all()
        informative += int((expected[rows].abs() > 1e-6).sum())
    # Groups with different rewards make the formulas differ (RLOO = n / (n - 1) x Dr. GRPO's, ...).
    assert informative > 0, "no group had different rewards in 2 steps; the check compared only zeros"
