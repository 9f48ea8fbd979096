"""Exporting a checkpoint's policy as a Hugging Face model directory."""

from __future__ import annotations

import os
from pathlib import Path

from verl_core.checkpoint import CheckpointError, CheckpointManager
from verl_core.config import apply_overrides, load_raw_config, resolve_config
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.registry import PluginRegistry
from verl_core.run_model import copy_overrides

__all__ = ["export_checkpoint"]


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, *,
                      registry: PluginRegistry | None = None) -> Path:
    """Write the actor weights of a checkpoint (or a run directory's latest) with ``save_pretrained``.

    The model is built from the run's own copy (:mod:`verl_core.run_model`) where it has one, so the
    original model directory may be gone. Returns the checkpoint directory that was exported.
    """
    from verl_core.trainer import resolve_model_path

    registry = registry or PluginRegistry()
    ckpt = CheckpointManager.resolve(path)
    CheckpointManager.verify(ckpt)
    config_file = ckpt / "config.toml"
    if not config_file.is_file():
        raise CheckpointError(f"{ckpt} has no config.toml; it was not written by verl")
    raw = load_raw_config(config_file)
    copies = copy_overrides(ckpt.parent.parent, raw.get("model", {}))
    cfg = resolve_config(apply_overrides(raw, [*copies, "run.resume=\"never\""]), registry)
    model_path = resolve_model_path(cfg.model.path, registry)
    spec = ModelSpec(path=model_path, tokenizer_path=cfg.model.tokenizer or model_path, dtype=cfg.model.dtype,
                     trust_remote_code=cfg.model.trust_remote_code)
    # One process here, whatever layout wrote the checkpoint: the backend reshards its state on load.
    backend = registry.load("backend", cfg.backend.name)(cfg.backend.config.for_single_process())
    worker = backend.create_worker(role=Role.ACTOR, model=spec, world=WorldInfo(), seed=cfg.run.seed)
    worker.load_saved_weights(str(ckpt / "actor"))  # the optimizer state is not needed to write the weights
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    worker.export_hf(str(out_dir))
    worker.close()
    return ckpt
