"""Run configuration: TOML files, dotted overrides, and validation before anything loads.

The core owns the fixed sections (``run``, ``model``, ``data``, ``reward``); each selected plugin
owns its section's fields through its ``Config`` dataclass (``backend``, ``rollout``,
``algorithm``, ``executor``), with the plugin's name under ``name``::

    [algorithm]
    name = "grpo"
    clip_ratio_high = 0.28

An unknown key or a wrong type raises :class:`ConfigError` naming the key path and the fix, so a
typo never costs a model load.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "Config",
    "ConfigError",
    "RunConfig",
    "ModelConfig",
    "DataConfig",
    "RewardConfig",
    "RewardComponent",
    "PluginSection",
    "PLUGIN_SECTIONS",
    "load_raw_config",
    "apply_overrides",
    "resolve_config",
    "config_to_dict",
    "dump_toml",
]


class ConfigError(ValueError):
    """A configuration the run cannot start with; ``path`` is the dotted key at fault."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


@dataclass
class RunConfig:
    """How the run is driven.

    Attributes:
        output_dir: run directory (resolved config, metrics.jsonl, checkpoints).
        max_steps: RL steps to run in total (counting steps done before a resume).
        save_every: checkpoint every N steps (0: only at the end).
        keep_checkpoints: how many complete checkpoints to keep (0 keeps all).
        resume: ``"auto"`` (latest complete checkpoint in output_dir), ``"never"``, or a path.
        seed: seed for data order, sampling and initialisation.
        val_every: validate every N steps (0: only before and after training).
        val_before_train: validate before the first step.
        loggers: metric sinks by plugin name (``console``, ``jsonl``, ``tensorboard``, ``wandb``).
        disable_hooks: installed ``verl.hooks`` plugins to leave out.
        threads: torch threads in this process (0: half the cores, at least 1; on small CPUs more
            threads than cores across processes makes everything many times slower).
        project: project name for experiment trackers.
        name: run name for experiment trackers (default: the output directory's name).
    """

    output_dir: str = "runs/default"
    max_steps: int = 60
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: str = "auto"
    seed: int = 1
    val_every: int = 10
    val_before_train: bool = True
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    disable_hooks: list[str] = field(default_factory=list)
    threads: int = 0
    project: str = "verl"
    name: str = ""

    def validate(self) -> None:
        if self.max_steps < 0:
            raise ConfigError("max_steps", "must be >= 0")
        if self.save_every < 0 or self.val_every < 0:
            raise ConfigError("save_every", "save_every and val_every must be >= 0")
        if self.resume not in ("auto", "never") and not self.resume:
            raise ConfigError("resume", "use 'auto', 'never' or a checkpoint path")


