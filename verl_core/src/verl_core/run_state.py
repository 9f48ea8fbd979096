"""What a run's checkpoint holds and how a run goes back to it: the policy (and critic) state, the prompt
sampler's position, the step source's own part (an async buffer), the step and the config."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from verl_core.config import (CORE_SECTIONS, Config, apply_overrides, config_to_dict, dump_toml, plugin_for_key,
                              resolve_config)
from verl_core.contracts import CheckpointError, CheckpointWriteError, ConfigError, WorkerFailedError
from verl_core.sampler import PromptSampler
from verl_core.rollout_utils import sync_rollout_weights

__all__ = ["saved_config", "copy_overrides", "resume", "save", "save_due", "restart", "at_step"]


def saved_config(path: str | Path, overrides: Sequence[str], registry: Any, *, given: set[str],
                 store: str = "local") -> Config:
    """The config of the run a checkpoint (or run directory) belongs to, set to resume from it: the config the
    run recorded, the run's own model copies for the ``model.*`` keys not ``given`` as objects, ``overrides``.
    ``store``: the ``run.store`` plugin that keeps the run (the one it recorded; another is refused)."""
    run, ckpt = plugin_for_key(registry, "run_store", store, "run.store").find(path, verify=False)
    recorded = run.recorded_config()
    if recorded is None:
        raise CheckpointError(f"{run.run_dir} has no config.toml next to its checkpoints")
    saved, section = recorded, recorded.get("algorithm")
    name = section.get("name", CORE_SECTIONS["algorithm"].default) if isinstance(section, dict) else None
    if isinstance(name, str):  # as this release of the algorithm takes it (a bad name: the config check's)
        algorithm = plugin_for_key(registry, "algorithm", name, "algorithm.name")
        saved = {**saved, "algorithm": algorithm.saved_settings(section)}
    overrides = [*copy_overrides(run, saved.get("model", {}), given=given), f"run.resume={json.dumps(str(ckpt))}",
                 f"run.output_dir={json.dumps(str(run.run_dir))}", f"run.store={json.dumps(store)}", *overrides]
    config = resolve_config(apply_overrides(saved, overrides), registry)
    kept_by = saved.get("run", {}).get("store", store)  # a run keeps its store; pass the one it names
    if kept_by != store or config.run.store != store:
        raise ConfigError("run.store", f"{run.run_dir} is kept by run store {kept_by!r}, and a run cannot change its "
                                       f"store: pass store={kept_by!r} to from_checkpoint, no run.store override")
    return config


def copy_overrides(run: Any, saved_model: Any, *, given: set[str] = frozenset()) -> list[str]:
    """``model.<key>=<copy>`` for each entry of a saved ``[model]`` section that store ``run``'s own copy stands
    for (:meth:`~verl_core.contracts.RunStore.model_copies`), but the keys in ``given``."""
    return [f"model.{k}={json.dumps(v)}" for k, v in run.model_copies(saved_model).items() if k not in given]


def resume(t: Any, mode: str) -> None:
    """Restore the checkpoint ``mode`` names (``run.resume``: ``"auto"`` the latest intact one, ``"never"``,
    or a path) into trainer ``t``'s workers and sampler; its step source restores its own part when built."""
    t._resumed = None
    if mode == "never":
        return
    if mode == "auto":  # a corrupt latest falls back to the one before it (run.on_corrupt_checkpoint)
        ckpt = t.store.latest(fallback=t.config.run.on_corrupt_checkpoint == "fallback")
        if ckpt is None:
            return
    else:  # the checkpoint the user named (verified), or none
        _, ckpt = t.store.find(mode)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    t.actor.load_state(str(ckpt / "actor"))
    if t.critic is not None:
        if not (ckpt / "critic").is_dir():
            raise CheckpointError(f"{ckpt} has no critic state, but algorithm {t.config.algorithm.name!r} "
                                  f"needs a critic; resume with the algorithm it was saved with")
        t.critic.load_state(str(ckpt / "critic"))
    t.sampler.load_state_dict(state["sampler"])
    t._resumed = (ckpt, state)  # the step source restores what it saved (an async buffer, say)
    t.step = int(state["step"])
    t.resumed_from = ckpt
    t._checkpoint = (t.step, ckpt)
    # An engine with its own copy of the weights (vLLM, a server) started from model.path; the
    # first rollout after a resume must already come from the checkpoint's policy.
    sync_rollout_weights(t.rollout, t.actor)


