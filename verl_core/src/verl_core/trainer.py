"""The single controller: one process that owns the run and drives the dataflow.

:class:`Trainer` resolves plugins through the registry, places worker groups with the executor,
and then for each step samples prompts, runs the algorithm's dataflow, emits metrics through the
hooks, validates and checkpoints. ``verl run`` is a thin layer over this class.
"""

from __future__ import annotations

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
from verl_core.dataflow import Dataflow, DataflowBuilder, StepContext
from verl_core.data import HUB_ID, PromptSampler, build_datasets, check_data_source
from verl_core.hooks import build_plugin_manager
from verl_core.interfaces import ModelSpec, RewardScorer, Role, WorkerFailedError
from verl_core.registry import BUILTIN_PREFIX, PluginRegistry, load_builtin
from verl_core.rollout_utils import check_weight_sync, guard_limit, sync_rollout_weights
from verl_core.signals import Preempted, StopSignals

__all__ = ["Trainer", "resolve_model_path", "check_model_source", "object_source", "OBJECT_PREFIX"]


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

    A run given objects records them as ``"<object: ...>"``; resuming it needs them passed again.

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
        self.step = 0
        self._ready = False
        #: Worker-group restarts after a dead worker (``run.max_restarts``) and checkpoints that failed to write.
        self.restarts = 0
        self.failed_saves = 0
        self._checkpoint: tuple[int, Path] | None = None  # (step, path) of the checkpoint a restart goes back to

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
        """Continue the run a checkpoint (or run directory) belongs to, with its saved config."""
        ckpt = CheckpointManager.resolve(path)
        run_dir = ckpt.parent.parent
        config_file = run_dir / "config.toml"
        if not config_file.is_file():
            raise CheckpointError(f"{run_dir} has no config.toml next to its checkpoints")
        overrides = [f"run.resume={json.dumps(str(ckpt))}", f"run.output_dir={json.dumps(str(run_dir))}",
                     *overrides]
        registry = registry or PluginRegistry()
        raw = apply_overrides(_without_v1_algorithm_keys(load_raw_config(config_file), registry), overrides)
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
        threads = cfg.run.threads or max(1, (os.cpu_count() or 1) // 2)
        torch.set_num_threads(threads)
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        model_path = (resolve_model_path(cfg.model.path, self.registry) if self._model_obj is None
                      else (cfg.model.path or ""))
        tok_path = cfg.model.tokenizer or model_path
        self._check_sources(model_path, tok_path)
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self.tokenizer = AutoTokenizer.from_pretrained(tok_path,
                                                               trust_remote_code=cfg.model.trust_remote_code)
            except (OSError, ValueError) as exc:
                raise ConfigError("model.tokenizer" if cfg.model.tokenizer else "model.path",
                                  f"cannot load a tokenizer from {tok_path!r}: {exc}") from exc
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(dump_toml(config_to_dict(cfg)))
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
        self.model_spec = ModelSpec(path=model_path, tokenizer_path=tok_path, dtype=cfg.model.dtype,
                                    trust_remote_code=cfg.model.trust_remote_code, module=self._model_obj)

        self.algorithm = self.registry.load("algorithm", cfg.algorithm.name)(cfg.algorithm.config)
        needs = self.algorithm.requirements()
        env = cfg.environment
        # One environment per trajectory (a partial, so it pickles like the worker factories).
        self.make_environment = (functools.partial(self.registry.load("environment", env.name), env.config)
                                 if env.name else None)
        self.critic_spec = self._critic_spec(needs.critic)
        self.train_rows, self.val_rows = self._load_data(needs.data)
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
        self.hooks = build_plugin_manager(self.registry, loggers=cfg.run.loggers, disable_hooks=cfg.run.disable_hooks)
        self.checkpoints = CheckpointManager(self.run_dir, keep=cfg.run.keep_checkpoints)
        self._start_workers(cfg.run.resume)
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
            path = resolve_model_path(path, self.registry)
            check_model_source(path, "model.critic_path", argument="critic_model")
        return dataclasses.replace(self.model_spec, path=path, module=self._critic_obj)

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
        train, val, self.data_stats = build_datasets(self.config.data, self.tokenizer, self.registry, format=format)
        return train, val

    def _resume(self, mode: str) -> None:
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
        with StopSignals(self.config.run.save_on_signal) as stop:
            self.setup()
            stop.install()  # again: ray.init, during set-up, installs a SIGTERM handler of its own
            return self._train(stop)

    def _train(self, stop: StopSignals) -> dict[str, float]:
        cfg = self.config.run
        hook = self.hooks.hook
        hook.verl_run_start(config=self.config, run_dir=self.run_dir, start_step=self.step, max_steps=self.max_steps)
        hook.verl_metrics(step=self.step, metrics=dict(self.data_stats))  # prompts kept, dropped, truncated
        last: dict[str, float] = {}
        status, error = "completed", None
        try:
            if self.step == 0 and cfg.val_before_train and self.val_rows:
                last.update(self.validate())
            self._validated_at = self.step
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
        self.executor.shutdown()
        if back is None:
            self.step = 0
            self.sampler = PromptSampler(len(self.train_rows), cfg.data.batch_size, seed=cfg.run.seed,
                                         shuffle=cfg.data.shuffle)
            random.seed(cfg.run.seed)
            torch.manual_seed(cfg.run.seed)
        self._start_workers(str(back[1]) if back else "never")
        self.hooks.hook.verl_run_rewound(step=self.step, reason=str(failure))

    def run_step(self) -> dict[str, float]:
        """One RL step: sample prompts, run the dataflow, and return its metrics."""
        start = time.perf_counter()
        prompts = self._draw_prompts()
        rc = self.config.rollout.config
        sampling = rc.sampling(seed=self.config.run.seed * 1_000_003 + self.step)
        ctx = StepContext(step=self.step, prompts=prompts, algorithm=self.algorithm, actor=self.actor,
                          rollout=self.rollout, reward=self.reward, sampling=sampling, critic=self.critic,
                          reference=self.reference, tokenizer=self.tokenizer, draw_prompts=self._draw_prompts,
                          max_log_prob_gap=self.max_log_prob_gap, log_prob_gap_action=rc.log_prob_gap_action,
                          rollout_name=self.config.rollout.name, make_environment=self.make_environment,
                          environment_config=self.config.environment.config)
        try:
            self.dataflow.run(ctx, run_parallel=self.executor.run_parallel)
        finally:
            if ctx.engine_released:  # asleep since the rollout stage: awake for the sync, or after a failure
                self.rollout.reacquire_memory()
        # The step's last act, whatever the algorithm: the engine samples the next step from the new policy.
        synced = time.perf_counter()
        sync_rollout_weights(self.rollout, self.actor)
        ctx.metrics["timing/sync_weights"] = time.perf_counter() - synced
        elapsed = time.perf_counter() - start
        b = ctx.batch
        m = dict(ctx.metrics)
        m.setdefault("ppo/kl_divergence", m.get("ppo/approx_kl", 0.0))
        if b.ref_log_probs is not None and b.old_log_probs is not None:
            from verl_core.algorithms.functional import kl_penalty, masked_mean

            m["actor/ref_kl"] = float(masked_mean(kl_penalty(b.old_log_probs, b.ref_log_probs, "k3"),
                                                  b.response_mask))
        tokens = int(b.prompt_mask.sum() + b.response_attention_mask.sum())
        n_samples = len(prompts) * sampling.n
        m.update({
            "epoch": float(self.sampler.epoch),
            "timing/step": elapsed,
            "throughput/samples_per_sec": n_samples / elapsed,
            "throughput/tokens_per_sec": tokens / elapsed,
        })
        if "memory/actor_peak_gb" not in m:  # backends may report it with the update (one call fewer)
            m["memory/actor_peak_gb"] = float(self.actor.peak_memory_gb())
        return m

    def _draw_prompts(self) -> list[dict[str, Any]]:
        """The next batch of training prompt rows; the sampler's position is part of the checkpoint."""
        return [self.train_rows[i] for i in self.sampler.next_batch()]

    def validate(self) -> dict[str, float]:
        """Generate for every validation prompt with the validation sampling and score it."""
        rc = self.config.rollout.config
        sampling = rc.sampling(seed=self.config.run.seed, validation=True)
        rows = self.val_rows
        chunk = self.config.data.val_batch_size or len(rows)
        texts: list[str] = []
        meta: dict[str, list[Any]] = {"ground_truth": [], "data_source": [], "extra_info": [], "prompt_text": [],
                                      "prompt_messages": []}
        start = time.perf_counter()
        env_rewards = []
        for s in range(0, len(rows), chunk):
            part = rows[s:s + chunk]
            if self.make_environment is not None:  # whole trajectories, tools and all
                batch = run_episodes(self.rollout, part, sampling, self.make_environment,
                                     self.config.environment.config, pad_id=self.tokenizer.pad_token_id)
                texts += self.tokenizer.batch_decode([ids[m.bool()].tolist() for ids, m in zip(
                    batch.response_ids, batch.response_attention_mask)], skip_special_tokens=True)
                env_rewards.append(batch.extras[ENV_REWARDS].sum(-1))
            else:
                out = self.rollout.generate([r["prompt_ids"] for r in part], sampling=sampling)
                texts += self.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
            for r in part:
                for _ in range(sampling.n):
                    for k in meta:
                        meta[k].append(r.get(k))
        scores, reward_metrics = self.reward.score_texts(texts, meta)
        if env_rewards:
            scores = scores + torch.cat(env_rewards)
        metrics = {"val/reward_mean": float(scores.mean()), "val/samples": float(len(texts)),
                   "timing/validation": time.perf_counter() - start}
        metrics.update({f"val/{k.split('/', 1)[1]}": v for k, v in reward_metrics.items() if k.endswith("/mean")})
        metrics["val/reward_errors"] = reward_metrics.get("reward/errors", 0.0)
        self.hooks.hook.verl_validation_end(step=self.step, metrics=metrics)
        self.hooks.hook.verl_metrics(step=self.step, metrics=metrics)
        return metrics

    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of the current step (atomically) and return its path."""
        state = {"step": self.step, "sampler": self.sampler.state_dict(), "algorithm": self.config.algorithm.name,
                 "backend": self.config.backend.name}

        def write(tmp: Path) -> None:
            self.actor.save_state(str(tmp / "actor"))
            if self.critic is not None:
                self.critic.save_state(str(tmp / "critic"))
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
            (tmp / "config.toml").write_text(dump_toml(config_to_dict(self.config)))

        info = {"model": self.model_spec.path}
        if self.critic is not None:
            info["critic"] = self.critic_spec.path
        path = self.checkpoints.save(self.step, write, info=info)
        self._checkpoint = (self.step, path)
        self.hooks.hook.verl_checkpoint_saved(step=self.step, path=path)
        return path
