"""The ``samples`` and ``health`` hook plugins: unit cases, then real short runs read back (samples files,
health warnings, and both left out with run.disable_hooks)."""

import json
from types import SimpleNamespace

import pytest
import torch

from verl_core.batch import Batch
from verl_core.config import ConfigError
from verl_loggers.health import HealthMonitor, flat_group_fraction
from verl_loggers.samples import spread

FAST = ["data.batch_size=8", "rollout.n=4", "data.max_val_samples=24", "run.threads=1"]


def test_spread_picks_evenly_and_all_for_minus_one():
    assert spread(10, 3) == [0, 3, 6]
    assert spread(4, -1) == [0, 1, 2, 3]
    assert spread(4, 9) == [0, 1, 2, 3]
    assert spread(5, 0) == []


def _batch(scores, groups):
    n = len(scores)
    ones = torch.ones(n, 2, dtype=torch.long)
    return Batch(prompt_ids=ones, prompt_mask=ones, response_ids=ones, response_attention_mask=ones,
                 response_mask=ones, group_ids=torch.tensor(groups), scores=torch.tensor(scores))


def test_flat_group_fraction_counts_groups_with_one_reward():
    assert flat_group_fraction(_batch([1.0, 1.0, 0.0, 1.0], [0, 0, 1, 1])) == 0.5
    assert flat_group_fraction(_batch([0.0, 0.0, 0.0, 0.0], [0, 0, 1, 1])) == 1.0


def _run(**changes):
    base = dict(health_flat_steps=2, health_max_kl=0.5, val_every=10, val_before_train=True)
    return SimpleNamespace(**{**base, **changes})


def test_health_checks_fire_once_per_episode_and_again_after_recovery():
    monitor = HealthMonitor(_run(), max_log_prob_gap=0.01)
    assert monitor.observe(0, {"data/val_prompts": 0.0})[0][0] == "no_validation"
    assert monitor.observe(1, {"reward/flat_group_frac": 1.0}) == []  # one flat step is not yet a streak
    assert [c for c, _ in monitor.observe(2, {"reward/flat_group_frac": 1.0})] == ["flat_rewards"]
    assert monitor.observe(3, {"reward/flat_group_frac": 1.0}) == []  # said once
    assert monitor.observe(4, {"reward/flat_group_frac": 0.5}) == []
    checks = [c for c, _ in monitor.observe(5, {"response_length/clip_frac": 1.0, "ppo/kl_divergence": 0.7,
                                               "rollout/log_prob_diff_mean": 0.02})]
    assert checks == ["all_truncated", "kl", "weight_sync_gap"]
    assert monitor.observe(6, {"ppo/kl_divergence": 0.1}) == []
    assert [c for c, _ in monitor.observe(7, {"ppo/kl_divergence": 0.9})] == ["kl"]  # recovered, then again


def test_health_thresholds_at_zero_turn_checks_off():
    monitor = HealthMonitor(_run(health_flat_steps=0, health_max_kl=0.0, val_every=0, val_before_train=False))
    for step in range(5):
        assert monitor.observe(step, {"reward/flat_group_frac": 1.0, "ppo/kl_divergence": 50.0,
                                      "data/val_prompts": 0.0, "rollout/log_prob_diff_mean": 9.0}) == []


@pytest.mark.parametrize("key, value", [("val_samples", -2), ("train_samples", -1), ("health_max_kl", -1.0)])
def test_bad_sample_and_health_settings_name_their_key(key, value):
    from verl_core.config import resolve_config
    from verl_core.registry import PluginRegistry

    with pytest.raises(ConfigError, match=f"run.{key}"):
        resolve_config({"run": {key: value}}, PluginRegistry())


@pytest.mark.slow
def test_a_real_run_writes_its_samples_status_and_health(tmp_path, capsys):
    from verl_core.trainer import Trainer

    out = tmp_path / "run"
    # One new token at most: every response is cut off, so the all_truncated health check must fire.
    trainer = Trainer.from_config(overrides=[*FAST, "run.max_steps=2", "run.val_every=1", "run.train_samples=3",
                                             "rollout.max_new_tokens=1", f"run.output_dir='{out}'"])
    trainer.train()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val_means = {r["step"]: r["val/reward_mean"] for r in rows if "val/reward_mean" in r}
    assert sorted(val_means) == [0, 1, 2]
    for step, mean in val_means.items():
        samples = [json.loads(line) for line in (out / "samples" / f"val_step_{step}.jsonl").read_text().splitlines()]
        assert len(samples) == 24  # run.val_samples = -1: all of them
        assert {s["step"] for s in samples} == {step} and {s["split"] for s in samples} == {"val"}
        # The file holds what was scored: its rewards average to the logged validation reward.
        assert sum(s["reward"] for s in samples) / len(samples) == pytest.approx(mean, abs=1e-6)
        assert all(s["prompt"].endswith("=") and s["ground_truth"] for s in samples)
        assert all(s["response_tokens"] <= 1 and s["finish_reason"] in ("stop", "length") for s in samples)
    train = [json.loads(line) for line in (out / "samples" / "train.jsonl").read_text().splitlines()]
    assert [s["step"] for s in train] == [1, 1, 1, 2, 2, 2]
    assert len({s["group"] for s in train if s["step"] == 1}) == 3  # spread over the groups, not one prompt's
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "completed" and status["error"] is None and status["step"] == 2
    health = [json.loads(line) for line in (out / "health.jsonl").read_text().splitlines()]
    assert "all_truncated" in {h["check"] for h in health}
    assert "warning (step 1, all_truncated)" in capsys.readouterr().out


