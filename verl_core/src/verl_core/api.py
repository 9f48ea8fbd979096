"""The run API: what a front end (the ``verl`` command of verl-cli, a notebook, a job scheduler) calls.

``Trainer(config).train()`` (:mod:`verl_core`) runs; :func:`check` does everything a run checks before
step 1 without the run (``verl run --dry-run``) and returns what it found (:class:`Plan`);
:func:`saved_run` opens a checkpoint with the settings it was saved with (``verl export``). The errors
a started run stops with, beyond the user errors of ``config``/``registry``/``contracts``:
:data:`RUN_FAILURES`, :class:`CheckpointWriteError` and :class:`Preempted` (exit :data:`PREEMPTED_EXIT`).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_core.boundary import PluginOutputError
from verl_core.config import Config, apply_overrides, load_raw_config, plugin_for_key, resolve_config
from verl_core.contracts import CheckpointError, CheckpointWriteError, ModelSpec, ServerError, WorkerFailedError
from verl_core.registry import PluginRegistry
from verl_core.rollout_utils import WeightSyncError
from verl_core.signals import PREEMPTED_EXIT, Preempted

__all__ = ["Plan", "check", "SavedRun", "saved_run", "RUN_FAILURES", "CheckpointWriteError", "Preempted",
           "PREEMPTED_EXIT"]

#: What stops a started run with a message and no traceback: a dead worker past ``run.max_restarts``, weights
#: the rollout did not take, a server that stopped answering, a plugin's output the core refused.
RUN_FAILURES = (WorkerFailedError, WeightSyncError, ServerError, PluginOutputError)


@dataclass
class Plan:
    """What :func:`check` found: the run as it would start. ``warnings`` would not stop it."""

    model_path: str  # the directory the model loads from (a ``builtin:`` model's, built)
    model_config: dict[str, Any]  # its config.json ({} if it has none)
    train_rows: list[dict[str, Any]]
    val_rows: list[dict[str, Any]]
    max_steps: int
    needs: Any  # the algorithm's Requirements
    dataflow: Any  # the algorithm's Dataflow (``describe()``)
    reused: bool  # old_log_probs come from the update's own forward
    world_size: int
    warnings: list[str] = field(default_factory=list)


def check(cfg: Config, registry: Any) -> Plan:
    """Check ``cfg`` as :meth:`Trainer.setup <verl_core.trainer.Trainer.setup>` does up to the first worker.

    It walks the set-up in its order, through the trainer's own checks, so a config it passes starts and one it
    refuses fails with the same error (:class:`~verl_core.config.ConfigError`, ``DataError``, ``PluginError``,
    ...). It loads no weights, starts no executor or engine and writes nothing; a ``builtin:`` model is built
    on first use, as the run builds it.
    """
    from verl_core.assembly import (check_sources, check_step_source, critic_spec, load_prompts, load_tokenizer,
                                    make_backend, make_boundary, model_config, resolve_model_path,
                                    reusable_old_log_probs)
    from verl_core.dataflow import DataflowBuilder
    from verl_core.hooks import build_plugin_manager
    from verl_core.trainer import Trainer

    warnings: list[str] = []
    trainer = Trainer(cfg, registry=registry)
    store = trainer.store
    model_path = resolve_model_path(cfg.model.path, registry)
    tok_path = cfg.model.tokenizer or model_path
    check_sources(trainer, model_path, tok_path)
    tokenizer, padded = load_tokenizer(cfg, tok_path)
    store.check(cfg, registry)  # the run directory's checks of RunStore.claim, writing nothing
    warnings += [padded] if padded else []
    trainer.tokenizer = tokenizer
    trainer.model_spec = ModelSpec(path=model_path, tokenizer_path=tok_path, dtype=cfg.model.dtype,
                                   trust_remote_code=cfg.model.trust_remote_code)
    algorithm = trainer.algorithm = registry.load("algorithm", cfg.algorithm.name)(cfg.algorithm.config)
    needs = algorithm.requirements()
    if cfg.environment.name:
        registry.load("environment", cfg.environment.name)
    trainer.critic_spec = critic_spec(trainer, needs.critic)
    data_logger = logging.getLogger("verl.data")  # its warnings go to the plan, not between a report's lines
    captured = logging.handlers.BufferingHandler(capacity=sys.maxsize)
    captured.setLevel(logging.WARNING)
    data_logger.addHandler(captured)
    try:
        load_prompts(trainer, needs)  # the rows, the sampler, the number of steps and the scorer, as the run
    finally:
        data_logger.removeHandler(captured)
    warnings += [record.getMessage() for record in captured.buffer]
    try:
        backend = make_backend(trainer)
    finally:
        trainer.reward.close()
    builder = DataflowBuilder()
    algorithm.build_dataflow(builder)
    trainer.dataflow = builder.build()
    check_step_source(trainer, needs)
    reused = reusable_old_log_probs(trainer)
    make_boundary(trainer)
    build_plugin_manager(registry, loggers=cfg.run.loggers, disable_hooks=cfg.run.disable_hooks)
    world_size = int(getattr(cfg.executor.config, "world_size", 1) or 1)
    backend.check(model=trainer.model_spec, world_size=world_size)
    registry.load("executor", cfg.executor.name)
    registry.load("rollout", cfg.rollout.name)
    if cfg.run.resume not in ("auto", "never", "force"):
        store.find(cfg.run.resume)  # verified
    return Plan(model_path=model_path, model_config=model_config(trainer) or {}, train_rows=trainer.train_rows,
                val_rows=trainer.val_rows, max_steps=trainer.max_steps, needs=needs, dataflow=trainer.dataflow,
                reused=reused, world_size=world_size, warnings=warnings)


@dataclass
class SavedRun:
    """A checkpoint opened by :func:`saved_run`: its saved run, model and backend settings and the model it trains."""

    checkpoint: Path
    config: Config
    model: ModelSpec

    @property
    def actor(self) -> Path:
        """The actor's saved state (weights, optimizer), for ``TrainingWorker.load_saved_weights``."""
        return self.checkpoint / "actor"


def saved_run(path: str | os.PathLike, registry: PluginRegistry | None = None, *, store: str = "local") -> SavedRun:
    """Open a checkpoint (or a run directory's latest), verified, with the settings it was saved with.

    The model comes from the run's own copy (:meth:`~verl_core.contracts.RunStore.model_copies`) where it has
    one, so the original model directory may be gone. ``store``: the ``run.store`` plugin that wrote it.
    """
    from verl_core.assembly import resolve_model_path
    from verl_core.run_state import copy_overrides

    registry = registry or PluginRegistry()
    run, ckpt = plugin_for_key(registry, "run_store", store, "run.store").find(path)
    config_file = ckpt / "config.toml"
    if not config_file.is_file():
        raise CheckpointError(f"{ckpt} has no config.toml; it was not written by verl")
    # Only the sections that build the actor: a setting elsewhere that a later release refuses (greedy validation
    # with rollout.val_n > 1, once accepted and unused) must not lock a run's weights in.
    raw = {k: v for k, v in load_raw_config(config_file).items() if k in ("run", "model", "backend")}
    copies = copy_overrides(run, raw.get("model", {}))
    cfg = resolve_config(apply_overrides(raw, [*copies, "run.resume=\"never\""]), registry)
    if cfg.run.store != store:
        raise CheckpointError(f"{ckpt} was written by run store {cfg.run.store!r}; open it with that one, not {store!r}")
    model_path = resolve_model_path(cfg.model.path, registry)
    return SavedRun(ckpt, cfg, ModelSpec(path=model_path, tokenizer_path=cfg.model.tokenizer or model_path,
                                         dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code))
