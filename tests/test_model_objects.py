"""Runs given model objects (``Trainer(model=..., tokenizer=..., critic_model=...)``) and separate critics.

What a run records about objects it was given, the defaults it takes from them, resuming it, and
the critic starting from its own weights (``model.critic_path`` or ``critic_model=``) on the FSDP
backend. Tiny freshly initialised models (``verl_core.testing``), one or two steps.
"""

from __future__ import annotations

import json

import pytest
import torch

from verl_core.config import ConfigError, resolve_config
from verl_core.registry import PluginRegistry
from verl_core.trainer import Trainer

SMALL = {"data": {"batch_size": 4, "max_val_samples": 4}, "rollout": {"n": 2},
         "run": {"max_steps": 1, "loggers": [], "threads": 1, "val_before_train": False}}


def settings(tmp_path, **sections):
    raw = {k: dict(v) for k, v in SMALL.items()}
    raw["run"]["output_dir"] = str(tmp_path / "run")
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    """A tiny causal LM (64 positions) and its tokenizer, loaded as objects."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core.testing import tiny_model_dir

    path = tiny_model_dir(tmp_path_factory.mktemp("actor"))
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), path


def test_a_model_object_is_recorded_and_its_own_defaults_replace_the_builtin_preset(tmp_path, actor) -> None:
    model, tok, path = actor
    registry = PluginRegistry()
    cfg = resolve_config(settings(tmp_path), registry)  # model.path defaults to the built-in model ...
    assert cfg.backend.config.lr == 1e-4 and cfg.data.max_prompt_length == 16  # ... and its preset
    trainer = Trainer(cfg, registry=registry, model=model, tokenizer=tok)
    got = trainer.config
    assert got.model.path == f"<object: Qwen2ForCausalLM from {path!r}>"
    assert got.model.tokenizer.startswith("<object: ") and got.model.critic_path == ""
    # Not the built-in task's preset (lr 1e-4, 16-token prompts, 4 new tokens, 100 steps) ...
    assert got.backend.config.lr == 1e-6 and got.run.val_every == 10
    # ... but the defaults of an own model, with lengths that fit its 64 positions; the user's settings still win.
    assert (got.data.max_prompt_length, got.rollout.config.max_new_tokens) == (48, 16)
    assert got.run.max_steps == 1 and got.data.batch_size == 4
    assert got.profile.startswith("own model (") and "max_position_embeddings=64" in got.profile
    mine = Trainer(resolve_config(settings(tmp_path, rollout={"max_new_tokens": 8}), registry), model=model,
                   tokenizer=tok)
    assert (mine.config.data.max_prompt_length, mine.config.rollout.config.max_new_tokens) == (48, 8)
    with pytest.raises(ConfigError, match="model.tokenizer: a model given as an object needs its tokenizer"):
        Trainer(cfg, registry=registry, model=model).setup()


@pytest.mark.slow
def test_a_run_from_objects_records_them_and_resumes_from_its_own_copy(tmp_path, actor) -> None:
    model, tok, _ = actor
    registry = PluginRegistry()
    run = tmp_path / "run"
    Trainer(resolve_config(settings(tmp_path), registry), registry=registry, model=model, tokenizer=tok).train()
    source = f"<object: Qwen2ForCausalLM from {actor[2]!r}>"
    assert f'path = "{source}"' in (run / "config.toml").read_text()
    manifest = json.loads((run / "checkpoints" / "step_000001" / "manifest.json").read_text())
    assert manifest["info"]["model"] == source
    # Without the objects: the run's copy of them (written with save_pretrained when it started, #31).
    again = Trainer.from_checkpoint(run, ["run.max_steps=2"], registry=registry)
    again.train()
    assert again.resumed_from.name == "step_000001" and again.step == 2
    assert again.model_spec.path == str(run / "model")
    # Objects passed again still win over the copy.
    resumed = Trainer.from_checkpoint(run, ["run.max_steps=3"], registry=registry, model=model, tokenizer=tok)
    resumed.train()
    assert resumed.resumed_from.name == "step_000002" and resumed.step == 3 and resumed.model_spec.module is model


def _critic_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.critic.iter_weights()}


@pytest.mark.slow
def test_the_critic_starts_from_its_own_weights(tmp_path, actor) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from verl_core.testing import tiny_reward_model_dir, tiny_text_model_dir

    model, tok, _ = actor
    registry = PluginRegistry()
    # A directory with a one-label score head (here a reward model, hidden size 32 against the actor's 128): kept.
    scorer_dir = tiny_reward_model_dir(tmp_path / "rm")
    scorer = AutoModelForSequenceClassification.from_pretrained(scorer_dir)
    cfg = resolve_config(settings(tmp_path, algorithm={"name": "ppo"}, model={"critic_path": scorer_dir}), registry)
    trainer = Trainer(cfg, registry=registry, model=model, tokenizer=tok)
    trainer.setup()
    try:
        weights = _critic_weights(trainer)
        assert torch.equal(weights["score.weight"], scorer.score.weight) and weights["score.weight"].abs().sum() > 0
        assert torch.equal(weights["score.bias"], torch.zeros(1))
        assert weights["model.embed_tokens.weight"].shape[1] == 32
        assert trainer.critic_spec.path == scorer_dir and trainer.model_spec.module is model
    finally:
        trainer.executor.shutdown()
    # An object that is a causal LM: its backbone, with a new value head at zero; it trains, and is recorded.
    backbone = AutoModelForCausalLM.from_pretrained(tiny_text_model_dir(tmp_path / "lm"))
    cfg = resolve_config(settings(tmp_path, algorithm={"name": "ppo"}), registry)
    trainer = Trainer(cfg, registry=registry, model=model, tokenizer=tok, critic_model=backbone)
    trainer.setup()
    weights = _critic_weights(trainer)
    assert torch.equal(weights["model.embed_tokens.weight"], backbone.model.embed_tokens.weight)
    assert weights["score.weight"].abs().sum() == 0
    metrics = trainer.train()
    assert "critic/value_loss" in metrics
    assert trainer.config.model.critic_path.startswith("<object: Qwen2ForCausalLM")
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "manifest.json").read_text())
    assert manifest["info"]["critic"] == trainer.config.model.critic_path
    # Resumed without the critic object: from the run's copy of it (#31).
    resumed = Trainer.from_checkpoint(tmp_path / "run", ["run.max_steps=2"], registry=registry, model=model,
                                      tokenizer=tok)
    resumed.setup()
    try:
        assert resumed.critic_spec.path == str(tmp_path / "run" / "critic_model")
    finally:
        resumed.executor.shutdown()


def test_a_critic_for_an_algorithm_without_one_is_refused(tmp_path, actor) -> None:
    model, tok, path = actor
    registry = PluginRegistry()
    cfg = resolve_config(settings(tmp_path, model={"critic_path": path}), registry)  # grpo: no critic
    with pytest.raises(ConfigError, match="model.critic_path: algorithm 'grpo' trains no critic"):
        Trainer(cfg, registry=registry, model=model, tokenizer=tok).setup()
    cfg = resolve_config(settings(tmp_path, algorithm={"name": "ppo"},
                                  model={"critic_path": str(tmp_path / "nowhere")}), registry)
    with pytest.raises(ConfigError, match="model.critic_path: .* does not exist"):
        Trainer(cfg, registry=registry, model=model, tokenizer=tok).setup()
