"""``from verl import PPOTrainer, GRPOTrainer, DataConfig``: the article-shaped API over the core Trainer.

Tiny freshly initialised models (``verl_core.testing``), a few addition prompts, one or two steps;
datasets from a jsonl file, a ``save_to_disk`` directory and a Hub id served offline from the
``datasets`` cache.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from verl_core.contracts import CheckpointError
from verl_core.config import ConfigError

ROWS = [{"text": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((12, 34), (50, 7), (23, 23), (81, 9), (40, 44),
                                                                 (15, 60), (33, 11), (70, 21))]
# One thread, no console output, a small rollout; the rest is what the articles pass.
QUIET = ["run.threads=1", "run.loggers=[]", "rollout.n=2", "run.val_before_train=false"]


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    """The actor and its tokenizer, and a critic of another size (hidden 32 vs 128), all loaded objects."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_core.testing import tiny_model_dir, tiny_text_model_dir

    root = tmp_path_factory.mktemp("models")
    actor_dir = tiny_model_dir(root)
    critic = AutoModelForCausalLM.from_pretrained(tiny_text_model_dir(root))
    return AutoModelForCausalLM.from_pretrained(actor_dir), critic, AutoTokenizer.from_pretrained(actor_dir), actor_dir


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_the_names_import_from_verl_and_each_argument_is_one_config_key(tmp_path, objects, prompts) -> None:
    import verl
    from verl import DataConfig, GRPOTrainer, PPOTrainer

    assert {"PPOTrainer", "GRPOTrainer", "DataConfig"} <= set(dir(verl))
    model, critic, tok, _ = objects
    data = DataConfig(dataset_name=str(prompts), prompt_column="text", max_prompt_length=40)
    trainer = PPOTrainer(actor_model=model, critic_model=critic, tokenizer=tok, data_config=data,
                         learning_rate=1e-6, batch_size=4, kl_coef=0.001, reward="arithmetic",
                         output_dir=tmp_path / "run", overrides=QUIET)
    cfg = trainer.config
    assert cfg.algorithm.name == "ppo" and cfg.algorithm.config.kl_coef == 0.001
    assert (cfg.backend.config.lr, cfg.data.batch_size, cfg.reward.config.name) == (1e-6, 4, "arithmetic")
    assert (cfg.data.train, cfg.data.prompt_key, cfg.data.max_prompt_length) == (str(prompts), "text", 40)
    assert cfg.model.path.startswith("<object: Qwen2ForCausalLM") and cfg.model.critic_path.startswith("<object: ")
    assert cfg.run.output_dir == str(tmp_path / "run") and trainer.run_dir == tmp_path / "run"
    # Settings are checked when the trainer is made, before any model loads.
    with pytest.raises(ConfigError, match="model.critic_path: GRPOTrainer \\(grpo\\) trains no critic"):
        GRPOTrainer(actor_model=model, critic_model=critic, tokenizer=tok)
    with pytest.raises(ConfigError, match="rollout.nn: unknown key"):
        GRPOTrainer(actor_model=model, tokenizer=tok, overrides=["rollout.nn=2"])
    with pytest.raises(CheckpointError, match="has no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)


@pytest.mark.slow
def test_ppo_from_objects_with_its_own_critic_trains_an_epoch_and_continues_from_a_checkpoint(
        tmp_path, objects, prompts) -> None:
    from verl import DataConfig, PPOTrainer

    model, critic, tok, _ = objects
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = PPOTrainer(actor_model=model, critic_model=critic, tokenizer=tok,
                         data_config=DataConfig(dataset_name=str(prompts), prompt_column="text", max_prompt_length=40),
                         learning_rate=1e-6, batch_size=4, kl_coef=0.001, reward="arithmetic",
                         output_dir=tmp_path / "run", overrides=QUIET)
    metrics = trainer.train(num_epochs=1)
    assert trainer.trainer.step == 2  # 8 prompts, 4 per step
    assert "critic/value_loss" in metrics and "actor/ref_kl" in metrics
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    # The critic is the one given (hidden size 32), not a copy of the actor (128).
    shapes = torch.load(ckpt / "critic" / "extra_rank0.pt", weights_only=False)["shapes"]
    assert shapes["model.embed_tokens.weight"][1] == 32 and shapes["score.weight"] == [1, 32]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the caller's model untouched

    # The run saved the objects into its directory: the checkpoint path alone rebuilds actor, critic, tokenizer.
    alone = PPOTrainer.from_checkpoint(ckpt)
    assert (alone.config.model.path, alone.config.model.critic_path) == (str(run / "model"), str(run / "critic_model"))
    assert json.loads((run / "critic_model" / "config.json").read_text())["hidden_size"] == 32
    # Objects passed again are used instead of the copies; epochs count in total.
    again = PPOTrainer.from_checkpoint(ckpt, actor_model=model, critic_model=critic, tokenizer=tok)
    assert again.config.model.path.startswith("<object: ") and again.config.model.tokenizer.startswith("<object: ")
    again.train(num_epochs=2, resume_from_checkpoint=True)
    assert again.trainer.resumed_from == ckpt and again.trainer.step == 4
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000004"
    from verl import GRPOTrainer

    with pytest.raises(ConfigError, match="is a 'ppo' run, not 'grpo'"):
        GRPOTrainer.from_checkpoint(run, actor_model=model, tokenizer=tok)  # a run directory: its latest


@pytest.mark.slow
def test_the_seed_flow_continues_from_the_checkpoint_path_alone_after_the_model_directory_is_deleted(
        tmp_path, prompts, run_verl) -> None:
    """Issue 31's "done when": train, delete the model directory, continue from the path alone, export."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl import DataConfig, PPOTrainer
    from verl_core.testing import tiny_model_dir

    models = tmp_path / "models"
    model_dir = Path(tiny_model_dir(models))
    initial = load_file(model_dir / "model.safetensors")
    template = AutoTokenizer.from_pretrained(model_dir).chat_template
    run = tmp_path / "run"
    trainer = PPOTrainer(actor_model=str(model_dir), tokenizer=str(model_dir),
                         data_config=DataConfig(dataset_name=str(prompts), prompt_column="text", max_prompt_length=40),
                         learning_rate=1e-4, batch_size=4, reward="arithmetic", output_dir=run,
                         # An untrained model earns no reward: the entropy bonus is what moves its weights.
                         overrides=[*QUIET, "algorithm.entropy_coef=0.01"])
    trainer.train(num_epochs=1)
    ckpt = run / "checkpoints" / "step_000002"
    assert trainer.trainer.step == 2 and ckpt.is_dir()
    config_toml = (run / "config.toml").read_bytes()
    shutil.rmtree(models)

    again = PPOTrainer.from_checkpoint(ckpt)
    assert (again.config.model.path, again.config.model.tokenizer) == (str(run / "model"), str(run / "model"))
    again.train(num_epochs=2, resume_from_checkpoint=True)
    assert again.trainer.resumed_from == ckpt and again.trainer.step == 4
    assert (run / "config.toml").read_bytes() == config_toml  # the resume check took model/ for the model
    (segment,) = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
    assert segment["checkpoint"] == "step_000002" and not segment["forced"]

    # The same script run again (its model path now gone) continues from the run's copy.
    script = PPOTrainer(actor_model=str(model_dir), tokenizer=str(model_dir),
                        data_config=DataConfig(dataset_name=str(prompts), prompt_column="text", max_prompt_length=40),
                        learning_rate=1e-4, batch_size=4, reward="arithmetic", output_dir=run,
                        overrides=[*QUIET, "algorithm.entropy_coef=0.01"])
    script.train(num_epochs=3)
    assert script.trainer.resumed_from == run / "checkpoints" / "step_000004" and script.trainer.step == 6
    assert script.trainer.model_spec.path == str(run / "model")

    res = run_verl("export", str(run), str(tmp_path / "hf"))
    assert res.returncode == 0, res.stderr[-2000:]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == template
    trained = exported.state_dict()
    assert trained.keys() >= initial.keys()
    assert any(not torch.equal(trained[k], v) for k, v in initial.items())  # step 4's weights, not the start's


def _cache_hub_dataset(cache: Path, repo_id: str, rows: list[dict]) -> None:
    """Put ``rows`` into the ``datasets`` cache as ``load_dataset(repo_id)`` leaves them after a download."""
    from datasets.packaged_modules.json.json import Json

    source = cache / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    name = repo_id.split("/")[1]
    Json(cache_dir=str(cache / "build"), dataset_name=name, config_name="default",
         data_files={"train": str(source)}).download_and_prepare()
    built = next((cache / "build" / name).glob("default*/0.0.0"))
    shutil.copytree(built, cache / repo_id.replace("/", "___") / "default" / "0.0.0" / "cached")


@pytest.mark.slow
def test_grpo_reads_a_saved_dataset_directory_and_a_hub_id_offline(tmp_path, objects, monkeypatch) -> None:
    import datasets
    import huggingface_hub.constants

    from verl import DataConfig, GRPOTrainer

    _, _, _, actor_dir = objects
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    cache = tmp_path / "hf-datasets"
    cache.mkdir()
    _cache_hub_dataset(cache, "someone/addition-prompts", ROWS)
    # No network: the libraries read these switches at import time, so set the parsed values.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    for name, source in (("saved", str(saved)), ("hub", "someone/addition-prompts")):
        trainer = GRPOTrainer(actor_model=actor_dir, data_config=DataConfig(dataset_name=source, prompt_column="text"),
                              batch_size=4, reward="arithmetic", output_dir=tmp_path / name, overrides=QUIET)
        trainer.train(max_steps=1)
        assert trainer.trainer.step == 1 and len(trainer.trainer.train_rows) == len(ROWS), name
        assert trainer.config.model.path == actor_dir  # a path stays a path
