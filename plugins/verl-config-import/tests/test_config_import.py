"""``verl config import``: verl and TRL configs as ours (issue 34), on the quick starts' own keys."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from verl_cli.cli import app
from verl_core.config import tomllib

# verl's PPO quick start (docs/start/quickstart.rst), as its command line gives it.
VERL_QUICKSTART = [
    "data.train_files=/data/gsm8k/train.parquet", "data.val_files=/data/gsm8k/test.parquet",
    "data.train_batch_size=256", "data.max_prompt_length=512", "data.max_response_length=256",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "critic.optim.lr=1e-5",
    "critic.model.path=Qwen/Qwen2.5-0.5B-Instruct", "critic.ppo_micro_batch_size_per_gpu=4",
    "algorithm.kl_ctrl.kl_coef=0.001", "trainer.logger=['console']", "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.save_freq=10", "trainer.test_freq=10",
    "trainer.total_epochs=15",
]

# verl's GRPO example (examples/grpo_trainer/run_qwen2-7b.sh), as YAML.
VERL_GRPO_YAML = """
data:
  train_files: [/data/gsm8k/train.parquet, /data/math/train.parquet]
  train_batch_size: 1024
  max_prompt_length: 512
  max_response_length: 1024
  filter_overlong_prompts: true
  truncation: error
actor_rollout_ref:
  model:
    path: Qwen/Qwen2-7B-Instruct
    use_remove_padding: true
    enable_gradient_checkpointing: true
  actor:
    optim: {lr: 1.0e-6}
    ppo_mini_batch_size: 256
    ppo_micro_batch_size_per_gpu: 40
    use_kl_loss: true
    kl_loss_coef: 0.001
    kl_loss_type: low_var_kl
    entropy_coeff: 0
    clip_ratio: 0.28
    loss_agg_mode: seq-mean-token-mean
  rollout:
    name: vllm
    n: 5
    gpu_memory_utilization: 0.6
algorithm:
  adv_estimator: grpo
  use_kl_in_reward: false
  kl_ctrl: {type: adaptive}
trainer:
  logger: [console, wandb]
  nnodes: 2
  n_gpus_per_node: 8
  total_epochs: 15
  device: cuda
