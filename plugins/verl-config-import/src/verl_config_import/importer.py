"""``verl config import``: a verl ``ppo_trainer.yaml``-style config or a TRL ``GRPOConfig``/``PPOConfig``
as our TOML, with a report of how each key was mapped.

Each key of theirs maps to ours with the same meaning or is listed with why it has none. Where the two
count differently the value is converted: verl's ``ppo_mini_batch_size`` counts prompts and ours samples
(times ``rollout.n``); TRL's ``per_device_train_batch_size`` counts completions per device and ours prompts
per step. KL estimator and loss-aggregation names are translated. The report ends with the defaults of
theirs that differ from ours for keys the file does not set, so a run does not change silently.

:class:`VerlYamlFormat` serves it to the ``verl`` command as the ``verl-yaml`` config format
(:class:`verl_core.contracts.ConfigFormat`): ``verl run -c ppo_trainer.yaml`` and ``verl config import``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from verl_core.config import ConfigError, parse_value
from verl_core.contracts import ConfigFormat

__all__ = ["ImportReport", "VerlYamlFormat", "import_config", "read_foreign", "detect_format", "flatten"]


@dataclass
class ImportReport:
    """What :func:`import_config` made: our raw config and how every key got there."""

    format: str
    raw: dict[str, dict[str, Any]] = field(default_factory=dict)
    mapped: list[tuple[str, Any, str, Any, str]] = field(default_factory=list)  # theirs, value, ours, value, note
    unmapped: list[tuple[str, Any, str]] = field(default_factory=list)  # theirs, value, why
    defaults: list[tuple[str, Any, str]] = field(default_factory=list)  # theirs, their default, ours
    ours: dict[str, Any] = field(default_factory=dict)  # our resolved values of those keys (fit_to_plugins)

    def set(self, theirs: str, value: Any, ours: str, converted: Any, note: str = "") -> None:
        section, key = ours.split(".", 1)
        self.raw.setdefault(section, {})[key] = converted
        self.mapped.append((theirs, value, ours, converted, note))

    def lines(self) -> list[str]:
        """The mapping report, one line per key."""
        out = [f"imported a {_FORMAT_NAMES[self.format]} config: {len(self.mapped)} keys mapped, "
               f"{len(self.unmapped)} without an equivalent"]
        out += [f"  {t} = {_show(v)}  ->  {o} = {_show(c)}" + (f"  ({n})" if n else "")
                for t, v, o, c, n in self.mapped]
        if self.unmapped:
            out.append("no equivalent (left out):")
            out += [f"  {t} = {_show(v)}: {why}" for t, v, why in self.unmapped]
        differ = [(t, d, o) for t, d, o in self.defaults if o not in self.ours or self.ours[o] != d]
        if differ:
            out.append("defaults that differ (not set in the file; ours apply):")
            out += [f"  {t}: {_FORMAT_NAMES[self.format].split()[0]} {_show(d)}, here {o} = "
                    f"{_show(self.ours.get(o, '(its default)'))}" for t, d, o in differ]
        return out


_FORMAT_NAMES = {"verl": "verl (ppo_trainer.yaml)", "trl_grpo": "TRL GRPOConfig", "trl_ppo": "TRL PPOConfig"}


def _show(value: Any) -> str:
    return json.dumps(value, default=str)


# ----------------------------------------------------------------------------- reading
def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def read_foreign(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON file as flat dotted keys."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("", f"config file {str(p)!r} does not exist")
    text = p.read_text()
    if p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("", f"{p} is not valid JSON: {exc}") from None
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("", f"{p} is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ConfigError("", f"{p} holds a {type(data).__name__}, not a mapping of settings")
    return flatten(data)


def from_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """verl's dotted command-line overrides (``data.train_batch_size=256``) as flat keys."""
    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(item, "overrides look like section.key=value, e.g. data.train_batch_size=256")
        out[key.strip().lstrip("+")] = _yaml_scalar(value.strip())
    return out