@dataclass
class ModelConfig:
    """The policy model.

    Attributes:
        path: a local Hugging Face model directory, or ``builtin:tiny-qwen2-addition``.
        tokenizer: tokenizer directory (default: ``path``).
        dtype: parameter dtype (``float32``, ``bfloat16``).
        trust_remote_code: allow model code shipped with the checkpoint.
    """

    path: str = "builtin:tiny-qwen2-addition"
    tokenizer: str = ""
    dtype: str = "float32"
    trust_remote_code: bool = False

    def validate(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("dtype", "must be 'float32', 'bfloat16' or 'float16'")


@dataclass
class DataConfig:
    """Prompts for training and validation.

    Attributes:
        train: ``builtin:addition``, a parquet / jsonl / json file, a local Hugging Face dataset directory
            (``save_to_disk`` or a folder of data files), or a Hub dataset id where a network exists.
        val: validation data in the same forms (default: the built-in task's test split, or none).
        train_split: split to read from a dataset directory or Hub id that holds several.
        val_split: split to read for validation from a dataset directory or Hub id.
        batch_size: prompts per RL step (each sampled ``rollout.n`` times).
        val_batch_size: prompts per validation generation call (0: all at once).
        max_val_samples: cap on validation prompts (0: all).
        prompt_key: column with the prompt (a chat message list or a plain string).
        answer_key: column with the ground truth when there is no ``reward_model`` column.
        data_source: ``data_source`` for rows that have none (it picks the reward when reward.name="auto").
        system_prompt: a system message put in front of every prompt (empty: none).
        max_prompt_length: prompts longer than this many tokens are handled per ``overlong``.
        overlong: ``"filter"`` (drop and count), ``"truncate_left"`` / ``"truncate_right"`` /
            ``"truncate_middle"`` (cut tokens from that part of the prompt), or ``"error"``.
        apply_chat_template: render prompts with the tokenizer's chat template (false: the raw text).
        shuffle: reshuffle the training prompts every epoch (seeded).
    """

    train: str = "builtin:addition"
    val: str = ""
    train_split: str = "train"
    val_split: str = "test"
    batch_size: int = 64
    val_batch_size: int = 0
    max_val_samples: int = 0
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    data_source: str = ""
    system_prompt: str = ""
    max_prompt_length: int = 512
    overlong: str = "filter"
    apply_chat_template: bool = True
    shuffle: bool = True

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError("batch_size", "must be at least 1 prompt per step")
        overlong = ("filter", "truncate_left", "truncate_right", "truncate_middle", "error")
        if self.overlong not in overlong:
            raise ConfigError("overlong", f"must be one of {list(overlong)}")
        if self.max_prompt_length < 1:
            raise ConfigError("max_prompt_length", "must be at least 1 token")


@dataclass
class RewardComponent:
    """One term of a weighted reward (an entry of ``reward.components``).

    Attributes:
        name: a reward plugin, ``"auto"`` (by each row's data_source), ``"file:PATH:FUNCTION"``, or
            ``"reward_model"`` (the model at ``reward.model_path``).
        weight: the term's weight in the sum.
    """

    name: str = "auto"
    weight: float = 1.0


#: The component name that refers to the reward model at ``reward.model_path``.
REWARD_MODEL_COMPONENT = "reward_model"


@dataclass
class RewardConfig:
    """How responses are scored.

    Attributes:
        name: the reward when ``components`` is empty: a ``verl.rewards`` plugin for every sample,
            ``"auto"`` to pick one by each row's data_source, or ``"file:/path/rewards.py:function"``.
        components: several rewards summed per sample with weights, e.g.
            ``[{name = "gsm8k", weight = 1.0}, {name = "reward_model", weight = 0.5}]``; each is logged as
            ``reward/<name>/mean``.
        options: settings per reward, e.g. ``{gsm8k = {mode = "strict"}}`` (checked against its Config).
        aliases: extra data_source -> reward mappings for ``"auto"``, e.g. ``{"my/gsm8k-copy" = "gsm8k"}``.
        on_error: ``"fail"`` stops the run with the row and error; ``"zero"`` scores 0 and counts it in
            ``reward/errors``.
        timeout: seconds one reward call may take (per response, or per batch for a batch reward); 0: none.
        isolation: ``"process"`` runs rewards in worker processes that are killed at the time limit;
            ``"none"`` runs them in the controller (no start-up cost, but a hang cannot be interrupted).
        workers: reward worker processes with ``isolation="process"``.
        model_path: a Hugging Face sequence-classification reward model, scored on the training backend
            as the ``reward_model`` component.
    """

    name: str = "auto"
    components: list[RewardComponent] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)
    on_error: str = "fail"
    timeout: float = 60.0
    isolation: str = "process"
    workers: int = 1
    model_path: str = ""

    def validate(self) -> None:
        if self.on_error not in ("fail", "zero"):
            raise ConfigError("on_error", "must be 'fail' or 'zero'")
        if self.isolation not in ("process", "none"):
            raise ConfigError("isolation", "must be 'process' or 'none'")
        if self.timeout < 0:
            raise ConfigError("timeout", "must be >= 0 seconds (0: no limit)")
        if self.workers < 1:
            raise ConfigError("workers", "must be at least 1 process")
        for key, value in self.options.items():
            if not isinstance(value, Mapping):
                raise ConfigError(f"options.{key}", f"must be a table of settings, e.g. options.{key} = {{ ... }}")
        for key, value in self.aliases.items():
            if not isinstance(value, str) or not value:
                raise ConfigError(f"aliases.{key}", "must name a reward plugin")
        names = [c.name for c in self.components]
        for i, c in enumerate(self.components):
            if not isinstance(c, RewardComponent):
                raise ConfigError(f"components[{i}]", "must be a table like { name = \"gsm8k\", weight = 1.0 }")
            if not c.name:
                raise ConfigError(f"components[{i}].name", "must name a reward")
            if c.weight != c.weight or c.weight in (float("inf"), float("-inf")):
                raise ConfigError(f"components[{i}].weight", "must be a finite number")
        if len(set(names)) != len(names):
            raise ConfigError("components", f"a reward is listed twice: {names}")
        if self.components and self.name != "auto":
            raise ConfigError("name", "set either reward.name or reward.components, not both (add "
                                      f"{{ name = \"{self.name}\" }} to reward.components)")
        if self.model_path and self.components and REWARD_MODEL_COMPONENT not in names:
            raise ConfigError("components", f"reward.model_path is set but no component is "
                                            f"{{ name = \"{REWARD_MODEL_COMPONENT}\" }}; add it with a weight")
        if self.model_path and not self.components and self.name != "auto":
            raise ConfigError("components", f"reward.model_path and reward.name={self.name!r} are both set: "
                                            f"combine them with reward.components = [{{ name = \"{self.name}\" }}, "
                                            f"{{ name = \"{REWARD_MODEL_COMPONENT}\", weight = 1.0 }}]")
        if not self.model_path and REWARD_MODEL_COMPONENT in names:
            raise ConfigError("model_path", f"the {REWARD_MODEL_COMPONENT!r} component needs reward.model_path "
                                            f"(a sequence-classification model directory)")

    def resolved_components(self) -> list[RewardComponent]:
        """The terms of the reward: ``components``, or else the reward model, or else ``name`` alone."""
        if self.components:
            return list(self.components)
        if self.model_path:
            return [RewardComponent(REWARD_MODEL_COMPONENT, 1.0)]
        return [RewardComponent(self.name, 1.0)]


