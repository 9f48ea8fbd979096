"""An engine that can free its memory sleeps while the step trains and is awake for the sync.

The trainer drives it: the rollout stage releases the engine after generating, the trainer wakes it
before the closing weight sync, and also when the step fails, so nothing after a failure finds a
sleeping engine. (vLLM's sleep mode only frees memory on a GPU; the calls are recorded here on the
real HF rollout of a real run.)
"""

import json

import pytest

FAST = ["data.batch_size=8", "rollout.n=2", "data.max_val_samples=8", "run.val_every=0", "run.threads=1",
        "run.val_before_train=false", "run.save_every=0", 'run.loggers=["jsonl"]']


def _trainer(tmp_path, steps):
    from verl_core.trainer import Trainer

    trainer = Trainer.from_config(overrides=[*FAST, f"run.max_steps={steps}",
                                             f"run.output_dir={json.dumps(str(tmp_path))}"])
    trainer.setup()
    calls = []
    engine = trainer.rollout
    engine.supports_memory_release = True  # as vLLM with enable_sleep_mode on a GPU
    engine.release_memory = lambda: calls.append("release")
    engine.reacquire_memory = lambda: calls.append("reacquire")
    generate = engine.generate
    engine.generate = lambda *a, **k: calls.append("generate") or generate(*a, **k)
    return trainer, calls


@pytest.mark.slow
def test_the_engine_sleeps_during_the_update_and_wakes_for_the_sync(tmp_path):
    trainer, calls = _trainer(tmp_path, 2)
    trainer.train()
    # Two steps, then the final validation on an awake engine.
    assert calls == ["generate", "release", "reacquire", "generate", "release", "reacquire", "generate"]


@pytest.mark.slow
def test_a_failed_step_leaves_the_engine_awake(tmp_path):
    trainer, calls = _trainer(tmp_path, 1)

    def broken_update(*args, **kwargs):
        raise RuntimeError("update failed")

    trainer.actor.update_policy = broken_update
    with pytest.raises(RuntimeError, match="update failed"):
        trainer.train()
    assert calls == ["generate", "release", "reacquire"]
