"""The single controller: one process that owns the run and drives the dataflow.

:class:`Trainer` resolves plugins through the registry, places worker groups with the executor,
and then for each step samples prompts, runs the algorithm's dataflow, emits metrics through the
hooks, validates and checkpoints. ``verl run`` is a thin layer over this class.
"""

from __future__ import annotations

import functools
import os
import random
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from verl_core import run_state
from verl_core.assembly import (OBJECT_PREFIX, _create_worker, check_model_source, check_step_source, critic_spec,
                                load_prompts, make_backend, make_boundary, object_source, open_model,
                                resolve_model_path, reusable_old_log_probs, run_store, start_reward_model,
                                with_objects)
from verl_core.config import Config, apply_overrides, load_raw_config, resolve_config
from verl_core.contracts import ModelSpec, Role, StepSource, WorkerFailedError
from verl_core.dataflow import Dataflow, DataflowBuilder, StepContext
from verl_core.hooks import build_plugin_manager
from verl_core.registry import PluginRegistry
from verl_core.rollout_utils import check_weight_sync, run_guard_limit
from verl_core.run_state import at_step
from verl_core.signals import Preempted, StopSignals
from verl_core.validation import validate

__all__ = ["Trainer", "resolve_model_path", "check_model_source", "object_source", "OBJECT_PREFIX"]


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
    (:meth:`RunStore.claim <verl_core.contracts.RunStore.claim>`), which :meth:`from_checkpoint` loads them from.

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
        #: The run directory (``run.store``): claimed by setup() on the controller, held to the end of train().
        self.store = run_store(self.registry, config)
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
                        registry: PluginRegistry | None = None, store: str = "local", **kwargs: Any) -> "Trainer":
        """Continue the run a checkpoint (or run directory) belongs to, with its saved config.

        The models and tokenizer come from the run's own copies (:meth:`~verl_core.contracts.RunStore.model_copies`)
        where it has them, so the original model directory (or object) is not needed; ``model=``, ``tokenizer=`` and
        ``critic_model=`` objects, and ``model.*`` overrides, take their place. ``store``: the run's ``run.store``.
        """
        registry = registry or PluginRegistry()
        given = {key for key, argument in (("path", "model"), ("tokenizer", "tokenizer"),
                                           ("critic_path", "critic_model")) if kwargs.get(argument) is not None}
        return cls(run_state.saved_config(path, overrides, registry, given=given, store=store), registry=registry,
                   **kwargs)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Load data, models and engines; restore a checkpoint when resuming."""
        if self._ready:
            return
        cfg = self.config
        self._source_cls: type[StepSource] = self.registry.load("step_source", cfg.trainer.name)
        self.run_threads = cfg.run.threads or max(1, (os.cpu_count() or 1) // 2)  # 0: half the cores
        torch.set_num_threads(self._source_cls.torch_threads(cfg.trainer.config, self.run_threads))
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        model_path, tok_path = open_model(self)  # the tokenizer, and the run directory (locked) on the controller
        self.max_log_prob_gap = run_guard_limit(cfg)
        self.model_spec = ModelSpec(path=model_path, tokenizer_path=tok_path, dtype=cfg.model.dtype,
                                    trust_remote_code=cfg.model.trust_remote_code, module=self._model_obj)

        self.algorithm = self.registry.load("algorithm", cfg.algorithm.name)(cfg.algorithm.config)
        needs = self.algorithm.requirements()
        env = cfg.environment
        # One environment per trajectory (a partial, so it pickles like the worker factories).
        self.make_environment = (functools.partial(self.registry.load("environment", env.name), env.config)
                                 if env.name else None)
        self.critic_spec = critic_spec(self, needs.critic)
        load_prompts(self, needs)  # train/val rows, the sampler, max_steps and the scorer of every data_source
        self._backend = make_backend(self)
        builder = DataflowBuilder()
        self.algorithm.build_dataflow(builder)
        self.dataflow: Dataflow = builder.build()
        check_step_source(self, needs)  # before any model loads
        self.reuse_update_log_probs = reusable_old_log_probs(self)
        self.boundary = make_boundary(self)
        self.hooks = build_plugin_manager(self.registry, loggers=cfg.run.loggers, disable_hooks=cfg.run.disable_hooks)
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
        times (:func:`~verl_core.run_state.restart`).
        """
        try:
            with StopSignals(self.config.run.save_on_signal) as stop:
                self.setup()
                self.store.hold()  # again, when an earlier train() of this trainer released it
                stop.install()  # again: ray.init, during set-up, installs a SIGTERM handler of its own
                return self._train(stop)
        finally:
            self.store.release()

    def _train(self, stop: StopSignals) -> dict[str, float]:
        cfg = self.config.run
        hook = self.hooks.hook
        hook.verl_run_start(config=self.config, run_dir=self.run_dir, start_step=self.step, max_steps=self.max_steps,
                            hooks=hook)
        # Prompts kept, dropped, truncated; data/val_prompts = 0: no test split (a health check warns).
        hook.verl_metrics(step=self.step, metrics={**self.data_stats, "data/val_prompts": float(len(self.val_rows))})
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
                    run_state.restart(self, exc)  # new worker groups, back to the last checkpoint
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
        except FloatingPointError as exc:  # no checkpoint of this step is written: the loop ends here
            raise at_step(exc, self.step) from exc
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
            run_state.save_due(self, final=final)
        return out

    def _preempted(self, signum: int) -> Preempted:
        """Save the step reached (unless its checkpoint exists) and describe the stop."""
        if self.step and (self._checkpoint is None or self._checkpoint[0] != self.step):
            self.save_checkpoint()
        return Preempted(signum, self.step, self._checkpoint[1] if self._checkpoint else None)

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
        return _step_report(self, ctx, epoch=self.sampler.epoch if sourced.epoch is None else sourced.epoch,
                            seconds=time.perf_counter() - start)

    def step_context(self, step: int, prompts: list[dict[str, Any]], **fields: Any) -> StepContext:
        """The context the dataflow of step ``step`` runs with (``fields`` replace the run's own parts:
        a step source generating on an engine of its own passes that engine, and no actor)."""
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


def _step_report(t: Trainer, ctx: StepContext, *, epoch: float, seconds: float) -> dict[str, float]:
    """The metrics of the step trainer ``t`` just ran in ``ctx``: the dataflow's, those hook plugins measure on
    its batch (``verl_step_batch``), the algorithm's own, throughput and memory."""
    b, m = ctx.batch, dict(ctx.metrics)
    for measured in t.hooks.hook.verl_step_batch(step=ctx.step, batch=b, tokenizer=t.tokenizer):
        m.update(measured or {})
    m.update(t.algorithm.step_metrics(b, m))  # its KL figures, say
    tokens = int(b.prompt_mask.sum() + b.response_attention_mask.sum())
    m.update({"epoch": float(epoch), "timing/step": seconds,
              "throughput/samples_per_sec": len(ctx.prompts) * ctx.sampling.n / seconds,
              "throughput/tokens_per_sec": tokens / seconds})
    if "memory/actor_peak_gb" not in m:  # backends may report it with the update (one call fewer)
        m["memory/actor_peak_gb"] = float(t.actor.peak_memory_gb())
    return m
