"""Exporting a checkpoint's policy as a Hugging Face model directory (``verl export``)."""

from __future__ import annotations

import os
from pathlib import Path

from verl_core.contracts import Role, WorldInfo
from verl_core.registry import PluginRegistry

__all__ = ["export_checkpoint"]


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike, *,
                      registry: PluginRegistry | None = None, store: str = "local") -> Path:
    """Write the actor weights of a checkpoint (or a run directory's latest) with ``save_pretrained``.

    The model is built from the run's own copy (:func:`verl_core.api.saved_run`) where it has one, so the
    original model directory may be gone; ``store`` is the run's ``run.store``. Returns the checkpoint directory
    that was exported.
    """
    from verl_core.api import saved_run

    registry = registry or PluginRegistry()
    saved = saved_run(path, registry, store=store)
    cfg = saved.config
    # One process here, whatever layout wrote the checkpoint: the backend reshards its state on load.
    backend = registry.load("backend", cfg.backend.name)(cfg.backend.config.for_single_process())
    worker = backend.create_worker(role=Role.ACTOR, model=saved.model, world=WorldInfo(), seed=cfg.run.seed)
    worker.load_saved_weights(str(saved.actor))  # the optimizer state is not needed to write the weights
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    worker.export_hf(str(out_dir))
    worker.close()
    return saved.checkpoint