@pytest.mark.slow
def test_val_samples_caps_the_file_and_zero_writes_none(tmp_path):
    from verl_core.trainer import Trainer

    out = tmp_path / "run"
    trainer = Trainer.from_config(overrides=[*FAST, "run.max_steps=1", "run.val_samples=5", "run.train_samples=0",
                                             "run.val_before_train=false", f"run.output_dir='{out}'"])
    trainer.train()
    samples = [json.loads(line) for line in (out / "samples" / "val_step_1.jsonl").read_text().splitlines()]
    assert [s["index"] for s in samples] == [0, 4, 9, 14, 19]
    assert not (out / "samples" / "train.jsonl").exists()


def test_both_are_installed_hook_plugins():
    from verl_core.registry import PluginRegistry

    assert {"health", "samples"} <= set(PluginRegistry().names("hook"))


@pytest.mark.slow
def test_run_disable_hooks_leaves_samples_and_health_out(tmp_path, capsys):
    from verl_core.trainer import Trainer

    out = tmp_path / "run"
    # Every response cut off (all_truncated would fire) and samples asked for: neither plugin runs.
    trainer = Trainer.from_config(overrides=[*FAST, "run.max_steps=1", "rollout.max_new_tokens=1",
                                             "run.disable_hooks=['health', 'samples']", f"run.output_dir='{out}'"])
    trainer.train()
    assert not list((out / "samples").glob("*.jsonl")) and not (out / "health.jsonl").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("ppo/actor_loss" in r for r in rows) and not any("reward/flat_group_frac" in r for r in rows)
    assert "warning (step" not in capsys.readouterr().out


@pytest.mark.slow
def test_a_run_without_a_test_split_warns_that_validation_is_skipped(tmp_path, capsys):
    from verl_core.trainer import Trainer
    from verl_task_arithmetic.addition import make_dataset

    train, _ = make_dataset(seed=0)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in train[:16]))
    out = tmp_path / "run"
    trainer = Trainer.from_config(overrides=["data.batch_size=8", "rollout.n=2", "run.threads=1", "run.max_steps=1",
                                             f"data.train='{data}'", f"run.output_dir='{out}'"])
    trainer.train()
    [warning] = [json.loads(line) for line in (out / "health.jsonl").read_text().splitlines()]
    assert warning["check"] == "no_validation" and warning["step"] == 0
    assert "warning (step 0, no_validation): validation skipped" in capsys.readouterr().out
    assert not list((out / "samples").glob("val_step_*"))


@pytest.mark.slow
def test_samples_of_an_environment_run_carry_the_transcript_with_its_tool_calls(tmp_path, run_verl):
    pytest.importorskip("verl_env_tools")
    out = tmp_path / "run"
    res = run_verl("run", "--env", "tools", "--output-dir", str(out), "run.max_steps=1", "data.batch_size=4",
                   "rollout.n=2", "data.max_val_samples=4", "run.threads=1", "run.val_before_train=false")
    assert res.returncode == 0, res.stderr[-3000:]
    for name, count in (("train.jsonl", 4), ("val_step_1.jsonl", 4)):
        samples = [json.loads(line) for line in (out / "samples" / name).read_text().splitlines()]
        assert len(samples) == count, name
        for s in samples:
            roles = [m["role"] for m in s["transcript"]]
            assert roles[0] == "user" and roles[-1] == "assistant", roles
            # A tool's answer in the transcript follows the assistant turn that called it.
            for i, role in enumerate(roles):
                if role == "tool":
                    assert roles[i - 1] == "assistant" and "<tool_call>" in s["transcript"][i - 1]["content"]
        assert any(m["role"] == "tool" for s in samples for m in s["transcript"]), name