def _yaml_scalar(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("null", "none", "~"):
        return None
    if text.startswith("[") and "'" in text:
        text = text.replace("'", '"')
    return parse_value(text)


def detect_format(flat: Mapping[str, Any]) -> str:
    """``"verl"``, ``"trl_grpo"`` or ``"trl_ppo"`` from the keys."""
    roots = {k.split(".", 1)[0] for k in flat}
    if roots & {"actor_rollout_ref", "trainer", "critic", "reward_model", "custom_reward_function"} or \
            any(k.startswith(("data.train_", "algorithm.adv_estimator", "algorithm.kl_ctrl")) for k in flat):
        return "verl"
    if roots & {"num_generations", "beta", "epsilon", "epsilon_high", "loss_type", "scale_rewards",
                "max_completion_length", "num_iterations"}:
        return "trl_grpo"
    if roots & {"num_ppo_epochs", "cliprange", "cliprange_value", "vf_coef", "kl_coef", "total_episodes",
                "response_length", "sft_model_path", "whiten_rewards"}:
        return "trl_ppo"
    raise ConfigError("", "the file is neither a verl config (actor_rollout_ref, data, trainer, algorithm ...) nor "
                          "a TRL GRPOConfig/PPOConfig (num_generations, beta, num_ppo_epochs, ...)")


# ----------------------------------------------------------------------------- verl
_KL = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "low_var_kl", "k3": "low_var_kl",
       "k1+": "k1+", "k3+": "k3+", "full": None}
_ADV = {"grpo": "grpo", "gae": "ppo", "reinforce_plus_plus": "reinforce_pp",
        "reinforce_plus_plus_baseline": "reinforce_pp_baseline", "rloo": "rloo", "remax": "remax", "opo": "opo",
        "gpg": "gpg", "grpo_passk": None}
_TRUNCATION = {"error": "error", "left": "truncate_left", "right": "truncate_right", "middle": "truncate_middle"}

#: verl key -> our key (same meaning, same unit). Keys with a conversion are handled in :func:`_verl`.
_VERL_SAME = {
    "data.max_prompt_length": "data.max_prompt_length", "data.max_response_length": "rollout.max_new_tokens",
    "data.prompt_key": "data.prompt_key", "data.shuffle": "data.shuffle", "data.val_batch_size": "data.val_batch_size",
    "data.image_key": "data.image_key", "data.train_batch_size": "data.batch_size",
    "actor_rollout_ref.model.path": "model.path", "actor_rollout_ref.model.trust_remote_code": "model.trust_remote_code",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "backend.activation_checkpointing",
    "actor_rollout_ref.model.lora_rank": "backend.lora_rank", "actor_rollout_ref.model.lora_alpha": "backend.lora_alpha",
    "actor_rollout_ref.actor.optim.lr": "backend.lr", "actor_rollout_ref.actor.optim.lr_warmup_steps":
        "backend.warmup_steps", "actor_rollout_ref.actor.optim.min_lr_ratio": "backend.min_lr_ratio",
    "actor_rollout_ref.actor.optim.weight_decay": "backend.weight_decay",
    "actor_rollout_ref.actor.optim.betas": "backend.betas",
    "actor_rollout_ref.actor.optim.total_training_steps": "backend.total_training_steps",
    "actor_rollout_ref.actor.grad_clip": "backend.grad_clip",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "backend.micro_batch_size",
    "actor_rollout_ref.actor.ppo_epochs": "algorithm.epochs",
    "actor_rollout_ref.actor.clip_ratio_low": "algorithm.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high": "algorithm.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c": "algorithm.clip_ratio_c",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coef",
    "actor_rollout_ref.actor.loss_agg_mode": "algorithm.loss_agg_mode",
    "actor_rollout_ref.rollout.name": "rollout.name", "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature", "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.top_k": "rollout.top_k",
    "actor_rollout_ref.rollout.response_length": "rollout.max_new_tokens",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "actor_rollout_ref.rollout.enforce_eager": "rollout.enforce_eager",
    "actor_rollout_ref.rollout.enable_chunked_prefill": None,
    "actor_rollout_ref.rollout.val_kwargs.n": "rollout.val_n",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "backend.log_prob_micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "backend.log_prob_micro_batch_size",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "backend.reference_cpu_offload",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "backend.cpu_offload",
    "critic.optim.lr": "backend.critic_lr", "critic.model.path": "model.critic_path",
    "critic.cliprange_value": "algorithm.value_clip",
    "algorithm.gamma": "algorithm.gamma", "algorithm.lam": "algorithm.lam",
    "algorithm.use_kl_in_reward": "algorithm.kl_in_reward", "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std",
    "trainer.total_epochs": "run.epochs", "trainer.total_training_steps": "run.max_steps",
    "trainer.save_freq": "run.save_every", "trainer.test_freq": "run.val_every",
    "trainer.val_before_train": "run.val_before_train", "trainer.default_local_dir": "run.output_dir",
    "trainer.project_name": "run.project", "trainer.experiment_name": "run.name",
    "trainer.max_actor_ckpt_to_keep": "run.keep_checkpoints", "trainer.nnodes": "executor.nnodes",
    "trainer.n_gpus_per_node": "executor.procs_per_node", "reward_model.model.path": "reward.model_path",
}

