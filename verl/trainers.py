"""``PPOTrainer``, ``GRPOTrainer`` and ``DataConfig``: the Python API in the shape many articles show.

A thin layer over :class:`verl_core.trainer.Trainer`: every argument is one key of the run config, and
Hugging Face objects go to the trainer as they are. Anything else is a dotted override
(``overrides=["rollout.n=16"]``) or a TOML file (``config=``), as with ``verl run``.

=========================  ==================================================================
argument                   what it sets
=========================  ==================================================================
``actor_model``            the policy: a loaded causal LM, or a model directory (``model.path``)
``critic_model``           PPO's critic: a loaded model or a directory (``model.critic_path``);
                           default: initialised from the actor
``tokenizer``              a loaded tokenizer, or a directory (``model.tokenizer``)
``data_config``            the ``[data]`` section (:class:`DataConfig`)
``learning_rate``          ``backend.lr`` (``critic_learning_rate``: ``backend.critic_lr``)
``batch_size``             ``data.batch_size``: prompts per step
``kl_coef``                ``algorithm.kl_coef`` (> 0 adds the reference model)
``reward``                 ``reward.name``: a reward plugin, ``"auto"``, or ``"file:path.py:function"``
``output_dir``             ``run.output_dir``: config, metrics and checkpoints
``inference_client``       ``[rollout]``: an :class:`~verl.ExternalInferenceClient`'s server generates
                           (``rollout.name = "openai"``, its settings and sampling parameters)
``train(num_epochs=...)``  ``run.epochs``; ``train(max_steps=...)``: ``run.max_steps``
=========================  ==================================================================

Under ``torchrun --nproc_per_node=N train.py`` the run uses every process (``executor.name =
"torchrun"``, from ``verl-executor-torchrun``, unless the config names another executor): rank 0 is
the controller and the other processes serve as its workers, so ``train()`` returns on rank 0 only.

Example::

    from verl import DataConfig, PPOTrainer

    trainer = PPOTrainer(actor_model=model, critic_model=critic, tokenizer=tok,
                         data_config=DataConfig(dataset_name="./prompts.jsonl", prompt_column="text",
                                                max_prompt_length=512),
                         learning_rate=1e-6, batch_size=64, kl_coef=0.001, output_dir="runs/x")
    trainer.train(num_epochs=1)
    # later, in another process: the run directory holds the models and tokenizer it started from
    trainer = PPOTrainer.from_checkpoint("runs/x/checkpoints/step_000100")
    trainer.train(num_epochs=2, resume_from_checkpoint=True)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

__all__ = ["DataConfig", "PPOTrainer", "GRPOTrainer"]


@dataclass
class DataConfig:
    """Where the training prompts come from: the ``[data]`` section of the run config.

    Attributes:
        dataset_name: a local parquet / jsonl / json file, a local dataset directory (``save_to_disk``
            output, or a folder of data files), a Hugging Face Hub dataset id (``owner/name``, loaded with
            ``datasets``; offline, from its cache), or ``builtin:addition`` (``data.train``).
        prompt_column: the column with the prompt, a string or a chat message list (``data.prompt_key``).
        answer_column: the column with the ground truth the reward compares with (``data.answer_key``).
        max_prompt_length: longer prompts are dropped (``data.max_prompt_length``; ``None``: the default).
        split: the split of a dataset directory or Hub id to train on (``data.train_split``).
        val_dataset_name: validation prompts, in the same forms (``data.val``; empty: none, or the
            test split of a ``builtin:`` dataset).
        val_split: the split to validate on (``data.val_split``).
        data_source: the ``data_source`` of rows without one; it picks the reward with ``reward="auto"``
            (``data.data_source``).
    """

    dataset_name: str | os.PathLike = "builtin:addition"
    prompt_column: str = "prompt"
    answer_column: str = "answer"
    max_prompt_length: int | None = None
    split: str = "train"
    val_dataset_name: str | os.PathLike = ""
    val_split: str = "test"
    data_source: str = ""

    def settings(self) -> dict[str, Any]:
        """The ``[data]`` keys this sets."""
        out: dict[str, Any] = {"train": str(self.dataset_name), "prompt_key": self.prompt_column,
                               "answer_key": self.answer_column, "train_split": self.split,
                               "val_split": self.val_split}
        if self.max_prompt_length is not None:
            out["max_prompt_length"] = self.max_prompt_length
        if str(self.val_dataset_name):
            out["val"] = str(self.val_dataset_name)
        if self.data_source:
            out["data_source"] = self.data_source
        return out


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def _torchrun_world_size() -> int:
    """The processes torchrun (or a launcher exporting the same environment) started; 1 outside one."""
    if not all(os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return 1
    return int(os.environ["WORLD_SIZE"])


class _RLTrainer:
    """The shared shape of :class:`PPOTrainer` and :class:`GRPOTrainer` (see the module docstring).

    The core :class:`~verl_core.trainer.Trainer` is built at once, so a setting it refuses fails here,
    before any model loads; ``self.config`` is its resolved config and ``self.trainer`` the trainer of
    the last :meth:`train`.
    """

    #: ``algorithm.name`` of the runs this class trains.
    algorithm: ClassVar[str] = ""
    #: Whether the algorithm trains a critic (``critic_model`` is accepted).
    has_critic: ClassVar[bool] = False

    def __init__(self, actor_model: Any = None, *, critic_model: Any = None, tokenizer: Any = None,
                 data_config: DataConfig | None = None, learning_rate: float | None = None,
                 critic_learning_rate: float | None = None, batch_size: int | None = None,
                 kl_coef: float | None = None, reward: str | None = None,
                 output_dir: str | os.PathLike | None = None, config: str | os.PathLike | None = None,
                 overrides: Sequence[str] = (), registry: Any = None, inference_client: Any = None) -> None:
        from verl_core.config import ConfigError, load_raw_config
        from verl_core.registry import PluginRegistry

        if not self.has_critic and (critic_model is not None or critic_learning_rate is not None):
            raise ConfigError("model.critic_path", f"{type(self).__name__} ({self.algorithm}) trains no critic; "
                                                   f"critic_model and critic_learning_rate are for PPOTrainer")
        self._registry = registry or PluginRegistry()
        raw = load_raw_config(config)
        chosen = raw.get("algorithm", {}).get("name", self.algorithm)
        if chosen != self.algorithm:
            raise ConfigError("algorithm.name", f"{config} selects {chosen!r}, but {type(self).__name__} trains "
                                                f"{self.algorithm!r}; leave algorithm.name out of the file")
        keys = {"algorithm.name": self.algorithm, "backend.lr": learning_rate,
                "backend.critic_lr": critic_learning_rate, "data.batch_size": batch_size,
                "algorithm.kl_coef": kl_coef, "reward.name": reward,
                "run.output_dir": None if output_dir is None else str(output_dir)}
        for key, value in {**{f"data.{k}": v for k, v in (data_config.settings() if data_config else {}).items()},
                           **keys}.items():
            if value is not None:
                section, name = key.split(".")
                raw.setdefault(section, {})[name] = value
        self._objects = self._take_objects(raw.setdefault("model", {}), actor_model, tokenizer, critic_model)
        if inference_client is not None:
            # A server the run samples from; the trainer syncs its weights as the client's weight_sync says.
            raw["rollout"] = {**raw.get("rollout", {}), **inference_client.rollout_settings()}
        if _torchrun_world_size() > 1 and "name" not in raw.get("executor", {}):
            # `torchrun --nproc_per_node=N train.py`: one run over the N processes, not N runs.
            raw.setdefault("executor", {})["name"] = "torchrun"
        self._raw, self._overrides, self._checkpoint = raw, list(overrides), None
        self.trainer = self._build({})
        self.config = self.trainer.config

    @staticmethod
    def _take_objects(model_section: dict[str, Any], actor: Any, tokenizer: Any, critic: Any) -> dict[str, Any]:
        """Paths become ``[model]`` keys; loaded objects go to the Trainer (which records where they came from)."""
        objects: dict[str, Any] = {}
        for key, argument, value in (("path", "model", actor), ("tokenizer", "tokenizer", tokenizer),
                                     ("critic_path", "critic_model", critic)):
            if _is_path(value):
                model_section[key] = str(value)
            elif value is not None:
                objects[argument] = value
        return objects

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, actor_model: Any = None, *, critic_model: Any = None,
                        tokenizer: Any = None, overrides: Sequence[str] = (), registry: Any = None) -> "_RLTrainer":
        """Continue a run: ``path`` is a checkpoint (``.../checkpoints/step_000100``) or a run directory (its latest).

        The run's saved config is used as it is, and the actor, critic and tokenizer are rebuilt from the
        run directory's own copies (``model/``, ``critic_model/``: written when the run started, from a
        directory or an object), so nothing else is needed, not even the original model directory.
        Objects passed here are used instead of the copies.
        """
        from verl_core.config import ConfigError, RunConfig, plugin_for_key
        from verl_core.kit import OBJECT_PREFIX, CheckpointError
        from verl_core.registry import PluginRegistry

        registry = registry or PluginRegistry()
        run, ckpt = plugin_for_key(registry, "run_store", RunConfig.store, "run.store").find(path, verify=False)
        saved = run.recorded_config()
        if saved is None:
            raise CheckpointError(f"{run.run_dir} has no config.toml next to its checkpoints")
        name = saved.get("algorithm", {}).get("name")
        if name != cls.algorithm:
            raise ConfigError("algorithm.name", f"{path} is a {name!r} run, not {cls.algorithm!r}: continue it with "
                                                f"the trainer of its algorithm (or verl.Trainer.from_checkpoint)")
        given = {"path": actor_model, "tokenizer": tokenizer, "critic_path": critic_model}
        arguments = {"path": "actor_model", "tokenizer": "tokenizer", "critic_path": "critic_model"}
        copied = set(run.model_copies(saved.get("model", {})))
        for key, recorded in saved.get("model", {}).items():
            if (isinstance(recorded, str) and recorded.startswith(OBJECT_PREFIX) and given.get(key) is None
                    and key not in copied):  # a run from before run directories held their models
                raise ConfigError(f"model.{key}", f"the run was given {recorded}, and its directory holds no copy "
                                                  f"of it; pass it again: {cls.__name__}.from_checkpoint("
                                                  f"{str(path)!r}, {arguments[key]}=...)")
        self = cls.__new__(cls)
        self._registry = registry
        section: dict[str, Any] = {}
        self._objects = cls._take_objects(section, actor_model, tokenizer, critic_model)
        self._raw, self._checkpoint = saved, ckpt
        self._overrides = [*(f"model.{k}={json.dumps(v)}" for k, v in section.items()), *overrides]
        self.trainer = self._build({})
        self.config = self.trainer.config
        return self

    @property
    def run_dir(self) -> Path:
        """The run directory: ``config.toml``, ``metrics.jsonl`` and ``checkpoints/``."""
        return self.trainer.run_dir

    # ------------------------------------------------------------------ training
    def train(self, num_epochs: int | None = None, *, max_steps: int | None = None,
              resume_from_checkpoint: bool | str | os.PathLike | None = None) -> dict[str, float]:
        """Train; returns the last metrics (validation included).

        Args:
            num_epochs: passes over the training prompts in total, counting those before a resume
                (``run.epochs``); ``max_steps`` counts RL steps instead. Neither: the config's ``run.max_steps``.
            resume_from_checkpoint: ``True`` continues from the latest checkpoint of the run directory (or
                the one :meth:`from_checkpoint` named) and fails if there is none; a path continues from that
                checkpoint or run directory; ``False`` starts over; ``None`` (default) continues when there
                is a checkpoint to continue from.
        """
        from verl_core.kit import CheckpointError

        run: dict[str, Any] = {}
        if num_epochs is not None:
            run["epochs"] = num_epochs
        if max_steps is not None:
            run["max_steps"] = max_steps
            run.setdefault("epochs", 0)
        if resume_from_checkpoint is False:
            run["resume"] = "never"
        elif _is_path(resume_from_checkpoint):
            run["resume"] = str(resume_from_checkpoint)
        self.trainer = self._build(run)
        if resume_from_checkpoint is True and self.trainer.config.run.resume == "auto":
            if self.trainer.store.latest(verify=False) is None:
                raise CheckpointError(f"resume_from_checkpoint=True, but {self.trainer.run_dir} has no complete "
                                      f"checkpoint; train without it first, or pass a checkpoint path")
        self.config = self.trainer.config
        return self.trainer.train()

    def _build(self, run: dict[str, Any]) -> Any:
        from verl_core.config import apply_overrides, resolve_config
        from verl_core import Trainer

        overrides = [*self._overrides, *(f"run.{k}={json.dumps(v)}" for k, v in run.items())]
        if self._checkpoint is not None:
            return Trainer.from_checkpoint(self._checkpoint, overrides, registry=self._registry, **self._objects)
        raw = apply_overrides(self._raw, overrides)
        return Trainer(resolve_config(raw, self._registry), registry=self._registry, **self._objects)


class PPOTrainer(_RLTrainer):
    """PPO with a critic (``algorithm.name = "ppo"``): see the module docstring for the arguments.

    ``critic_model`` starts the critic from a model of its own: a causal LM (its backbone, with a new
    value head at zero) or a model with a one-label score head (a trained critic or a reward model; the
    head is kept). It must read the actor's token ids (the same tokenizer). Default: the actor's model.
    """

    algorithm = "ppo"
    has_critic = True


class GRPOTrainer(_RLTrainer):
    """GRPO (``algorithm.name = "grpo"``): group-relative advantages, no critic; arguments as :class:`PPOTrainer`."""

    algorithm = "grpo"