def save(t: Any) -> Path:
    """Write a complete checkpoint of trainer ``t``'s current step (atomically) and return its path."""
    state = {"step": t.step, "sampler": t.sampler.state_dict(), "algorithm": t.config.algorithm.name,
             "backend": t.config.backend.name, "prompts": list(t._drawn)}
    state.update(t.source.checkpoint_state())  # an async buffer's record, the sampler after its batch

    def write(tmp: Path) -> None:
        t.actor.save_state(str(tmp / "actor"))
        if t.critic is not None:
            t.critic.save_state(str(tmp / "critic"))
        t.source.write_checkpoint(tmp)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (tmp / "config.toml").write_text(dump_toml(config_to_dict(t.config)))

    info = {"model": t.model_spec.path}
    if t.critic is not None:
        info["critic"] = t.critic_spec.path
    path = t.store.save(t.step, write, info=info)
    t._checkpoint = (t.step, path)
    t.hooks.hook.verl_checkpoint_saved(step=t.step, path=path)
    return path


def save_due(t: Any, *, final: bool) -> None:
    """The checkpoint due after a step; one that fails to write stops the run, or with
    ``run.on_checkpoint_error = "continue"`` (not after the final step) is counted and skipped."""
    try:
        save(t)
    except CheckpointWriteError as exc:
        if final or t.config.run.on_checkpoint_error == "stop":
            raise
        t.failed_saves += 1
        logging.getLogger(__name__).warning("%s; going on without it (run.on_checkpoint_error=\"continue\")", exc)
        t.hooks.hook.verl_metrics(step=t.step, metrics={"checkpoint/failed_saves": float(t.failed_saves)})


def restart(t: Any, failure: WorkerFailedError) -> None:
    """Replace every worker group of trainer ``t`` and resume from the run's last checkpoint (or from the start).

    The dead worker's step is abandoned whole, so no step trains on part of a batch; the steps
    since the checkpoint run again as they did (seeded), and the hooks hear
    ``verl_run_rewound`` so that their metrics are reported once.

    Raises:
        WorkerFailedError: ``failure``, with the number of restarts, once ``run.max_restarts`` are used up.
    """
    cfg = t.config
    limit = cfg.run.max_restarts
    if t.restarts >= limit:
        tried = (f" (after {t.restarts} restart(s) of the worker groups; run.max_restarts={limit})" if limit
                 else " (set run.max_restarts to restart the worker groups from the last checkpoint)")
        raise WorkerFailedError(f"{failure}{tried}", role=failure.role, rank=failure.rank,
                                cause=failure.cause) from failure
    t.restarts += 1
    back = t._checkpoint
    logging.getLogger(__name__).warning(
        "%s; restarting the worker groups (restart %d of %d) and resuming from %s", failure, t.restarts, limit,
        back[1] if back else "the start (no checkpoint yet)")
    t._close_source()
    t.executor.shutdown()
    if back is None:
        t.step = 0
        t.sampler = PromptSampler(len(t.train_rows), cfg.data.batch_size, seed=cfg.run.seed,
                                     shuffle=cfg.data.shuffle)
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
    t._start_workers(str(back[1]) if back else "never")
    t.source.start()
    t.hooks.hook.verl_run_rewound(step=t.step, reason=str(failure))


def at_step(exc: FloatingPointError, step: int) -> FloatingPointError:
    """``exc`` (a non-finite loss, say) again, naming RL step ``step``: the backend knows its optimizer step,
    the user counts RL steps. Same type where it can be, so callers catching it still do."""
    message = f"at RL step {step}: {exc}"
    try:
        return type(exc)(message)
    except Exception:  # a subclass with another constructor
        return FloatingPointError(message)