@dataclass
class PluginSection:
    """A section owned by the selected plugin: its name and its typed settings."""

    name: str
    config: Any


# section -> (registry kind, default plugin name)
PLUGIN_SECTIONS: dict[str, tuple[str, str]] = {
    "backend": ("backend", "fsdp"),
    "rollout": ("rollout", "hf"),
    "algorithm": ("algorithm", "grpo"),
    "executor": ("executor", "local"),
}
FIXED_SECTIONS: dict[str, type] = {"run": RunConfig, "model": ModelConfig, "data": DataConfig,
                                   "reward": RewardConfig}


@dataclass
class Config:
    """A complete, validated run configuration."""

    run: RunConfig
    model: ModelConfig
    data: DataConfig
    reward: RewardConfig
    backend: PluginSection
    rollout: PluginSection
    algorithm: PluginSection
    executor: PluginSection


# ---------------------------------------------------------------------------- loading
def load_raw_config(path: str | Path | None) -> dict[str, Any]:
    """Read a TOML config file (an empty config when ``path`` is None)."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise ConfigError("", f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{p} is not valid TOML: {exc}") from None


def parse_value(text: str) -> Any:
    """Parse an override value as a TOML literal; anything else is a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a raw config dict (returns a new dict)."""
    out = json.loads(json.dumps(raw))
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(item, "overrides look like section.key=value, e.g. algorithm.kl_coef=0.001")
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(".".join(parts[: i + 1]), "is a value, not a section")
            node = child
        node[parts[-1]] = parse_value(value.strip())
    return out


def set_key(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set one dotted key in a raw config dict (used for CLI flags)."""
    section, _, key = dotted.partition(".")
    raw.setdefault(section, {})[key] = value


