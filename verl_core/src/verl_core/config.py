"""Run configuration: TOML files, dotted overrides, and validation before anything loads.

The core owns the fixed sections (``run``, ``model``, ``data``); each selected plugin owns its
section's fields through its ``Config`` dataclass (``reward``, ``backend``, ``rollout``,
``algorithm``, ``executor``), with the plugin's name under ``name`` (``reward.scorer`` for the
reward scorer, whose config has a ``name`` of its own). Plugins add sections of their
own through the ``verl.config_sections`` entry points (:class:`ConfigSection`)::

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
import operator
import re
import sys
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from verl_core.contracts import ConfigError  # defined with the contracts: plugins raise it too

__all__ = [
    "Config",
    "ConfigError",
    "Range",
    "NAMED_RANGES",
    "RunConfig",
    "ModelConfig",
    "DataConfig",
    "PluginSection",
    "ConfigSection",
    "CORE_SECTIONS",
    "config_sections",
    "load_raw_config",
    "apply_overrides",
    "resolve_config",
    "config_to_dict",
    "dump_toml",
    "KEY_ALIASES",
]


@dataclass
class RunConfig:
    """How the run is driven.

    Attributes:
        output_dir: run directory (resolved config, metrics.jsonl, checkpoints).
        max_steps: RL steps to run in total (counting steps done before a resume).
        epochs: instead of ``max_steps``, passes over the training prompts (0: ``max_steps`` decides):
            ``epochs * (training prompts // data.batch_size)`` steps in total.
        save_every: checkpoint every N steps (0: only at the end).
        keep_checkpoints: how many complete checkpoints to keep (0 keeps all).
        resume: ``"auto"`` (latest complete checkpoint in output_dir, refused when the directory holds a run
            trained with other settings), ``"never"`` (start over; the earlier run's files
            are moved to ``superseded-<time>/``), ``"force"`` (as ``"auto"``, whatever differs), or a checkpoint path.
        store: the run store plugin that keeps the run directory (``verl.run_stores``; verl-run-store's
            ``local``: a directory on a local or mounted filesystem).
        seed: seed for data order, sampling and initialisation.
        val_every: validate every N steps (0: only before and after training).
        val_before_train: validate before the first step.
        loggers: metric sinks by plugin name (``console``, ``jsonl``, ``tensorboard``, ``wandb``).
        disable_hooks: installed ``verl.hooks`` plugins to leave out.
        threads: torch threads in this process (0: half the cores, at least 1; on small CPUs more
            threads than cores across processes makes everything many times slower).
        project: project name for experiment trackers.
        name: run name for experiment trackers (default: the output directory's name).
        save_on_signal: on the first SIGTERM or Ctrl-C, finish the step, save a checkpoint and exit
            with status 75 (a second signal stops at once); false: a signal stops at once, unsaved.
        on_checkpoint_error: a checkpoint that cannot be written (full disk, I/O error) is removed and
            ``latest`` kept; ``"stop"`` ends the run naming the path and the error, ``"continue"`` goes on
            without it (counted in ``checkpoint/failed_saves``; the final checkpoint always stops).
        on_corrupt_checkpoint: a checkpoint that fails its manifest on resume: ``"fallback"`` sets it
            aside and resumes from the one before it; ``"error"`` refuses to start.
        max_restarts: times a run may restart its worker groups after a worker process died and
            resume from its last checkpoint, within the same ``verl run`` (multi-process executors).
        val_samples: generated samples of each validation written to ``samples/val_step_<N>.jsonl``
            (and to TensorBoard/wandb), spread over the validation set (-1: all, 0: none).
        train_samples: samples of each training step written to ``samples/train.jsonl`` (0: none).
        health_flat_steps: warn when every group's rewards have been identical (no learning signal
            for group-relative advantages) for this many steps in a row (0: never).
        health_max_kl: warn when ``ppo/kl_divergence`` or ``actor/ref_kl`` exceeds this (0: never).
    """

    output_dir: str = "runs/default"
    max_steps: int = 60
    epochs: int = 0
    save_every: int = 0
    keep_checkpoints: int = 2
    resume: str = "auto"
    store: str = "local"
    seed: int = 1
    val_every: int = 10
    val_before_train: bool = True
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    disable_hooks: list[str] = field(default_factory=list)
    threads: int = 0
    project: str = "verl"
    name: str = ""
    save_on_signal: bool = True
    on_checkpoint_error: str = "stop"
    on_corrupt_checkpoint: str = "fallback"
    max_restarts: int = 0
    val_samples: int = -1
    train_samples: int = 4
    health_flat_steps: int = 3
    health_max_kl: float = 1.0

    def validate(self) -> None:
        if self.val_samples < -1 or self.train_samples < 0:
            raise ConfigError("val_samples" if self.val_samples < -1 else "train_samples",
                              "must be >= 0 (val_samples: -1 writes all of them)")
        if self.health_flat_steps < 0 or self.health_max_kl < 0:
            raise ConfigError("health_flat_steps" if self.health_flat_steps < 0 else "health_max_kl",
                              "must be >= 0 (0 turns the check off)")
        if self.on_checkpoint_error not in ("stop", "continue"):
            raise ConfigError("on_checkpoint_error", f"must be 'stop' or 'continue', got {self.on_checkpoint_error!r}")
        if self.on_corrupt_checkpoint not in ("fallback", "error"):
            raise ConfigError("on_corrupt_checkpoint", f"must be 'fallback' or 'error', got "
                                                       f"{self.on_corrupt_checkpoint!r}")
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", "must be >= 0 (0: a dead worker ends the run)")
        if self.max_steps < 0 or self.epochs < 0:
            raise ConfigError("epochs" if self.epochs < 0 else "max_steps", "must be >= 0")
        if self.save_every < 0 or self.val_every < 0:
            raise ConfigError("save_every" if self.save_every < 0 else "val_every", "must be >= 0")
        if self.resume not in ("auto", "never") and not self.resume:
            raise ConfigError("resume", "use 'auto', 'never', 'force' or a checkpoint path")


@dataclass
class ModelConfig:
    """The policy model.

    Attributes:
        path: a local Hugging Face model directory, or ``builtin:tiny-qwen2-addition``. A run given a
            model object (``Trainer(model=...)``) records it as ``"<object: Qwen2ForCausalLM ...>"``.
        tokenizer: tokenizer directory (default: ``path``).
        critic_path: where the critic starts (algorithms with a critic): a model directory with a
            one-label score head (token or sequence classification, e.g. a reward model), whose head
            is kept, or a causal LM, whose backbone gets a new value head at zero (default: ``path``).
        dtype: parameter dtype (``float32``, ``bfloat16``).
        trust_remote_code: allow model code shipped with the checkpoint.
    """

    path: str = "builtin:tiny-qwen2-addition"
    tokenizer: str = ""
    critic_path: str = ""
    dtype: str = "float32"
    trust_remote_code: bool = False

    def validate(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError("dtype", "must be 'float32', 'bfloat16' or 'float16'")


#: ``data.train`` / ``data.val`` = ``"<provider>:<argument>"`` (:meth:`~verl_core.contracts.DatasetProvider.from_spec`);
#: not ``builtin:``, URLs or paths (a local file ``a:b.jsonl`` is written ``./a:b.jsonl``).
GENERATED_DATA = re.compile(r"^(?!builtin:)([A-Za-z][\w.-]*):(?![/\\])(.+)$")
#: "owner/name" on the Hugging Face Hub (a model or dataset path that does not exist locally and has this shape).
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class DataConfig:
    """Prompts for training and validation.

    Attributes:
        reader: the ``verl.data_readers`` plugin that reads and renders the prompts
            (:class:`~verl_core.contracts.DataReader`); ``"standard"`` (verl-data) reads the forms below.
        train: ``builtin:addition``, a parquet / jsonl / json file, a local Hugging Face dataset directory
            (``save_to_disk`` or a folder of data files), or a Hub dataset id where a network exists.
        val: validation data in the same forms (default: the built-in task's test split, or none).
        train_split: split to read from a dataset directory or Hub id that holds several.
        val_split: split of ``data.val`` to read when it is a dataset directory or Hub id.
        batch_size: prompts per RL step (each sampled ``rollout.n`` times).
        val_batch_size: prompts per validation generation call (0: all at once).
        max_val_samples: cap on validation prompts (0: all).
        prompt_key: column with the prompt (a chat message list or a plain string).
        answer_key: column with the ground truth when there is no ``reward_model`` column.
        data_source: ``data_source`` for rows that have none (it picks the reward when reward.name="auto").
        system_prompt: a system message put in front of every prompt without one (empty: none).
        max_prompt_length: prompts longer than this many tokens are handled per ``overlong``.
        overlong: ``"filter"`` (drop and count), ``"truncate_left"`` / ``"truncate_right"`` /
            ``"truncate_middle"`` (cut tokens from that part of the prompt), or ``"error"``.
        apply_chat_template: render prompts with the tokenizer's chat template (false: the raw text).
        shuffle: reshuffle the training prompts every epoch (seeded).
        max_bad_rows: rows that cannot be used (a line that is not JSON or not UTF-8, no prompt column, a
            malformed prompt, a prompt over the limit with ``overlong="error"``) skipped per source and
            counted in ``data/<train|val>_bad_rows``; one more stops the run naming them (0: the first stops it).
        image_key: column with each row's images (encoded bytes, ``{"bytes", "path"}`` dicts or file paths),
            placed where the prompt says ``<image>`` or has a ``{"type": "image"}`` part (verl_data.images).
        max_image_pixels: images with more pixels (width x height) are bad rows (see ``max_bad_rows``).
        size: training rows a generated dataset makes (``train = "<provider>:<argument>"``, a ``verl.datasets``
            provider that takes an argument, e.g. ``reasoning_gym:chain_sum``; 0: the provider's default).
        val_size: validation rows a generated dataset makes (``val``, or ``train`` when ``val`` is empty).
    """

    reader: str = "standard"
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
    max_bad_rows: int = 0
    image_key: str = "images"
    max_image_pixels: int = 4096 * 4096
    size: int = 0
    val_size: int = 0

    def validate(self) -> None:
        for key, spec, value in (("size", self.train, self.size), ("val_size", self.val or self.train, self.val_size)):
            if value < 0:
                raise ConfigError(key, "must be >= 0 rows (0: the generated dataset's own default)")
            if value and not GENERATED_DATA.match(spec):
                raise ConfigError(key, f"{spec!r} is not a generated dataset ('<provider>:<argument>', e.g. "
                                       f"reasoning_gym:chain_sum): no rows are made to this number; remove data.{key}")
        if self.max_image_pixels < 1:
            raise ConfigError("max_image_pixels", "must be at least 1 pixel")
        if self.max_bad_rows < 0:
            raise ConfigError("max_bad_rows", "must be >= 0 (0: the first bad row stops the run)")
        if self.batch_size < 1:
            raise ConfigError("batch_size", "must be at least 1 prompt per step")
        for key in ("val_batch_size", "max_val_samples"):  # -1 is not "all" here, as in run.val_samples
            if getattr(self, key) < 0:
                raise ConfigError(key, "must be >= 0 (0: all)")
        overlong = ("filter", "truncate_left", "truncate_right", "truncate_middle", "error")
        if self.overlong not in overlong:
            raise ConfigError("overlong", f"must be one of {list(overlong)}")
        if self.max_prompt_length < 1:
            raise ConfigError("max_prompt_length", "must be at least 1 token")


@dataclass
class PluginSection:
    """A section owned by the selected plugin: its name and its typed settings (``""``: none selected)."""

    name: str
    config: Any


@dataclass(frozen=True)
class ConfigSection:
    """A top-level section of the run config.

    The core's sections are :data:`CORE_SECTIONS`; a plugin adds one by registering a
    ``ConfigSection`` under the ``verl.config_sections`` entry points (the entry point's name is
    the section's name), so a new kind of section is never a core edit::

        [project.entry-points."verl.config_sections"]
        environment = "my_package.config:ENVIRONMENT_SECTION"

    Attributes:
        schema: a dataclass the section's keys fill (a fixed section such as ``run``).
        plugin_kind: instead of a schema, the registry kind whose selected plugin owns the section:
            its ``name`` key picks the plugin and the plugin's ``Config`` dataclass types the rest.
        default: the plugin selected when the section names none (``""``: no plugin).
        key: the key that names the plugin (``name``; a section whose plugin config has a field of
            that name picks another).
    """

    schema: type | None = None
    plugin_kind: str | None = None
    default: str = ""
    key: str = "name"

    def __post_init__(self) -> None:
        if (self.schema is None) == (self.plugin_kind is None):
            raise ValueError("a ConfigSection has either a schema or a plugin_kind")


#: The core's sections, in the order they are written out.
CORE_SECTIONS: dict[str, ConfigSection] = {
    "run": ConfigSection(schema=RunConfig),
    "model": ConfigSection(schema=ModelConfig),
    "data": ConfigSection(schema=DataConfig),
    # [reward] belongs to the scorer plugin named by reward.scorer (reward.name is a field of its Config).
    "reward": ConfigSection(plugin_kind="scorer", default="default", key="scorer"),
    "backend": ConfigSection(plugin_kind="backend", default="fsdp"),
    "rollout": ConfigSection(plugin_kind="rollout", default="hf"),
    "algorithm": ConfigSection(plugin_kind="algorithm", default="grpo"),
    "executor": ConfigSection(plugin_kind="executor", default="local"),
    # [environment]: a multi-turn environment plugin and its settings (none by default).
    "environment": ConfigSection(plugin_kind="environment", default=""),
    # [trainer]: where each step's batch comes from, the step source trainer.mode names (sync; the overlapping
    # modes of verl-trainer-async, issue 19).
    "trainer": ConfigSection(plugin_kind="step_source", default="sync", key="mode"),
}


#: Attribute names of :class:`Config` that no section may take.
_RESERVED_SECTIONS = frozenset({"sections", "section_spec", "raw", "profile"})


def config_sections(registry: Any, used: Sequence[str] = ()) -> dict[str, ConfigSection]:
    """The core's sections followed by those installed plugins register, by name. A section plugin that
    cannot be loaded fails only runs that set it (``used``); the others go on with a warning."""
    from verl_core.registry import PluginError

    sections = dict(CORE_SECTIONS)
    for name in dict.fromkeys(info.name for info in registry.list("config_section")):
        if name in _RESERVED_SECTIONS:
            raise ConfigError(name, f"a plugin registers the section {name!r}, a name the Config class uses itself")
        try:
            section = registry.load("config_section", name)
        except PluginError as exc:
            if name in used:
                raise
            warnings.warn(f"config section {name!r} is left out: {exc}", stacklevel=2)
            continue
        if not isinstance(section, ConfigSection):
            raise ConfigError(name, f"the verl.config_sections entry point {name!r} is a {type(section).__name__}, "
                                    f"not a verl_core.config.ConfigSection")
        if name in CORE_SECTIONS:
            raise ConfigError(name, f"a plugin registers the section {name!r}, which the core owns; rename it")
        sections[name] = section
    return sections


class Config:
    """A complete, validated run configuration: one attribute per section (``config.run.seed``).

    The core's sections are typed below; sections registered by plugins are attributes too.

    Attributes:
        raw: the settings it was resolved from, before any preset (``None`` when built directly).
        profile: where the defaults came from: the preset of a ``builtin:`` model, or each section's
            dataclass defaults, lengths fitted to a small model (``verl config show`` prints it).
    """

    run: RunConfig
    model: ModelConfig
    data: DataConfig
    trainer: PluginSection
    reward: PluginSection
    backend: PluginSection
    rollout: PluginSection
    algorithm: PluginSection
    executor: PluginSection

    def __init__(self, sections: Mapping[str, Any], specs: Mapping[str, ConfigSection] | None = None, *,
                 raw: Mapping[str, Any] | None = None, profile: str = "") -> None:
        self._sections = dict(sections)
        self._specs = dict(CORE_SECTIONS if specs is None else specs)
        self.raw = raw
        self.profile = profile

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self._sections == other._sections

    def __repr__(self) -> str:
        return f"Config({self._sections!r})"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._sections[name]
        except KeyError:
            raise AttributeError(f"the config has no section {name!r}; sections: {list(self._sections)}") from None

    def section_spec(self, name: str) -> ConfigSection:
        """How section ``name`` is built (its schema, or the plugin kind that owns it)."""
        return self._specs[name]

    @property
    def sections(self) -> dict[str, Any]:
        """Section name -> its dataclass or :class:`PluginSection`, in order."""
        return dict(self._sections)


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


# ---------------------------------------------------------------------------- resolving
def resolve_config(raw: Mapping[str, Any], registry: Any, *, max_positions: int | None = None) -> Config:
    """Turn a raw dict into a validated :class:`Config`; plugin sections use the plugin's class.

    Selecting a plugin here imports its module (its Config class); plugin modules keep heavy
    engine imports out of module scope, so this stays cheap and happens before any model loads.
    The defaults follow the model (``Config.profile``): a ``builtin:`` model's preset, else each
    section's own, with prompt and response lengths fitted to a small model's context window
    (:func:`fitted_lengths`: ``max_positions``, or ``max_position_embeddings`` from a local
    ``model.path``'s config.json).
    """
    from verl_core.registry import BUILTIN_PREFIX, load_builtin

    sections = config_sections(registry, used=list(raw))
    known = list(sections)
    user = raw
    raw = _with_environment_task(raw, registry)
    model = raw.get("model") if isinstance(raw.get("model"), Mapping) else {}
    path = str(model.get("path", ModelConfig.path))
    if path.startswith(BUILTIN_PREFIX):
        # A built-in model's plugin ships the settings it was tuned with (ModelProvider.preset, like a Hugging Face
        # model ships its generation config). A [model] that is not a table fails its own check below.
        if isinstance(raw.get("model", {}), Mapping):
            raw = _layered(raw, load_builtin(registry, "model", path, key="model.path").preset or {})
        applied = [f"{section}.{key}" for section, values in raw.items() if isinstance(values, Mapping)
                   for key in values if key not in (user.get(section) or {})]
        profile = (f"built-in task (the preset of {path} sets {', '.join(applied) or 'nothing you left unset'}; "
                   f"settings you give win)")
    else:
        max_positions = max_positions if max_positions is not None else _max_positions(path, raw.get("run"), registry)
        fitted = fitted_lengths(max_positions)
        raw = _layered(raw, fitted)
        profile = "own model (each section's defaults" + (
            f"; data.max_prompt_length and rollout.max_new_tokens fitted to its max_position_embeddings="
            f"{max_positions})" if fitted else "; no builtin: model preset)")
    raw, source_default = _with_source_defaults(raw, registry)
    profile += source_default + _steps_note(user)
    for section, value in raw.items():
        if section not in known:
            raise ConfigError(section, f"unknown section{_suggest(section, known)}; sections are {known}")
        if not isinstance(value, Mapping):
            raise ConfigError(section, f"must be a table of settings, got {type(value).__name__}")
    built: dict[str, Any] = {}
    for section, spec in sections.items():
        values = dict(raw.get(section, {}))
        if spec.schema is not None:
            built[section] = build_dataclass(spec.schema, values, section)
            continue
        name = values.pop(spec.key, spec.default)
        if not isinstance(name, str) or (not name and spec.default):
            raise ConfigError(f"{section}.{spec.key}", "must be a plugin name")
        plugin = plugin_for_key(registry, spec.plugin_kind, name, f"{section}.{spec.key}") if name else None
        config_cls = getattr(plugin, "Config", None)
        if config_cls is None:
            if values:
                which = f"plugin {name!r} takes" if name else f"no {section} plugin is selected, so it takes"
                raise ConfigError(f"{section}.{next(iter(values))}", f"{which} no settings")
            built[section] = PluginSection(name, None)
        else:
            built[section] = PluginSection(name, build_dataclass(config_cls, values, section))
    plugin_for_key(registry, "run_store", built["run"].store, "run.store")  # an unknown one fails here
    return Config(built, sections, raw=user, profile=profile)


def _steps_note(user: Mapping[str, Any]) -> str:
    """Which of ``run.epochs`` and ``run.max_steps`` decides the run's length when both are set (epochs)."""
    run = user.get("run") if isinstance(user.get("run"), Mapping) else {}
    epochs = run.get("epochs")
    if "max_steps" not in run or not isinstance(epochs, int) or isinstance(epochs, bool) or epochs <= 0:
        return ""
    return (f"; run.epochs={epochs} decides the number of steps (epochs x training prompts // data.batch_size), "
            f"run.max_steps={run['max_steps']!r} is not used (set run.epochs=0 to count steps instead)")


def plugin_for_key(registry: Any, kind: str, name: str, key: str) -> Any:
    """The ``kind`` plugin the config ``key`` names; an unknown name's error starts with that key."""
    from verl_core.registry import UnknownPluginError

    try:
        return registry.load(kind, name)
    except UnknownPluginError as exc:
        raise UnknownPluginError(f"{key}: {exc}", kind=exc.kind, name=exc.name, installed=exc.installed,
                                 suggestions=exc.suggestions, install_hint=exc.install_hint) from None


def _with_source_defaults(raw: Mapping[str, Any], registry: Any) -> tuple[Mapping[str, Any], str]:
    """Layer what the step source ``trainer.mode`` names recommends for other sections under the user's
    settings (:meth:`~verl_core.contracts.StepSource.defaults`), with its note for the profile."""
    trainer = raw.get("trainer") if isinstance(raw.get("trainer"), Mapping) else {}
    mode = trainer.get("mode", CORE_SECTIONS["trainer"].default)
    if not isinstance(mode, str) or not mode:
        return raw, ""  # the section's own check names the bad value
    source = plugin_for_key(registry, "step_source", mode, "trainer.mode")
    recommended, note = source.defaults(raw, registry)
    return (_layered(raw, recommended), note) if recommended else (raw, "")


def _with_environment_task(raw: Mapping[str, Any], registry: Any) -> Mapping[str, Any]:
    """Layer the selected environment's built-in task (``Environment.task``) under the user's settings."""
    env = raw.get("environment") if isinstance(raw.get("environment"), Mapping) else {}
    name = env.get("name")
    if not name or not isinstance(name, str):
        return raw
    environment = plugin_for_key(registry, "environment", name, "environment.name")
    task_for = getattr(environment, "task_for", None)  # a task that follows the [environment] settings
    return _layered(raw, (task_for(env) if callable(task_for) else getattr(environment, "task", None)) or {})


def _layered(raw: Mapping[str, Any], under: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``raw`` with the settings of ``under`` beneath the user's own, section by section: theirs win."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for section, values in under.items():
        if isinstance(out.get(section, {}), Mapping):
            out[section] = {**values, **out.get(section, {})}
    return out


def fitted_lengths(max_positions: Any) -> dict[str, dict[str, int]]:
    """Default prompt and response lengths for a model's context window, as a preset (``{}``: the defaults fit).

    The defaults (512-token prompts, 64 new tokens) need 576 positions; a smaller model keeps a quarter
    of its positions (at most 64) for the response and the rest for the prompt.
    """
    from verl_core.contracts import RolloutConfig

    prompt, new = DataConfig.max_prompt_length, RolloutConfig.max_new_tokens
    if not isinstance(max_positions, int) or isinstance(max_positions, bool) or not 2 <= max_positions < prompt + new:
        return {}
    new = min(new, max_positions // 4) or 1
    return {"data": {"max_prompt_length": max_positions - new}, "rollout": {"max_new_tokens": new}}


def _max_positions(path: str, run: Any, registry: Any) -> Any:
    """``max_position_embeddings`` from a local model directory's config.json (None if there is none); from
    the run directory's copy of it when the directory is gone (:meth:`~verl_core.contracts.RunStore.stand_in`)."""
    run = run if isinstance(run, Mapping) else {}  # a run.output_dir left unset is the default one
    if output_dir := run.get("output_dir", RunConfig.output_dir):
        store = plugin_for_key(registry, "run_store", str(run.get("store", RunConfig.store)), "run.store")
        path = store(Path(str(output_dir))).stand_in("model.path", path, note=False)
    try:
        return json.loads((Path(path).expanduser() / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None


@dataclass(frozen=True)
class Range:
    """The valid values of a numeric config field, declared with the field and checked when the config is built
    (before anything loads), in any section, the core's or a plugin's::

        clip: float = field(default=0.2, metadata={"range": Range(gt=0, le=1)})

    Fields without one follow :data:`NAMED_RANGES` by name (a learning rate is positive wherever it is).
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    hint: str = ""

    def problem(self, value: float) -> str | None:
        """``"must be > 0, got -1.0 (...)"`` when ``value`` is outside the range, else None."""
        bounds = [(op, b) for op, b in ((">", self.gt), (">=", self.ge), ("<", self.lt), ("<=", self.le))
                  if b is not None]
        tests = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
        if all(tests[op](value, b) for op, b in bounds):  # NaN fails every bound
            return None
        rule = " and ".join(f"{op} {b:g}" for op, b in bounds)
        return f"must be {rule}, got {value!r}" + (f" ({self.hint})" if self.hint else "")


#: Ranges by field name (a ``*`` matches any prefix), for fields that declare none: ``backend.lr=-1`` fails
#: here, naming the key, instead of inside torch after the model has loaded.
NAMED_RANGES: dict[str, Range] = {
    "lr": Range(gt=0, hint="a learning rate, e.g. 1e-6 for a real model"),
    "*_lr": Range(gt=0, hint="a learning rate, e.g. 1e-5"),
}


def _range_of(f: dataclasses.Field) -> Range | None:
    declared = f.metadata.get("range") if f.metadata else None
    if isinstance(declared, Range):
        return declared
    return NAMED_RANGES.get(f.name) or next((r for pattern, r in NAMED_RANGES.items()
                                             if pattern.startswith("*") and f.name.endswith(pattern[1:])), None)


def _check_ranges(obj: Any, fields: Mapping[str, dataclasses.Field], path: str) -> None:
    for name, f in fields.items():
        value, rng = getattr(obj, name, None), _range_of(f)
        if rng is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        problem = rng.problem(value)
        if problem:
            raise ConfigError(f"{path}.{name}", problem)


#: Keys that many peers (and verl's own docs) use for a pair of fields: where a section has the fields and no
#: field of the alias's name, the alias sets each of them that is not set by its own name.
KEY_ALIASES: dict[str, tuple[str, ...]] = {"clip_ratio": ("clip_ratio_low", "clip_ratio_high")}


def _expand_aliases(values: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(values)
    for alias, targets in KEY_ALIASES.items():
        if alias in out and alias not in fields and all(t in fields for t in targets):
            value = out.pop(alias)
            for target in targets:
                out.setdefault(target, value)
    return out


def build_dataclass(cls: type, values: Mapping[str, Any], path: str) -> Any:
    """Instantiate dataclass ``cls`` from ``values`` with type checks; then call ``validate()``."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values = _expand_aliases(values, fields)
    try:
        hints = typing.get_type_hints(cls)
    except NameError as exc:  # an annotation names a type only imported for type checkers
        raise ConfigError(path, f"{cls.__qualname__}'s field types cannot be resolved ({exc}); annotate config "
                                f"fields with types importable at run time") from None
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"{path}.{key}", f"unknown key{_suggest(key, list(fields))}; "
                                               f"valid keys: {', '.join(sorted(fields))}")
        kwargs[key] = _coerce(value, hints[key], f"{path}.{key}")
    obj = cls(**kwargs)
    _check_ranges(obj, fields, path)
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
        tried = [arg for arg in args if arg is not type(None)]
        for arg in tried:
            try:
                return _coerce(value, arg, path)
            except ConfigError as exc:
                error = exc
        if len(tried) == 1:  # ``X | None``: X's own reason (an inf is a float, but not a finite one)
            raise error
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
        # NaN passes every range check (each comparison with it is false), inf every one without an upper bound:
        # a temperature of inf samples uniformly, a kl_coef or lr of inf trains on NaN.
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(path, f"expected a finite number, got {value}")
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
    # A key that starts a family of keys (`clip_ratio` of clip_ratio_low/_high) names the family.
    family = [o for o in options if o.startswith(word + "_")]
    if len(family) > 1:
        return f" (did you mean one of {', '.join(map(repr, family))}?)"
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------- output
def config_to_dict(config: Config) -> dict[str, Any]:
    """The resolved config as plain data, plugin sections flattened with their ``name``."""
    out: dict[str, Any] = {}
    for name, value in config.sections.items():
        if isinstance(value, PluginSection):
            section = {config.section_spec(name).key: value.name}
            if value.config is not None:
                section.update(dataclasses.asdict(value.config))
            out[name] = section
        else:
            out[name] = dataclasses.asdict(value)
    return out


def dump_toml(data: Mapping[str, Any], unset: Mapping[str, str] | None = None) -> str:
    """Write a two-level dict of simple values as TOML (enough for configs).

    TOML has no null: an unset (``None``) value is left out, or, when ``unset`` has its dotted key,
    written as a comment with that text (what it follows, e.g. ``verl config show``).
    """
    lines: list[str] = []
    for section, values in data.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                if unset and f"{section}.{key}" in unset:
                    lines.append(f"# {key} = {unset[f'{section}.{key}']}")
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