#: verl's validation sampling, which it uses only with ``val_kwargs.do_sample = true``.
_VAL_SAMPLE = "actor_rollout_ref.rollout.val_kwargs.do_sample"
_VAL_SAMPLING = {f"actor_rollout_ref.rollout.val_kwargs.{k}": f"rollout.val_{k}" for k in ("temperature", "top_p", "top_k")}

#: verl keys with no equivalent here, and why.
_VERL_NONE = {
    "trainer.device": "the device follows the executor: executor.device='auto' (the default) trains on CUDA where "
                      "torch sees a device, 'cuda' refuses to fall back to the CPU",
    "actor_rollout_ref.hybrid_engine": "the rollout engine and the actor always share the process's accelerators here",
    "actor_rollout_ref.actor.use_dynamic_bsz": "set backend.micro_batch_max_tokens (a token budget per micro-batch) instead",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "mapped only with use_dynamic_bsz (backend.micro_batch_max_tokens)",
    "actor_rollout_ref.rollout.free_cache_engine": "engines release their memory between steps by themselves (enable_sleep_mode)",
    "actor_rollout_ref.actor.strategy": "the training backend is backend.name (fsdp = FSDP2, megatron)",
    "critic.strategy": "the critic runs on the same backend as the actor",
    "algorithm.kl_ctrl.type": "only a fixed KL coefficient (algorithm.kl_coef); no adaptive controller",
    "algorithm.kl_ctrl.target_kl": "only a fixed KL coefficient; no adaptive controller",
    "algorithm.kl_ctrl.horizon": "only a fixed KL coefficient; no adaptive controller",
    "trainer.logger": "mapped to run.loggers where a logger of that name exists",
    "data.tokenizer": "set model.tokenizer to a tokenizer directory",
    "data.return_raw_chat": "prompts always keep their chat messages (samples/ and multi-turn use them)",
    "actor_rollout_ref.rollout.mode": "sync/async generation is trainer.mode here (sync, colocate_async, separate_async)",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "the global micro-batch is deprecated in verl; set ppo_micro_batch_size_per_gpu",
}

#: verl's defaults that differ from ours (for keys the file leaves out).
_VERL_DEFAULTS = [
    ("data.max_prompt_length", 512, "data.max_prompt_length"), ("data.max_response_length", 512, "rollout.max_new_tokens"),
    ("data.truncation", "error", "data.overlong"), ("actor_rollout_ref.actor.optim.lr", 1e-6, "backend.lr"),
    ("actor_rollout_ref.actor.clip_ratio", 0.2, "algorithm.clip_ratio_low"),
    ("actor_rollout_ref.rollout.n", 1, "rollout.n"),
    ("trainer.test_freq", -1, "run.val_every"), ("actor_rollout_ref.rollout.name", "vllm", "rollout.name"), ("trainer.save_freq", -1, "run.save_every"),
    ("trainer.total_epochs", 30, "run.epochs"), ("actor_rollout_ref.actor.use_kl_loss", False, "algorithm.kl_coef"),
    ("actor_rollout_ref.actor.kl_loss_type", "low_var_kl", "algorithm.kl_estimator"),
]