"""


def _import(*args: str) -> tuple[str, dict]:
    res = CliRunner().invoke(app, ["config", "import", *args])
    assert res.exit_code == 0, res.output
    return res.output, tomllib.loads(res.output)


def test_verl_quickstart_overrides_map_with_the_same_meaning() -> None:
    out, cfg = _import(*VERL_QUICKSTART)
    assert cfg["data"] == {"train": "/data/gsm8k/train.parquet", "val": "/data/gsm8k/test.parquet",
                           "batch_size": 256, "max_prompt_length": 512}
    assert cfg["rollout"]["max_new_tokens"] == 256 and cfg["model"]["critic_path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg["algorithm"]["name"] == "ppo"  # verl's default estimator is GAE
    # 64 prompts per mini-batch x the 8 samples per prompt this run draws (the file sets no n).
    assert cfg["algorithm"]["mini_batch_size"] == 64 * 8 and cfg["algorithm"]["kl_coef"] == 0.001
    assert (cfg["backend"]["lr"], cfg["backend"]["critic_lr"], cfg["run"]["epochs"]) == (1e-6, 1e-5, 15)
    assert "executor" not in cfg  # one process: the local executor
    assert "critic.ppo_micro_batch_size_per_gpu = 4: no setting of this meaning here" in out
    assert "actor_rollout_ref.rollout.gpu_memory_utilization = 0.4: rollout.gpu_memory_utilization: the rollout " \
           "plugin here (the default) has no gpu_memory_utilization" in out
    assert '#   actor_rollout_ref.rollout.n: verl 1, here rollout.n = 8' in out
    assert "actor.clip_ratio" not in out.split("defaults that differ")[1]  # 0.2 in both: not a difference


def test_a_verl_grpo_yaml_maps_estimators_batches_and_nodes(tmp_path: Path) -> None:
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(VERL_GRPO_YAML)
    out, cfg = _import(str(path))
    alg = cfg["algorithm"]
    assert alg["name"] == "grpo" and alg["mini_batch_size"] == 256 * 5
    assert (alg["kl_coef"], alg["kl_in_reward"], alg["kl_estimator"]) == (0.001, False, "low_var_kl")
    assert alg["clip_ratio"] == 0.28  # which sets clip_ratio_low and clip_ratio_high (config.KEY_ALIASES)
    assert alg["loss_agg_mode"] == "seq-mean-token-mean"
    assert cfg["data"]["train"] == "/data/gsm8k/train.parquet" and "only the first of several files" in out
    assert cfg["data"]["overlong"] == "filter"
    assert cfg["rollout"] == {"name": "vllm", "n": 5, "max_new_tokens": 1024, "gpu_memory_utilization": 0.6}
    assert cfg["executor"] == {"nnodes": 2, "procs_per_node": 8, "name": "ray"}
    assert cfg["run"]["loggers"] == ["console", "wandb", "jsonl"]
    assert "algorithm.kl_ctrl.type = \"adaptive\": only a fixed KL coefficient" in out
    assert "trainer.device = \"cuda\": the device follows the executor" in out


def test_trl_grpo_and_ppo_configs_convert_batch_conventions(tmp_path: Path) -> None:
    grpo = tmp_path / "grpo.yaml"
    grpo.write_text("model_name_or_path: Qwen/Qwen2-0.5B-Instruct\noutput_dir: Qwen2-0.5B-GRPO\n"
                    "learning_rate: 1.0e-6\nper_device_train_batch_size: 16\ngradient_accumulation_steps: 4\n"
                    "num_generations: 8\nmax_completion_length: 256\nbeta: 0.04\nloss_type: dr_grpo\n"
                    "logging_steps: 10\nbf16: true\n")
    out, cfg = _import(str(grpo))
    assert cfg["data"]["batch_size"] == 16 * 4 // 8 and cfg["rollout"]["n"] == 8  # completions -> prompts
    assert cfg["algorithm"] == {"name": "grpo", "kl_coef": 0.04, "loss_agg_mode": "seq-mean-token-sum-norm"}
    assert cfg["backend"] == {"lr": 1e-6, "autocast": "bfloat16"}
    assert "logging_steps = 10: every step is logged here" in out
    assert 'lr_scheduler_type: TRL "linear", here backend.lr_schedule = "constant"' in out
    ppo = tmp_path / "ppo.json"
    ppo.write_text(json.dumps({"sft_model_path": "EleutherAI/pythia-1b-deduped", "learning_rate": 3e-6,
                               "per_device_train_batch_size": 64, "gradient_accumulation_steps": 1,
                               "total_episodes": 10000, "num_ppo_epochs": 4, "kl_coef": 0.05, "cliprange": 0.2,
                               "cliprange_value": 0.2, "vf_coef": 0.1, "response_length": 53}))
    out, cfg = _import(str(ppo))
    assert cfg["algorithm"]["name"] == "ppo" and cfg["algorithm"]["epochs"] == 4
    assert (cfg["data"]["batch_size"], cfg["run"]["max_steps"]) == (64, 10000 // 64)
    assert "vf_coef = 0.1: the critic has its own optimizer" in out


def test_verl_run_takes_a_verl_yaml_directly_and_prints_the_mapping(tmp_path: Path) -> None:
    from verl_core.testing import tiny_model_dir

    model = tiny_model_dir(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    path = tmp_path / "ppo_trainer.yaml"
    path.write_text(f"data:\n  train_files: {data}\n  train_batch_size: 2\nactor_rollout_ref:\n  model:\n"
                    f"    path: {model}\n  rollout:\n    n: 2\ntrainer:\n  default_local_dir: {tmp_path / 'run'}\n"
                    f"custom_reward_function:\n  path: null\n")
    res = CliRunner().invoke(app, ["config", "check", "-c", str(path), "reward.name=\"exact_match\""])
    assert res.exit_code == 0, res.output
    assert "imported a verl (ppo_trainer.yaml) config" in res.output and "data: 4 training prompts" in res.output
    assert "algorithm ppo" in res.output and "2 prompts x 2 samples per step" in res.output
    out = tmp_path / "ours.toml"
    res = CliRunner().invoke(app, ["config", "import", str(path), "-o", str(out)])
    assert res.exit_code == 0 and out.is_file() and "wrote" in res.output
    res = CliRunner().invoke(app, ["config", "import", str(path), "-o", str(out)])
    assert res.exit_code == 2 and "exists" in res.output


def test_verl_plugins_list_shows_the_verl_yaml_format() -> None:
    res = CliRunner().invoke(app, ["plugins", "list", "--kind", "config_format"])
    assert res.exit_code == 0, res.output
    row = next(line.split() for line in res.output.splitlines() if line.startswith("config_format"))
    assert row[1:3] == ["verl-yaml", "verl-config-import"] and row[-1] == "available"


def test_verl_validation_sampling_maps_only_when_verl_samples(tmp_path: Path) -> None:
    # verl validates greedily unless val_kwargs.do_sample is true, whatever temperature/top_p/top_k say.
    out, cfg = _import("actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                       "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
                       "actor_rollout_ref.rollout.val_kwargs.top_p=0.95",
                       "actor_rollout_ref.rollout.val_kwargs.top_k=20", "actor_rollout_ref.rollout.val_kwargs.n=4")
    assert {k: v for k, v in cfg["rollout"].items() if k.startswith("val_")} == {
        "val_temperature": 0.6, "val_top_p": 0.95, "val_top_k": 20, "val_n": 4}
    out, cfg = _import("actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
                       "actor_rollout_ref.rollout.val_kwargs.top_p=0.95")
    assert not any(k.startswith("val_") for k in cfg.get("rollout", {}))
    assert "val_kwargs.temperature = 0.6: val_kwargs.do_sample is not true, so verl validates greedily" in out