# ---------------------------------------------------------------------------- resolving
def resolve_config(raw: Mapping[str, Any], registry: Any) -> Config:
    """Turn a raw dict into a validated :class:`Config`; plugin sections use the plugin's class.

    Selecting a plugin here imports its module (its Config class); plugin modules keep heavy
    engine imports out of module scope, so this stays cheap and happens before any model loads.
    """
    known = [*FIXED_SECTIONS, *PLUGIN_SECTIONS]
    raw = _with_model_preset(raw)
    for section, value in raw.items():
        if section not in known:
            raise ConfigError(section, f"unknown section{_suggest(section, known)}; sections are {known}")
        if not isinstance(value, Mapping):
            raise ConfigError(section, f"must be a table of settings, got {type(value).__name__}")
    built: dict[str, Any] = {}
    for section, cls in FIXED_SECTIONS.items():
        built[section] = build_dataclass(cls, raw.get(section, {}), section)
    for section, (kind, default) in PLUGIN_SECTIONS.items():
        values = dict(raw.get(section, {}))
        name = values.pop("name", default)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{section}.name", "must be a plugin name")
        plugin = registry.load(kind, name)
        config_cls = getattr(plugin, "Config", None)
        if config_cls is None:
            if values:
                raise ConfigError(f"{section}.{next(iter(values))}", f"plugin {name!r} takes no settings")
            built[section] = PluginSection(name, None)
        else:
            built[section] = PluginSection(name, build_dataclass(config_cls, values, section))
    return Config(**built)


def _with_model_preset(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Layer the recommended settings of a built-in model under the user's own.

    A built-in model ships the settings it was tuned with (like a Hugging Face model ships its
    generation config); anything the user sets wins.
    """
    from verl_core.tasks import BUILTIN_PRESETS

    path = raw.get("model", {}).get("path", ModelConfig.path) if isinstance(raw.get("model", {}), Mapping) else None
    preset = BUILTIN_PRESETS.get(path) if isinstance(path, str) else None
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for section, values in (preset or {}).items():
        if isinstance(out.get(section, {}), Mapping):
            out[section] = {**values, **out.get(section, {})}
    return out


def build_dataclass(cls: type, values: Mapping[str, Any], path: str) -> Any:
    """Instantiate dataclass ``cls`` from ``values`` with type checks; then call ``validate()``."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"{path}.{key}", f"unknown key{_suggest(key, list(fields))}; "
                                               f"valid keys: {', '.join(sorted(fields))}")
        kwargs[key] = _coerce(value, hints[key], f"{path}.{key}")
    obj = cls(**kwargs)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as exc:
            raise ConfigError(f"{path}.{exc.path}" if exc.path else path, str(exc).split(": ", 1)[-1]) from None
        except ValueError as exc:
            msg = str(exc)
            key, sep, rest = msg.partition(": ")
            if sep and key in fields:
                raise ConfigError(f"{path}.{key}", rest) from None
            raise ConfigError(path, msg) from None
    return obj


def _coerce(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(path, f"expected {_type_name(hint)}, got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(path, f"must be one of {list(args)}, got {value!r}")
        return value
    if origin in (list, tuple, Sequence):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(path, f"expected {len(args)} values, got {len(value)}")
            return tuple(_coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a table, got {value!r}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(path, f"expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, f"expected a string, got {value!r} (quote it: \"...\")")
    if dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        return build_dataclass(hint, value, path)
    return value


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _suggest(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------- output
def config_to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain data, plugin sections flattened with their ``name``."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, PluginSection):
            section = {"name": value.name}
            if value.config is not None:
                section.update(dataclasses.asdict(value.config))
            out[f.name] = section
        else:
            out[f.name] = dataclasses.asdict(value)
    return out


def dump_toml(data: Mapping[str, Any]) -> str:
    """Write a two-level dict of simple values as TOML (enough for configs)."""
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        # Keys such as data_source names ("openai/gsm8k") are not bare TOML keys: quote those.
        keys = {k: k if k and all(c.isalnum() or c in "_-" for c in k) else json.dumps(k) for k in value}
        return "{ " + ", ".join(f"{keys[k]} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