def _verl(flat: dict[str, Any], report: ImportReport) -> None:
    from verl_core.contracts import RolloutConfig

    n = flat.get("actor_rollout_ref.rollout.n", RolloutConfig.n)  # the n this run will use
    n = n if isinstance(n, int) and n > 0 else RolloutConfig.n
    done: set[str] = set()
    for key, value in flat.items():
        if isinstance(value, str) and value.startswith("${"):
            report.unmapped.append((key, value, "an interpolation: it follows the key it names, mapped on its own"))
            continue
        if key in ("data.train_files", "data.val_files"):
            files = value if isinstance(value, list) else [value]
            ours = "data.train" if key == "data.train_files" else "data.val"
            report.set(key, value, ours, str(files[0]), "only the first of several files" if len(files) > 1 else "")
        elif key == "data.truncation":
            if flat.get("data.filter_overlong_prompts") is True:
                report.unmapped.append((key, value, "data.filter_overlong_prompts=true decides: data.overlong=\"filter\""))
            elif value in _TRUNCATION:
                report.set(key, value, "data.overlong", _TRUNCATION[value])
        elif key == "data.filter_overlong_prompts":
            if value:
                report.set(key, value, "data.overlong", "filter")
            else:
                done.add(key)
        elif key == "actor_rollout_ref.actor.ppo_mini_batch_size":
            report.set(key, value, "algorithm.mini_batch_size", value * n,
                       f"verl counts prompts, we count samples: x rollout.n={n}"
                       + ("" if "actor_rollout_ref.rollout.n" in flat else ", ours, as the file sets none"))
        elif key == "actor_rollout_ref.actor.clip_ratio":
            report.set(key, value, "algorithm.clip_ratio", value, "sets clip_ratio_low and clip_ratio_high")
        elif key == "actor_rollout_ref.actor.use_kl_loss":
            report.set(key, value, "algorithm.kl_in_reward", not value,
                       "a KL loss term is kl_in_reward=false here" if value else "no KL loss")
        elif key == "actor_rollout_ref.actor.kl_loss_coef":
            if flat.get("actor_rollout_ref.actor.use_kl_loss"):
                report.set(key, value, "algorithm.kl_coef", value)
            else:
                report.unmapped.append((key, value, "use_kl_loss is not true, so verl does not use it"))
        elif key in ("actor_rollout_ref.actor.kl_loss_type", "algorithm.kl_penalty"):
            in_loss = key.endswith("kl_loss_type")
            if in_loss != bool(flat.get("actor_rollout_ref.actor.use_kl_loss")):
                report.unmapped.append((key, value, "the other KL (in the reward / in the loss) is the one in use"))
            elif _KL.get(value):
                report.set(key, value, "algorithm.kl_estimator", _KL[value], "" if _KL[value] == value else "same estimator")
            else:
                report.unmapped.append((key, value, f"no estimator named {value!r} here; estimators: k1, abs, k2, "
                                                    f"low_var_kl, k1+, k3+"))
        elif key == "algorithm.adv_estimator":
            if _ADV.get(value):
                report.set(key, value, "algorithm.name", _ADV[value],
                           "GAE with a critic is our ppo" if value == "gae" else "")
            else:
                report.unmapped.append((key, value, "no algorithm with this estimator is installed by verl here"))
        elif key == "actor_rollout_ref.model.target_modules":
            report.set(key, value, "backend.lora_target_modules",
                       [value] if isinstance(value, str) and value != "all-linear" else value
                       if value != "all-linear" else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"], "all-linear: every projection" if value ==
                       "all-linear" else "")
        elif key == "actor_rollout_ref.actor.optim.warmup_style" or key == "actor_rollout_ref.actor.optim.lr_scheduler_type":
            report.set(key, value, "backend.lr_schedule", "cosine" if value == "cosine" else "constant")
        elif key == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" and flat.get("actor_rollout_ref.actor.use_dynamic_bsz"):
            report.set(key, value, "backend.micro_batch_max_tokens", value)
        elif key == "actor_rollout_ref.model.use_remove_padding":
            report.set(key, value, "backend.remove_padding", "auto" if value else False,
                       "auto: packed where flash-attention is available" if value else "")
        elif key == "trainer.resume_mode":
            resume = {"auto": "auto", "disable": "never"}.get(value)
            if value == "resume_path" and flat.get("trainer.resume_from_path"):
                resume = str(flat["trainer.resume_from_path"])
            if resume:
                report.set(key, value, "run.resume", resume)
        elif key == "trainer.resume_from_path" or key == _VAL_SAMPLE:
            done.add(key)
        elif key in _VAL_SAMPLING:  # verl samples in validation only with val_kwargs.do_sample (default false)
            if flat.get(_VAL_SAMPLE) is True:
                report.set(key, value, _VAL_SAMPLING[key], value, "val_kwargs.do_sample=true")
            else:
                report.unmapped.append((key, value, "val_kwargs.do_sample is not true, so verl validates greedily, "
                                                    "as rollout.val_temperature=0 (the default) does here"))
        elif key == "trainer.logger":
            loggers = [value] if isinstance(value, str) else list(value)
            kept = [x for x in loggers if x in ("console", "wandb", "tensorboard")]
            report.set(key, value, "run.loggers", [*dict.fromkeys([*kept, "jsonl"])], "jsonl kept: metrics.jsonl")
        elif key == "custom_reward_function.path":
            if value:
                name = flat.get("custom_reward_function.name") or "compute_score"
                report.set(key, value, "reward.name", f"file:{value}:{name}", "verl's compute_score(data_source, "
                           "solution_str, ground_truth, extra_info) signature")
        elif key == "custom_reward_function.name":
            done.add(key)
        elif key in _VERL_SAME and _VERL_SAME[key]:
            report.set(key, value, _VERL_SAME[key], value)
        else:
            report.unmapped.append((key, value, _VERL_NONE.get(key, "no setting of this meaning here")))
    if "algorithm.adv_estimator" not in flat:  # verl's default estimator is GAE: a PPO run with a critic
        report.raw.setdefault("algorithm", {})["name"] = "ppo"
        report.mapped.append(("algorithm.adv_estimator (unset)", "gae", "algorithm.name", "ppo",
                              "verl's default, GAE with a critic"))
    procs = report.raw.get("executor", {})
    if procs.get("nnodes", 1) * procs.get("procs_per_node", 1) > 1:
        report.raw["executor"]["name"] = "ray"
        report.mapped.append(("trainer.nnodes x trainer.n_gpus_per_node", procs.get("nnodes", 1) *
                              procs.get("procs_per_node", 1), "executor.name", "ray", "more than one process: Ray"))
    elif "executor" in report.raw:
        report.raw.pop("executor")  # one process: the local executor, which takes neither
    for theirs, default, ours in _VERL_DEFAULTS:
        if theirs not in flat and not (theirs == "data.truncation" and "data.filter_overlong_prompts" in flat):
            report.defaults.append((theirs, default, ours))


