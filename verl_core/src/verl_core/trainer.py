"""The single controller: one process that owns the run and drives the dataflow.

:class:`Trainer` resolves plugins through the registry, places worker groups with the executor,
and then for each step samples prompts, runs the algorithm's dataflow, emits metrics through the
hooks, validates and checkpoints. ``verl run`` is a thin layer over this class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from verl_core.agent_loop import ENV_REWARDS, run_episodes
from verl_core.boundary import Boundary, check_scores, finite_rows, plugin_label
from verl_core.checkpoint import CheckpointError, CheckpointManager, CheckpointWriteError
from verl_core.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_to_dict,
    dump_toml,
    load_raw_config,
    resolve_config,
)
from verl_core.contracts import StepSource
from verl_core.dataflow import Dataflow, DataflowBuilder, StepContext
from verl_core.data import HUB_ID, PromptSampler, build_datasets, check_data_source
from verl_core.multimodal import load_processor
from verl_core.hooks import build_plugin_manager
from verl_core.health import HealthMonitor
from verl_core.progress import Progress
from verl_core.interfaces import ModelSpec, RewardScorer, Role, WorkerFailedError
from verl_core.registry import BUILTIN_PREFIX, PluginRegistry, load_builtin
from verl_core.rollout_utils import check_rollout_multi_modal, check_weight_sync, guard_limit, sync_rollout_weights
from verl_core.rundir import RunLock, open_run_dir
from verl_core.run_model import check_same_model, copied_keys, copy_overrides, stand_in, write_run_models
from verl_core.samples import batch_samples, flat_group_fraction, sample_records, spread
from verl_core.signals import Preempted, StopSignals

__all__ = ["Trainer", "resolve_model_path", "check_model_source", "object_source", "OBJECT_PREFIX", "copied_keys"]


def _create_worker(backend: Any, role: Role, model: ModelSpec, seed: int, world: Any) -> Any:
    return backend.create_worker(role=role, model=model, world=world, seed=seed)


def resolve_model_path(path: str, registry: PluginRegistry | None = None) -> str:
    """Turn ``builtin:<name>`` into the local directory its ``verl.models`` plugin builds and caches."""
    if path.startswith(BUILTIN_PREFIX):
        return str(load_builtin(registry or PluginRegistry(), "model", path, key="model.path").model_dir())
    return path


#: How a run's config records a model, tokenizer or critic given to :class:`Trainer` as an object.
OBJECT_PREFIX = "<object: "


def object_source(obj: Any) -> str:
    """The config entry of an object given to :class:`Trainer`: ``"<object: Qwen2ForCausalLM from '/m/q'>"``."""
    origin = getattr(obj, "name_or_path", "")
    return f"{OBJECT_PREFIX}{type(obj).__name__}{f' from {origin!r}' if isinstance(origin, str) and origin else ''}>"


def check_model_source(path: str, key: str, *, need_config: bool = True, argument: str = "model") -> None:
    """Refuse a model (or tokenizer) path that cannot load, before anything does (:class:`ConfigError` on ``key``).

    A local path must be a directory, holding ``config.json`` when ``need_config``; a Hub id (``owner/name``)
    is left to ``from_pretrained`` where a network exists. An object's entry (:func:`object_source`) asks
    for the object again, as ``Trainer(..., argument=...)``.
    """
    if path.startswith(OBJECT_PREFIX):
        raise ConfigError(key, f"the run was given {path}, and a config or checkpoint cannot rebuild an object; pass "
                               f"it again: Trainer.from_checkpoint(run_dir, {argument}=...), or set {key} to a "
                               f"model directory")
    where = Path(path).expanduser()
    if where.is_dir():
        if need_config and not (where / "config.json").is_file():
            raise ConfigError(key, f"{path!r} has no config.json, so it is not a Hugging Face model directory "
                                   f"(save_pretrained writes one)")
    elif where.exists():
        raise ConfigError(key, f"{path!r} is a file; give a Hugging Face model directory (save_pretrained output)")
    elif path.startswith(("/", ".", "~")) or not HUB_ID.match(path):
        raise ConfigError(key, f"{path!r} does not exist; give a local Hugging Face model directory, a builtin: "
                               f"model such as builtin:tiny-qwen2-addition, or a Hub id (owner/name) where a "
                               f"network exists")


#: Every algorithm's config before Core v2 (now PPOFamilyConfig), with the old defaults.
_V1_ALGORITHM_DEFAULTS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 0.0, "kl_coef": 0.0,
                          "kl_estimator": "low_var_kl", "kl_in_reward": False, "entropy_coef": 0.0,
                          "loss_agg_mode": "token-mean", "use_rollout_log_probs": False, "rollout_is_cap": 0.0}


def _without_v1_algorithm_keys(raw: dict[str, Any], registry: PluginRegistry) -> dict[str, Any]:
    """A pre-Core-v2 config.toml: drop PPO keys at their old defaults that the algorithm (DPO, SPIN, ...)
    no longer takes; one set to anything else is left for the config check to refuse by name."""
    section = raw.get("algorithm")
    if not isinstance(section, dict):
        return raw
    config_cls = getattr(registry.load("algorithm", section.get("name", "grpo")), "Config", None)
    accepted = {f.name for f in dataclasses.fields(config_cls)} if config_cls else set()
    stale = [k for k, v in _V1_ALGORITHM_DEFAULTS.items() if k in section and k not in accepted and section[k] == v]
    if stale:
        logging.getLogger(__name__).warning("the saved config predates Core v2; dropping algorithm keys its algorithm "
                                            "no longer has (at their old defaults): %s", ", ".join(stale))
        raw = {**raw, "algorithm": {k: v for k, v in section.items() if k not in stale}}
    return raw


def _create_reward_model_worker(backend: Any, model: ModelSpec, seed: int, world: Any) -> Any:
    # Module level, not a closure: executors may pickle the factory into worker processes.
    return backend.create_worker(role=Role.REWARD_MODEL, model=model, world=world, seed=seed)


class Trainer:
    """Runs RL training from a :class:`~verl_core.config.Config`.

    Args:
        config: the resolved configuration.
        registry: plugin registry (a fresh one reading installed entry points by default).
        model: an already loaded Hugging Face causal LM to train instead of ``config.model.path``. The
            config records it (:func:`object_source`) and takes its defaults from it, not from a ``builtin:``
            model's preset: prompt and response lengths that fit its ``max_position_embeddings``.
        tokenizer: an already loaded tokenizer (default: from the model directory; needed with ``model``).
        critic_model: an already loaded model the critic starts from, instead of ``config.model.critic_path``
            (see :class:`~verl_core.config.ModelConfig`); only for algorithms with a critic.

    A run given objects records them as ``"<object: ...>"`` and saves them into its directory
    (:mod:`verl_core.run_model`), which :meth:`from_checkpoint` loads them from.

    Example:
        >>> trainer = Trainer.from_config(overrides=["run.max_steps=5"])  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, config: Config, *, registry: PluginRegistry | None = None, model: Any = None,
                 tokenizer: Any = None, critic_model: Any = None) -> None:
        self.registry = registry or PluginRegistry()
        if model is not None or tokenizer is not None or critic_model is not None:
            config = self._with_objects(config, model=model, tokenizer=tokenizer, critic=critic_model)
        self.config = config
        self._model_obj = model
        self._critic_obj = critic_model
        self.tokenizer = tokenizer
        self.run_dir = Path(config.run.output_dir)
        self.run_lock: RunLock | None = None  # held from setup to the end of train() (verl_core.rundir)
        self.step = 0
        self._ready = False
        #: Worker-group restarts after a dead worker (``run.max_restarts``) and checkpoints that failed to write.
        self.restarts = 0
        self.failed_saves = 0
        self._checkpoint: tuple[int, Path] | None = None  # (step, path) of the checkpoint a restart goes back to
        #: Where each step's prompts or batch come from (the ``trainer.mode`` plugin); built with the workers.
        self.source: StepSource | None = None
        self.reuse_update_log_probs = False
        self._drawn: list[int] = []  # the training prompts of the step (their indices)
        self._resumed: tuple[Path, dict[str, Any]] | None = None  # the checkpoint resumed from and its state

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(cls, path: str | os.PathLike | None = None, overrides: Sequence[str] = (), *,
                    registry: PluginRegistry | None = None, **kwargs: Any) -> "Trainer":
        """Build from a TOML file and ``section.key=value`` overrides (validated up front)."""
        registry = registry or PluginRegistry()
        raw = apply_overrides(load_raw_config(path), overrides)
        return cls(resolve_config(raw, registry), registry=registry, **kwargs)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, overrides: Sequence[str] = (), *,
                        registry: PluginRegistry | None = None, **kwargs: Any) -> "Trainer":
        """Continue the run a checkpoint (or run directory) belongs to, with its saved config.

        The models and tokenizer come from the run's own copies (:mod:`verl_core.run_model`) where it has
        them, so the original model directory (or object) is not needed; ``model=``, ``tokenizer=`` and
        ``critic_model=`` objects, and ``model.*`` overrides, take their place.
        """
        ckpt = CheckpointManager.resolve(path)
        run_dir = ckpt.parent.parent
        config_file = run_dir / "config.toml"
        if not config_file.is_file():
            raise CheckpointError(f"{run_dir} has no config.toml next to its checkpoints")
        registry = registry or PluginRegistry()
        saved = _without_v1_algorithm_keys(load_raw_config(config_file), registry)
        given = {key for key, argument in (("path", "model"), ("tokenizer", "tokenizer"),
                                           ("critic_path", "critic_model")) if kwargs.get(argument) is not None}
        overrides = [*copy_overrides(run_dir, saved.get("model", {}), given=given),
                     f"run.resume={json.dumps(str(ckpt))}", f"run.output_dir={json.dumps(str(run_dir))}", *overrides]
        raw = apply_overrides(saved, overrides)
        return cls(resolve_config(raw, registry), registry=registry, **kwargs)

    def _with_objects(self, config: Config, *, model: Any, tokenizer: Any, critic: Any) -> Config:
        """The config re-resolved for objects: their entries recorded, the model's own defaults under the user's."""
        raw = json.loads(json.dumps(config.raw if config.raw is not None else config_to_dict(config)))
        section = raw.setdefault("model", {})
        for key, obj in (("path", model), ("tokenizer", tokenizer), ("critic_path", critic)):
            if obj is not None:
                section[key] = object_source(obj)
        positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        return resolve_config(raw, self.registry, max_positions=positions)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Load data, models and engines; restore a checkpoint when resuming."""
        if self._ready:
            return
        cfg = self.config
        self._source_cls: type[StepSource] = self.registry.load("step_source", cfg.trainer.name)
        threads = cfg.run.threads or max(1, (os.cpu_count() or 1) // 2)
        torch.set_num_threads(self._source_cls.torch_threads(cfg.trainer.config, threads))
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        model_path = (stand_in(self.run_dir, "model.path", resolve_model_path(cfg.model.path, self.registry))
                      if self._model_obj is None else (cfg.model.path or ""))
        tok_path = stand_in(self.run_dir, "model.tokenizer", cfg.model.tokenizer) or model_path
        self._check_sources(model_path, tok_path)
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(tok_path,
                                                               trust_remote_code=cfg.model.trust_remote_code)
            except (OSError, ValueError) as exc:
                raise ConfigError("model.tokenizer" if cfg.model.tokenizer else "model.path",
                                  f"cannot load a tokenizer from {tok_path!r}: {exc}") from exc
        if self.registry.load("executor", cfg.executor.name).is_controller(cfg.executor.config):
            # A resume with another model than the directory recorded stops here, from metadata, before weights load.
            check_same_model(self.run_dir, cfg.run.resume, path=model_path, module=self._model_obj,
                             tokenizer=self.tokenizer)
            self.run_lock = open_run_dir(cfg, self.registry)  # one run per directory, a resume only of what it holds
            write_run_models(self.run_dir, cfg.model, model=self._model_obj, tokenizer=self.tokenizer,
                             critic=self._critic_obj)  # once: resume and export need no model directory
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ValueError(f"model.tokenizer: the tokenizer at {tok_path!r} has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token
            logging.getLogger(__name__).warning(
                "the tokenizer at %r has no pad token; padding with its eos token %r (padded positions are masked "
                "out, so this changes nothing learned)", tok_path, self.tokenizer.eos_token)
        # Mixed precision or a 16-bit engine on float32 weights differ like 16-bit weights do.
        self.max_log_prob_gap = guard_limit(cfg.rollout.config.max_log_prob_gap, [
            cfg.model.dtype, cfg.backend.config.compute_dtype(cfg.model.dtype),
            cfg.rollout.config.compute_dtype(cfg.model.dtype)])
        self.health = HealthMonitor(cfg.run, self.max_log_prob_gap)  # warnings from the metrics (verl_health)
        self.model_spec = ModelSpec(path=model_path, tokenizer_path=tok_path, dtype=cfg.model.dtype,
                                    trust_remote_code=cfg.model.trust_remote_code, module=self._model_obj)

        self.algorithm = self.registry.load("algorithm", cfg.algorithm.name)(cfg.algorithm.config)
        needs = self.algorithm.requirements()
        env = cfg.environment
        # One environment per trajectory (a partial, so it pickles like the worker factories).
        self.make_environment = (functools.partial(self.registry.load("environment", env.name), env.config)
                                 if env.name else None)
        self.critic_spec = self._critic_spec(needs.critic)
        with Progress("data preparation", total=2, unit="splits") as bar:  # tokenizing can take a while
            self.train_rows, self.val_rows = self._load_data(needs.data)
            bar.update(2, train_prompts=len(self.train_rows), val_prompts=len(self.val_rows))
        self.sampler = PromptSampler(len(self.train_rows), cfg.data.batch_size, seed=cfg.run.seed,
                                     shuffle=cfg.data.shuffle)
        #: Steps in total: run.max_steps, or run.epochs passes over the prompts (a short last batch is dropped).
        self.max_steps = (cfg.run.epochs * (len(self.train_rows) // cfg.data.batch_size) if cfg.run.epochs
                          else cfg.run.max_steps)
        # Every data_source's reward is resolved now: a missing one fails before any model loads.
        self.reward: RewardScorer = self.registry.load("scorer", cfg.reward.name)(
            config=cfg.reward.config, registry=self.registry, tokenizer=self.tokenizer,
            data_sources={r["data_source"] for r in (*self.train_rows, *self.val_rows)})

        backend_config = cfg.backend.config
        if not backend_config.total_training_steps:
            # The length of a cosine schedule; a copy, so the saved config still says "follow max_steps".
            backend_config = dataclasses.replace(backend_config, total_training_steps=self.max_steps)
        self._backend = self.registry.load("backend", cfg.backend.name)(backend_config)
        builder = DataflowBuilder()
        self.algorithm.build_dataflow(builder)
        self.dataflow: Dataflow = builder.build()
        self._check_step_source(needs)  # before any model loads
        self.reuse_update_log_probs = self._old_log_probs_reusable()
        self.boundary = self._boundary()
        self.hooks = build_plugin_manager(self.registry, loggers=cfg.run.loggers, disable_hooks=cfg.run.disable_hooks)
        self.checkpoints = CheckpointManager(self.run_dir, keep=cfg.run.keep_checkpoints)
        self._backend.check(model=self.model_spec, world_size=cfg.executor.config.world_size)  # before any model loads
        self._start_workers("auto" if cfg.run.resume == "force" else cfg.run.resume)
        self._ready = True

    def _start_workers(self, resume: str) -> None:
        """Start the executor, the worker groups and the rollout engine; restore ``resume`` (see ``run.resume``)."""
        cfg = self.config
        needs = self.algorithm.requirements()
        backend = self._backend
        self.executor = self.registry.load("executor", cfg.executor.name)(cfg.executor.config)
        self.executor.use_plugins([("backend", cfg.backend.name), ("rollout", cfg.rollout.name),
                                   ("algorithm", cfg.algorithm.name)])

        def group(role: Role) -> Any:
            # A partial, not a closure over the trainer: executors may pickle it into worker processes.
            spec = self.critic_spec if role is Role.CRITIC else self.model_spec
            factory = functools.partial(_create_worker, backend, role, spec, cfg.run.seed)
            return self.executor.create_group(role=role, factory=factory)

        try:
            self.actor = group(Role.ACTOR)
            self.critic = group(Role.CRITIC) if needs.critic else None
            self.reference = group(Role.REFERENCE) if needs.reference else None
            self.rollout = self.executor.create_rollout(
                engine=self.registry.load("rollout", cfg.rollout.name), config=cfg.rollout.config,
                model=self.model_spec, tokenizer=self.tokenizer, actor=self.actor)
            check_weight_sync(self.rollout, self.actor)  # before the first step, not at its first sync
            self._resume(resume)
            reward_model = self.reward.reward_model_path()
            if reward_model:
                self._start_reward_model(backend, reward_model)
            self.source = self._source_cls(cfg.trainer.config, trainer=self, resumed=self._resumed)
        except BaseException:
            self.executor.shutdown()  # workers already started must not outlive a failed set-up
            raise

    def _check_sources(self, model_path: str, tok_path: str) -> None:
        """Paths that cannot load fail here, naming their key, not later as a traceback from transformers."""
        cfg = self.config
        if self._model_obj is None:
            check_model_source(model_path, "model.path")
        elif self.tokenizer is None and not cfg.model.tokenizer:
            raise ConfigError("model.tokenizer", "a model given as an object needs its tokenizer: pass tokenizer= "
                                                 "too, or set model.tokenizer to a tokenizer directory")
        if self.tokenizer is None and cfg.model.tokenizer:
            check_model_source(tok_path, "model.tokenizer", need_config=False, argument="tokenizer")
        for key, spec in (("data.train", cfg.data.train), ("data.val", cfg.data.val)):
            check_data_source(spec, key)

    def _critic_spec(self, needed: bool) -> ModelSpec:
        """Where the critic starts: ``critic_model=`` or ``model.critic_path``, else the actor's model."""
        path = self.config.model.critic_path
        if self._critic_obj is None and not path:
            return self.model_spec
        if not needed:
            raise ConfigError("model.critic_path", f"algorithm {self.config.algorithm.name!r} trains no critic; "
                                                   f"leave model.critic_path and critic_model= out, or use one "
                                                   f"with a critic (ppo)")
        if self._critic_obj is None:
            path = stand_in(self.run_dir, "model.critic_path", resolve_model_path(path, self.registry))
            check_model_source(path, "model.critic_path", argument="critic_model")
        return dataclasses.replace(self.model_spec, path=path, module=self._critic_obj)

    def _check_step_source(self, needs: Any) -> None:
        """Refuse a ``trainer.mode`` the algorithm or the executor cannot run (:class:`ConfigError`)."""
        cfg = self.config
        self.registry.load("step_source", cfg.trainer.name).check(
            cfg.trainer.config, mode=cfg.trainer.name, algorithm=cfg.algorithm.name,
            generates=self.dataflow.rollout_request is not None, off_policy=needs.off_policy,
            executor=self.registry.load("executor", cfg.executor.name), executor_config=cfg.executor.config)

    def _model_config(self) -> dict[str, Any] | None:
        """The policy model's Hugging Face config as a dict (of the object, else its config.json); None unknown."""
        module = self.model_spec.module
        try:
            return (module.config.to_dict() if module is not None else
                    json.loads((Path(self.model_spec.path) / "config.json").read_text()))
        except (OSError, ValueError, AttributeError):
            return None

    def _boundary(self) -> Boundary:
        """The checks on what this run's plugins return, with their names (one per rollout engine)."""
        cfg, label = self.config, functools.partial(plugin_label, self.registry)
        vocab = len(self.tokenizer)
        config = self._model_config() or {}
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            # A model may have more embedding rows than its tokenizer has tokens (Qwen: 151,936 and 151,665).
            vocab = max(vocab, int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0))
        return Boundary(rollout=label("rollout", cfg.rollout.name), scorer=label("scorer", cfg.reward.name),
                        environment=label("environment", cfg.environment.name) if cfg.environment.name else "",
                        algorithm=label("algorithm", cfg.algorithm.name), vocab_size=vocab,
                        on_invalid=getattr(cfg.reward.config, "on_invalid", "stop"))

    def _old_log_probs_reusable(self) -> bool:
        """The run's half of :func:`~verl_core.dataflow.old_log_probs_reusable`: only the actor update reads
        the old log-probs, which the actor computes (not the engine), and no dropout makes two forwards differ."""
        if not self.dataflow.old_log_probs_only_for_update:
            return False
        model_config = self._model_config()
        if model_config is None:
            return False  # unknown dropout: keep the forward
        settings = {**model_config, **dataclasses.asdict(self.config.backend.config)}
        return not any(isinstance(v, (int, float)) and v > 0 for k, v in settings.items()
                       if k.endswith(("dropout", "pdrop", "dropout_prob", "dropout_rate")))

    def _close_source(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

    def _start_reward_model(self, backend: Any, path: str) -> None:
        """Start the ``reward_model`` worker group on the training backend and hand it to the scorer."""
        from transformers import AutoTokenizer

        cfg = self.config
        spec = ModelSpec(path=path, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
        factory = functools.partial(_create_reward_model_worker, backend, spec, cfg.run.seed)
        group = self.executor.create_group(role=Role.REWARD_MODEL, factory=factory)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
        self.reward.attach_reward_model(group, tokenizer)

    def _load_data(self, format: str = "prompts") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        processor = load_processor(self.model_spec.path, self.tokenizer)
        train, val, self.data_stats = build_datasets(self.config.data, self.tokenizer, self.registry, format=format,
                                                     processor=processor)
        check_rollout_multi_modal(self.registry.load("rollout", self.config.rollout.name), self.config.rollout.name,
                                  [*train, *val])
        return train, val

    def _resume(self, mode: str) -> None:
        self._resumed = None
        if mode == "never":
            return
        if mode == "auto":  # a corrupt latest falls back to the one before it (run.on_corrupt_checkpoint)
            ckpt, _ = self.checkpoints.latest_intact(fallback=self.config.run.on_corrupt_checkpoint == "fallback")
            if ckpt is None:
                return
        else:  # the checkpoint the user named, or none
            ckpt = CheckpointManager.resolve(mode)
            CheckpointManager.verify(ckpt)
        state = json.loads((ckpt / "trainer_state.json").read_text())
        self.actor.load_state(str(ckpt / "actor"))
        if self.critic is not None:
            if not (ckpt / "critic").is_dir():
                raise CheckpointError(f"{ckpt} has no critic state, but algorithm {self.config.algorithm.name!r} "
                                      f"needs a critic; resume with the algorithm it was saved with")
            self.critic.load_state(str(ckpt / "critic"))
        self.sampler.load_state_dict(state["sampler"])
        self._resumed = (ckpt, state)  # the step source restores what it saved (an async buffer, say)
        self.step = int(state["step"])
        self.resumed_from = ckpt
        self._checkpoint = (self.step, ckpt)
        # An engine with its own copy of the weights (vLLM, a server) started from model.path; the
        # first rollout after a resume must already come from the checkpoint's policy.
        sync_rollout_weights(self.rollout, self.actor)

    # ------------------------------------------------------------------ run
    def train(self) -> dict[str, float]:
        """Run until ``run.max_steps`` (or ``run.epochs``); returns the last metrics (validation included).

        A first SIGTERM or Ctrl-C ends the run after the step it is in, with a checkpoint of that step
        (:class:`~verl_core.signals.Preempted`; ``run.save_on_signal``), a second one at once. A worker
        process that dies restarts the worker groups from the last checkpoint, up to ``run.max_restarts``
        times (:meth:`_restart_workers`).
        """
        try:
            with StopSignals(self.config.run.save_on_signal) as stop:
                self.setup()
                if self.run_lock is not None:  # None on a rank that only serves the controller
                    self.run_lock.acquire()  # again, when an earlier train() of this trainer released it
                stop.install()  # again: ray.init, during set-up, installs a SIGTERM handler of its own
                return self._train(stop)
        finally:
            if self.run_lock is not None:
                self.run_lock.release()

    def _train(self, stop: StopSignals) -> dict[str, float]:
        cfg = self.config.run
        hook = self.hooks.hook
        hook.verl_run_start(config=self.config, run_dir=self.run_dir, start_step=self.step, max_steps=self.max_steps)
        hook.verl_metrics(step=self.step, metrics=dict(self.data_stats))  # prompts kept, dropped, truncated
        self._check_health({**self.data_stats, "data/val_prompts": float(len(self.val_rows))})  # 0: no test split
        last: dict[str, float] = {}
        status, error = "completed", None
        try:
            if self.step == 0 and cfg.val_before_train and self.val_rows:
                last.update(self.validate())
            self._validated_at = self.step
            self.source.start()
            while self.step < self.max_steps:
                if stop.requested is not None:
                    raise self._preempted(stop.requested)
                try:
                    last.update(self._advance(stop))
                except WorkerFailedError as exc:
                    self._restart_workers(exc)
                    stop.install()
            if self._validated_at != self.step and self.val_rows:
                last.update(self.validate())
        except (KeyboardInterrupt, Preempted) as exc:
            status, error = "interrupted", exc
            raise
        except BaseException as exc:
            status, error = "failed", exc
            raise
        finally:
            hook.verl_run_end(step=self.step, status=status, error=error)
            self._close_source()
            self.executor.shutdown()
            self.reward.close()
        return last

    def _advance(self, stop: StopSignals) -> dict[str, float]:
        """One step, then the validation and the checkpoint due after it; returns their metrics.

        When a stop was asked for during the step, both are left out (the loop then saves the step
        and stops), except after the final step, which completes the run.
        """
        cfg = self.config.run
        hook = self.hooks.hook
        self.step += 1
        hook.verl_step_start(step=self.step)
        try:
            metrics = self.run_step()
        except FloatingPointError as exc:
            # The backend knows its optimizer step; the user counts RL steps. No checkpoint
            # of this step is written: the loop ends here.
            message = f"at RL step {self.step}: {exc}"
            try:
                again = type(exc)(message)  # same type, so callers catching it still do
            except Exception:  # a subclass with another constructor
                again = FloatingPointError(message)
            raise again from exc
        if self.restarts:
            metrics["run/restarts"] = float(self.restarts)
        hook.verl_step_end(step=self.step, metrics=metrics)
        hook.verl_metrics(step=self.step, metrics=metrics)
        self._check_health(metrics)
        out = dict(metrics)
        final = self.step == self.max_steps
        if stop.requested is not None and not final:
            return out
        if self.val_rows and (final or (cfg.val_every and self.step % cfg.val_every == 0)):
            out.update(self.validate())
            self._validated_at = self.step
        if final or (cfg.save_every and self.step % cfg.save_every == 0):
            try:
                self.save_checkpoint()
            except CheckpointWriteError as exc:
                if final or cfg.on_checkpoint_error == "stop":
                    raise
                self.failed_saves += 1
                logging.getLogger(__name__).warning("%s; going on without it (run.on_checkpoint_error=\"continue\")",
                                                    exc)
                hook.verl_metrics(step=self.step, metrics={"checkpoint/failed_saves": float(self.failed_saves)})
        return out

    def _check_health(self, metrics: dict[str, float]) -> None:
        """Tell the hooks about the health checks that start failing with ``metrics`` (:class:`HealthMonitor`)."""
        for check, message in self.health.observe(self.step, metrics):
            self.hooks.hook.verl_health(step=self.step, check=check, message=message)

    def _preempted(self, signum: int) -> Preempted:
        """Save the step reached (unless its checkpoint exists) and describe the stop."""
        if self.step and (self._checkpoint is None or self._checkpoint[0] != self.step):
            self.save_checkpoint()
        return Preempted(signum, self.step, self._checkpoint[1] if self._checkpoint else None)

    def _restart_workers(self, failure: WorkerFailedError) -> None:
        """Replace every worker group and resume from the run's last checkpoint (or from the start).

        The dead worker's step is abandoned whole, so no step trains on part of a batch; the steps
        since the checkpoint run again as they did (seeded), and the hooks hear
        ``verl_run_rewound`` so that their metrics are reported once.

        Raises:
            WorkerFailedError: ``failure``, with the number of restarts, once ``run.max_restarts`` are used up.
        """
        cfg = self.config
        limit = cfg.run.max_restarts
        if self.restarts >= limit:
            tried = (f" (after {self.restarts} restart(s) of the worker groups; run.max_restarts={limit})" if limit
                     else " (set run.max_restarts to restart the worker groups from the last checkpoint)")
            raise WorkerFailedError(f"{failure}{tried}", role=failure.role, rank=failure.rank,
                                    cause=failure.cause) from failure
        self.restarts += 1
        back = self._checkpoint
        logging.getLogger(__name__).warning(
            "%s; restarting the worker groups (restart %d of %d) and resuming from %s", failure, self.restarts, limit,
            back[1] if back else "the start (no checkpoint yet)")
        self._close_source()
        self.executor.shutdown()
        if back is None:
            self.step = 0
            self.sampler = PromptSampler(len(self.train_rows), cfg.data.batch_size, seed=cfg.run.seed,
                                         shuffle=cfg.data.shuffle)
            random.seed(cfg.run.seed)
            torch.manual_seed(cfg.run.seed)
        self._start_workers(str(back[1]) if back else "never")
        self.source.start()
        self.hooks.hook.verl_run_rewound(step=self.step, reason=str(failure))

    def run_step(self) -> dict[str, float]:
        """One RL step: the source's prompts (or batch), the algorithm's dataflow, the weights handed on."""
        start = time.perf_counter()
        self._drawn: list[int] = []
        sourced = self.source.next(self.step)  # draw_prompts records what it draws
        if sourced.indices is not None:
            self._drawn = list(sourced.indices)
        ctx = self.step_context(self.step, sourced.prompts, produced=sourced.produced, staleness=sourced.staleness)
        ctx.metrics.update(sourced.metrics)
        try:
            self.dataflow.run(ctx, run_parallel=self.executor.run_parallel)
        finally:
            if ctx.engine_released:  # asleep since the rollout stage: awake for the sync, or after a failure
                self.rollout.reacquire_memory()
        # The step's last act, whatever the algorithm: what generates next gets the new policy.
        synced = time.perf_counter()
        self.source.after_update(self.step)
        ctx.metrics["timing/sync_weights"] = time.perf_counter() - synced
        elapsed = time.perf_counter() - start
        b = ctx.batch
        m = dict(ctx.metrics)
        flat = flat_group_fraction(b)
        if flat is not None:
            m["reward/flat_group_frac"] = flat  # groups whose samples all scored the same (health check)
        if self.config.run.train_samples:
            self.hooks.hook.verl_samples(step=self.step, split="train", samples=batch_samples(
                b, self.tokenizer, step=self.step, limit=self.config.run.train_samples))
        m.update(self.algorithm.step_metrics(b, m))  # its KL figures, say
        tokens = int(b.prompt_mask.sum() + b.response_attention_mask.sum())
        n_samples = len(sourced.prompts) * ctx.sampling.n
        m.update({
            "epoch": float(self.sampler.epoch if sourced.epoch is None else sourced.epoch),
            "timing/step": elapsed,
            "throughput/samples_per_sec": n_samples / elapsed,
            "throughput/tokens_per_sec": tokens / elapsed,
        })
        if "memory/actor_peak_gb" not in m:  # backends may report it with the update (one call fewer)
            m["memory/actor_peak_gb"] = float(self.actor.peak_memory_gb())
        return m

    def step_context(self, step: int, prompts: list[dict[str, Any]], **fields: Any) -> StepContext:
        """The context the dataflow of step ``step`` runs with (``fields`` replace the run's own parts:
        a step source's producer passes its engine, and no actor)."""
        rc = self.config.rollout.config
        parts = dict(algorithm=self.algorithm, actor=self.actor, rollout=self.rollout, reward=self.reward,
                     sampling=rc.sampling(seed=self.config.run.seed * 1_000_003 + step), critic=self.critic,
                     reference=self.reference, tokenizer=self.tokenizer, draw_prompts=self.draw_prompts,
                     max_log_prob_gap=self.max_log_prob_gap, log_prob_gap_action=rc.log_prob_gap_action,
                     rollout_name=self.config.rollout.name, make_environment=self.make_environment,
                     environment_config=self.config.environment.config,
                     reuse_update_log_probs=self.reuse_update_log_probs, boundary=self.boundary)
        return StepContext(step=step, prompts=prompts, **{**parts, **fields})

    def draw_prompts(self) -> list[dict[str, Any]]:
        """The next batch of training prompt rows; the sampler's position is part of the checkpoint."""
        indices = self.sampler.next_batch()
        self._drawn.extend(indices)
        return [self.train_rows[i] for i in indices]

    def validate(self) -> dict[str, float]:
        """Generate for every validation prompt with the validation sampling and score it."""
        with self.source.validation():  # an overlapping source lends its engine between two batches
            return self._validate()

    def _validate(self) -> dict[str, float]:
        rc = self.config.rollout.config
        sampling = rc.sampling(seed=self.config.run.seed, validation=True)
        rows = self.val_rows
        chunk = self.config.data.val_batch_size or len(rows)
        texts: list[str] = []
        meta: dict[str, list[Any]] = {"ground_truth": [], "data_source": [], "extra_info": [], "prompt_text": [],
                                      "prompt_messages": []}
        self.hooks.hook.verl_validation_start(step=self.step, samples=len(rows) * sampling.n)
        start = time.perf_counter()
        env_rewards = []
        shown: dict[str, list[Any]] = {"tokens": [], "finish": [], "transcript": []}  # for the samples
        for s in range(0, len(rows), chunk):
            part = rows[s:s + chunk]
            if self.make_environment is not None:  # whole trajectories, tools and all
                batch = run_episodes(self.rollout, part, sampling, self.make_environment,
                                     self.config.environment.config, pad_id=self.tokenizer.pad_token_id,
                                     boundary=self.boundary, step=self.step)
                texts += self.tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in zip(
                    batch.response_ids, batch.response_attention_mask)], skip_special_tokens=True)
                env_rewards.append(batch.extras[ENV_REWARDS].sum(-1))
                shown["tokens"] += batch.response_attention_mask.sum(-1).tolist()
                shown["finish"] += batch.finish_reasons
                shown["transcript"] += batch.meta["transcript"]
            else:
                out = self.boundary.engine_output(self.rollout.generate([r["prompt_ids"] for r in part],
                                                                        sampling=sampling),
                                                  expected=len(part) * sampling.n, step=self.step)
                texts += self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
                shown["tokens"] += [len(ids) for ids in out.response_ids]
                shown["finish"] += out.finish_reasons
            for r in part:
                for _ in range(sampling.n):
                    for k in meta:
                        meta[k].append(r.get(k))
        scores, reward_metrics = self.reward.score_texts(texts, meta)
        scores = check_scores(scores, len(texts), source=self.boundary.scorer, step=self.step)
        parts = [(self.boundary.scorer, scores)]
        if env_rewards:
            parts.append((self.boundary.environment, torch.cat(env_rewards)))
            scores = scores + parts[-1][1]
        # A non-finite reward stops here as in training; skipped rows leave the mean, not the count.
        keep = finite_rows(scores, parts=parts, on_invalid=self.boundary.on_invalid, step=self.step)
        mean = float(scores.mean() if keep is None else scores[keep].mean())
        metrics = {"val/reward_mean": mean, "val/samples": float(len(texts)),
                   "timing/validation": time.perf_counter() - start}
        metrics.update({f"val/{k.split('/', 1)[1]}": v for k, v in reward_metrics.items() if k.endswith("/mean")})
        metrics["val/reward_errors"] = reward_metrics.get("reward/errors", 0.0)
        self._emit_validation_samples(texts, meta, scores, shown)
        self.hooks.hook.verl_validation_end(step=self.step, metrics=metrics)
        self.hooks.hook.verl_metrics(step=self.step, metrics=metrics)
        return metrics

    def _emit_validation_samples(self, texts: list[str], meta: dict[str, list[Any]], scores: torch.Tensor,
                                 shown: dict[str, list[Any]]) -> None:
        """Hand ``run.val_samples`` of the validation's samples (spread over it) to the ``verl_samples`` hook."""
        indices = spread(len(texts), self.config.run.val_samples)
        if not indices:
            return
        if shown["transcript"]:
            meta = {**meta, "transcript": shown["transcript"]}
        per_row, chosen = len(texts) // max(1, len(self.val_rows)), set(indices)
        prompts = [self.tokenizer.decode(self.val_rows[i // per_row]["prompt_ids"], skip_special_tokens=True)
                   if i in chosen else "" for i in range(len(texts))]
        records = sample_records(step=self.step, split="val", prompts=prompts, responses=texts,
                                 rewards=scores.tolist(), meta=meta, response_tokens=shown["tokens"],
                                 finish_reasons=shown["finish"], groups=[i // per_row for i in range(len(texts))],
                                 indices=indices)
        self.hooks.hook.verl_samples(step=self.step, split="val", samples=records)

    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of the current step (atomically) and return its path."""
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "algorithm": self.config.algorithm.name,
                 "backend": self.config.backend.name, "prompts": list(self._drawn)}
        state.update(self.source.checkpoint_state())  # an async buffer's record, the sampler after its batch

        def write(tmp: Path) -> None:
            self.actor.save_state(str(tmp / "actor"))
            if self.critic is not None:
                self.critic.save_state(str(tmp / "critic"))
            self.source.write_checkpoint(tmp)
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
            (tmp / "config.toml").write_text(dump_toml(config_to_dict(self.config)))

        info = {"model": self.model_spec.path}
        if self.critic is not None:
            info["critic"] = self.critic_spec.path
        path = self.checkpoints.save(self.step, write, info=info)
        self._checkpoint = (self.step, path)
        self.hooks.hook.verl_checkpoint_saved(step=self.step, path=path)
        return path
