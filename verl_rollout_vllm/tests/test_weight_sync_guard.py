"""The weight-sync guard on the real vLLM engine: one corrupted tensor in a sync stops the run."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _trainer(tmp_path, **extra):
    from verl_core.trainer import Trainer

    overrides = ['rollout.name="vllm"', "rollout.kv_cache_gb=0.25", "rollout.max_model_len=64", "run.max_steps=4",
                 f"run.output_dir={json.dumps(str(tmp_path))}", "run.val_before_train=false", "run.val_every=0",
                 "run.save_every=1", 'run.loggers=["jsonl"]', "data.batch_size=8", "rollout.n=4",
                 *[f"{k}={v}" for k, v in extra.items()]]
    return Trainer.from_config(overrides=overrides)


def _corrupt_from_step(trainer, step, tensor="model.layers.0.self_attn.v_proj.weight"):
    """From ``step``'s closing sync on, ``tensor`` reaches the engine scaled by 1.1."""
    from verl_core.hooks import hookimpl

    worker = trainer.actor.worker
    original = worker.iter_weights

    def corrupted():
        for name, value in original():
            yield name, value * 1.1 if name == tensor else value

    class Breaker:
        @hookimpl
        def verl_step_start(self, step: int) -> None:
            if step == broken_from:
                worker.iter_weights = corrupted

    broken_from = step
    trainer.hooks.register(Breaker())


def test_a_corrupted_tensor_stops_the_next_step_before_it_trains(tmp_path):
    from verl_core.rollout_utils import WeightSyncError

    trainer = _trainer(tmp_path)
    trainer.setup()
    _corrupt_from_step(trainer, 2)
    with pytest.raises(WeightSyncError) as excinfo:
        trainer.train()
    message = str(excinfo.value)
    assert "RL step 3" in message and "'vllm'" in message and "weight sync after step 2" in message
    assert "rollout.max_log_prob_gap=0.001" in message
    # Steps 1 and 2 trained and were saved; step 3 never trained, so nothing of it was saved.
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert checkpoints[-1] == "step_000002"
    gaps = [json.loads(line).get("rollout/log_prob_diff_mean") for line in (tmp_path / "metrics.jsonl").open()]
    gaps = [g for g in gaps if g is not None]
    assert len(gaps) == 2 and max(gaps) < 1e-5  # the healthy steps sat near the fp32 floor


def test_warn_mode_keeps_training_and_records_the_gap(tmp_path):
    trainer = _trainer(tmp_path, **{"rollout.log_prob_gap_action": '"warn"', "run.max_steps": 3,
                                    "run.save_every": 0})
    trainer.setup()
    _corrupt_from_step(trainer, 2)
    trainer.train()
    gaps = [json.loads(line).get("rollout/log_prob_diff_mean") for line in (tmp_path / "metrics.jsonl").open()]
    gaps = [g for g in gaps if g is not None]
    assert len(gaps) == 3 and gaps[2] > 1e-3 > max(gaps[:2])


def test_partial_rollouts_check_the_engine_right_after_each_sync(tmp_path):
    """A partial step trains carried samples of older weights, which its own check skips; the engine is checked
    right after each sync instead, so a corrupt sync stops the run before anything trains on what it samples."""
    from verl_core.rollout_utils import WeightSyncError

    trainer = _trainer(tmp_path, **{"trainer.mode": '"partial"', "trainer.token_budget": 2})
    trainer.setup()
    _corrupt_from_step(trainer, 2)
    with pytest.raises(WeightSyncError, match="RL step 3: .* since the weight sync after step 2"):
        trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    trained = [r for r in rows if "actor/grad_norm" in r]
    # Step 2 trained and was reported and saved; the check of its closing sync stopped step 3 before it trained.
    assert [r["step"] for r in trained] == [1, 2] and trained[1]["rollout/log_prob_diff_mean"] < 1e-5
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))[-1] == "step_000002"

    # trainer.sync_check_every = 0 turns the check off: the same corrupt sync trains every step, unseen.
    off = _trainer(tmp_path / "off", **{"trainer.mode": '"partial"', "trainer.token_budget": 2,
                                        "trainer.sync_check_every": 0})
    off.setup()
    _corrupt_from_step(off, 2)
    off.train()
    rows = [json.loads(line) for line in (tmp_path / "off" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "actor/grad_norm" in r] == [1, 2, 3, 4]