# ----------------------------------------------------------------------------- TRL
_TRL_LOSS = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
             "dapo": "token-mean"}
_TRL_SAME = {
    "learning_rate": "backend.lr", "max_prompt_length": "data.max_prompt_length",
    "max_completion_length": "rollout.max_new_tokens", "response_length": "rollout.max_new_tokens",
    "temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k",
    "num_generations": "rollout.n", "epsilon": "algorithm.clip_ratio_low", "epsilon_high": "algorithm.clip_ratio_high",
    "num_iterations": "algorithm.epochs", "num_ppo_epochs": "algorithm.epochs", "max_steps": "run.max_steps",
    "num_train_epochs": "run.epochs", "save_steps": "run.save_every", "eval_steps": "run.val_every",
    "output_dir": "run.output_dir", "seed": "run.seed", "warmup_steps": "backend.warmup_steps",
    "weight_decay": "backend.weight_decay", "adam_epsilon": "backend.eps", "max_grad_norm": "backend.grad_clip",
    "gradient_checkpointing": "backend.activation_checkpointing", "cliprange": "algorithm.clip_ratio",
    "cliprange_value": "algorithm.value_clip", "gamma": "algorithm.gamma", "lam": "algorithm.lam",
    "kl_coef": "algorithm.kl_coef", "beta": "algorithm.kl_coef", "sft_model_path": "model.path",
    "model_name_or_path": "model.path", "reward_model_path": "reward.model_path", "run_name": "run.name",
    "mask_truncated_completions": None, "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization",
}
_TRL_NONE = {
    "logging_steps": "every step is logged here", "per_device_eval_batch_size": "validation generates "
    "data.val_batch_size prompts at once", "vf_coef": "the critic has its own optimizer (backend.critic_lr), "
    "so there is no shared loss to weigh", "whiten_rewards": "rewards are not whitened; advantages are "
    "(algorithm.whiten_advantages)", "logging_dir": "the run directory holds the logs (run.output_dir)",
    "remove_unused_columns": "rows keep every column (raw)", "bf16": "mapped as backend.autocast when true",
    "push_to_hub": "verl export writes a save_pretrained directory to push", "mask_truncated_completions":
    "truncated completions are trained on (DAPO's overlong shaping penalises them: --algo dapo)",
}
_TRL_DEFAULTS = {
    "trl_grpo": [("learning_rate", 1e-6, "backend.lr"), ("num_generations", 8, "rollout.n"),
                 ("max_completion_length", 256, "rollout.max_new_tokens"), ("beta", 0.0, "algorithm.kl_coef"),
                 ("loss_type", "dapo", "algorithm.loss_agg_mode"), ("lr_scheduler_type", "linear", "backend.lr_schedule"),
                 ("temperature", 1.0, "rollout.temperature")],
    "trl_ppo": [("learning_rate", 3e-6, "backend.lr"), ("kl_coef", 0.05, "algorithm.kl_coef"),
                ("num_ppo_epochs", 4, "algorithm.epochs"), ("cliprange_value", 0.2, "algorithm.value_clip"),
                ("gamma", 1.0, "algorithm.gamma"), ("lam", 0.95, "algorithm.lam"),
                ("response_length", 53, "rollout.max_new_tokens"), ("lr_scheduler_type", "linear", "backend.lr_schedule"),
                ("temperature", 0.7, "rollout.temperature")],
}


