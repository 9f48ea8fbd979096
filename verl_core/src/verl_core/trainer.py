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

from verl_core.assembly import (OBJECT_PREFIX, _create_worker, _without_v1_algorithm_keys, check_model_source,
                                check_sources, check_step_source, critic_spec, load_data, make_boundary,
                                load_tokenizer, object_source, pad_with_eos, resolve_model_path, reusable_old_log_probs,
                                start_reward_model, with_objects)
from verl_core.checkpoint import CheckpointError, CheckpointManager
from verl_core.config import Config, apply_overrides, load_raw_config, resolve_config
from verl_core.contracts import StepSource
from verl_core.dataflow import Dataflow, DataflowBuilder, StepContext
from verl_core.data import PromptSampler
from verl_core.hooks import build_plugin_manager
from verl_core.health import HealthMonitor
from verl_core.progress import Progress
from verl_core.contracts import ModelSpec, RewardScorer, Role, WorkerFailedError
from verl_core.registry import PluginRegistry
from verl_core.rollout_utils import check_weight_sync, guard_limit
from verl_core.rundir import RunLock, open_run_dir
from verl_core.run_model import check_same_model, copied_keys, copy_overrides, stand_in, write_run_models
from verl_core import run_state
from verl_core.samples import batch_samples, flat_group_fraction
from verl_core.signals import Preempted, StopSignals
from verl_core.validation import validate

__all__ = ["Trainer", "resolve_model_path", "check_model_source", "object_source", "OBJECT_PREFIX", "copied_keys"]


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
            config = with_objects(config, self.registry, model=model, tokenizer=tokenizer, critic=critic_model)
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
        check_sources(self, model_path, tok_path)
        padded = pad_with_eos(self.tokenizer, tok_path) if self.tokenizer is not None else None
        if self.tokenizer is None:
            self.tokenizer, padded = load_tokenizer(cfg, tok_path)
        if padded:
            logging.getLogger(__name__).warning("%s", padded)
        if self.registry.load("executor", cfg.executor.name).is_controller(cfg.executor.config):
            # A resume with another model than the directory recorded stops here, from metadata, before weights load.
            check_same_model(self.run_dir, cfg.run.resume, path=model_path, module=self._model_obj,
                             tokenizer=self.tokenizer)
            self.run_lock = open_run_dir(cfg, self.registry)  # one run per directory, a resume only of what it holds
            write_run_models(self.run_dir, cfg.model, model=self._model_obj, tokenizer=self.tokenizer,
                             critic=self._critic_obj)  # once: resume and export need no model directory
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
        self.critic_spec = critic_spec(self, needs.critic)
        with Progress("data preparation", total=2, unit="splits") as bar:  # tokenizing can take a while
            self.train_rows, self.val_rows = load_data(self, needs.data)
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
        check_step_source(self, needs)  # before any model loads
        self.reuse_update_log_probs = reusable_old_log_probs(self)
        self.boundary = make_boundary(self)
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
            run_state.resume(self, resume)
            reward_model = self.reward.reward_model_path()
            if reward_model:
                start_reward_model(self, backend, reward_model)
            self.source = self._source_cls(cfg.trainer.config, trainer=self, resumed=self._resumed)
        except BaseException:
            self.executor.shutdown()  # workers already started must not outlive a failed set-up
            raise

    def _close_source(self) -> None:
        if self.source is not None:
            self.source.close()
            self.source = None

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
            run_state.save_due(self, final=final)
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
            return validate(self)

    def save_checkpoint(self) -> Path:
        """Write a complete checkpoint of the current step (atomically) and return its path."""
        return run_state.save(self)
