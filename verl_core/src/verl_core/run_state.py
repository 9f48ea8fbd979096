"""What a run's checkpoint holds and how a run goes back to it: the policy (and critic) state, the prompt
sampler's position, the step source's own part (an async buffer), the step and the config."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from verl_core.checkpoint import CheckpointError, CheckpointManager, CheckpointWriteError
from verl_core.config import config_to_dict, dump_toml
from verl_core.rollout_utils import sync_rollout_weights

__all__ = ["resume", "save", "save_due"]


def resume(t: Any, mode: str) -> None:
    """Restore the checkpoint ``mode`` names (``run.resume``: ``"auto"`` the latest intact one, ``"never"``,
    or a path) into trainer ``t``'s workers and sampler; its step source restores its own part when built."""
    t._resumed = None
    if mode == "never":
        return
    if mode == "auto":  # a corrupt latest falls back to the one before it (run.on_corrupt_checkpoint)
        ckpt, _ = t.checkpoints.latest_intact(fallback=t.config.run.on_corrupt_checkpoint == "fallback")
        if ckpt is None:
            return
    else:  # the checkpoint the user named, or none
        ckpt = CheckpointManager.resolve(mode)
        CheckpointManager.verify(ckpt)
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
    path = t.checkpoints.save(t.step, write, info=info)
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