def _trl(flat: dict[str, Any], report: ImportReport) -> None:
    grpo = report.format == "trl_grpo"
    report.raw["algorithm"] = {"name": "grpo" if grpo else "ppo"}
    n = flat.get("num_generations", 8 if grpo else 1)
    per_device = flat.get("per_device_train_batch_size", 8)
    accumulation = flat.get("gradient_accumulation_steps", 1)
    for key, value in flat.items():
        if key in ("per_device_train_batch_size", "gradient_accumulation_steps", "batch_size"):
            continue
        if key == "loss_type" and value in _TRL_LOSS:
            report.set(key, value, "algorithm.loss_agg_mode", _TRL_LOSS[value], "the same aggregation")
        elif key == "scale_rewards":
            report.set(key, value, "algorithm.norm_adv_by_std", value not in (False, "none"),
                       "per group" if value in (True, "group") else "" if value in (False, "none") else
                       "per group here, not per batch")
        elif key in ("adam_beta1", "adam_beta2"):
            betas = [flat.get("adam_beta1", 0.9), flat.get("adam_beta2", 0.999)]
            report.set(key, value, "backend.betas", betas)
        elif key == "lr_scheduler_type":
            report.set(key, value, "backend.lr_schedule", "cosine" if "cosine" in str(value) else "constant",
                       "" if value in ("cosine", "constant") else f"no {value!r} schedule here: constant")
        elif key == "warmup_ratio" and value:
            steps = flat.get("max_steps")
            if isinstance(steps, int) and steps > 0:
                report.set(key, value, "backend.warmup_steps", round(value * steps), f"x max_steps={steps}")
            else:
                report.unmapped.append((key, value, "a ratio of max_steps, which the file does not set"))
        elif key == "bf16" and value:
            report.set(key, value, "backend.autocast", "bfloat16", "training forwards under bf16 autocast")
        elif key == "use_vllm":
            report.set(key, value, "rollout.name", "vllm" if value else "hf")
        elif key == "report_to":
            targets = [value] if isinstance(value, str) else list(value or [])
            kept = [x for x in targets if x in ("wandb", "tensorboard")]
            report.set(key, value, "run.loggers", ["console", "jsonl", *kept])
        elif key == "total_episodes":
            batch = per_device * accumulation
            report.set(key, value, "run.max_steps", max(1, value // batch), f"episodes // {batch} per step")
        elif key == "mini_batch_size" or key == "num_mini_batches":
            if key == "num_mini_batches":
                report.set(key, value, "algorithm.mini_batch_size", max(1, per_device * accumulation // value),
                           "samples per optimizer step")
        elif _TRL_SAME.get(key):
            report.set(key, value, _TRL_SAME[key], value)
        else:
            report.unmapped.append((key, value, _TRL_NONE.get(key, "no setting of this meaning here")))
    if grpo:
        prompts = max(1, per_device * accumulation // n) if isinstance(n, int) and n else per_device
        report.set("per_device_train_batch_size x gradient_accumulation_steps / num_generations",
                   [per_device, accumulation, n], "data.batch_size", prompts,
                   "TRL counts completions per device and process; we count prompts per step (one process: "
                   "multiply by the number of processes if you trained on several)")
    else:
        report.set("per_device_train_batch_size x gradient_accumulation_steps", [per_device, accumulation],
                   "data.batch_size", per_device * accumulation, "prompts per step")
    for theirs, default, ours in _TRL_DEFAULTS[report.format]:
        if theirs not in flat:
            report.defaults.append((theirs, default, ours))


# ----------------------------------------------------------------------------- entry
def import_config(flat: Mapping[str, Any], format: str | None = None) -> ImportReport:
    """Map flat foreign keys (:func:`read_foreign`, :func:`from_overrides`) to our raw config."""
    flat = dict(flat)
    fmt = format or detect_format(flat)
    report = ImportReport(format=fmt)
    (_verl if fmt == "verl" else _trl)(flat, report)
    return report


def fit_to_plugins(report: ImportReport, registry: Any, *, tries: int = 50) -> Any:
    """Resolve the imported config; a mapped key the selected plugin does not take (``gpu_memory_utilization``
    with the HF rollout) moves to the unmapped list with the reason. Returns the resolved config."""
    from verl_core.config import config_to_dict, resolve_config

    for _ in range(tries):
        try:
            cfg = resolve_config(report.raw, registry)
            flat = flatten(config_to_dict(cfg))
            report.ours = {o: flat.get(o) for _, _, o in report.defaults}
            return cfg
        except ConfigError as exc:
            hit = next((m for m in report.mapped if m[2] == exc.path), None)
            section, _, key = exc.path.partition(".")
            if hit is None or key not in report.raw.get(section, {}):
                raise
            report.raw[section].pop(key)
            report.mapped.remove(hit)
            why = str(exc).split(": ", 1)[-1].split(";")[0]
            if why.startswith("unknown key"):
                plugin = (report.raw.get(section) or {}).get("name") or "the default"
                why = f"the {section} plugin here ({plugin}) has no {key}; other {section} plugins may"
            report.unmapped.append((hit[0], hit[1], f"{exc.path}: {why}"))
    raise ConfigError("", "the imported config does not resolve")


class VerlYamlFormat(ConfigFormat):
    """verl's ``ppo_trainer.yaml`` (or its dotted command-line overrides) and TRL's GRPOConfig/PPOConfig,
    YAML or JSON, as our config; the notes are the mapping report, :meth:`ImportReport.lines`."""

    def reads(self, path: Path | None) -> bool:
        return path is None or Path(path).suffix.lower() in (".yaml", ".yml", ".json")

    def read(self, path: Path | None, *, overrides: Sequence[str] = (),
             registry: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
        flat = read_foreign(path) if path is not None else {}
        flat.update(from_overrides(overrides))
        report = import_config(flatten(flat))
        fit_to_plugins(report, registry)
        return report.raw, report.lines()
