"""verl's run store on a local (or mounted) filesystem: ``run.store = "local"``, the default.

:class:`LocalRunStore` implements :class:`verl_core.contracts.RunStore` with three parts usable on their own:

* :mod:`verl_run_store.checkpoints`: atomic checkpoint directories with manifests, ``latest`` and retention;
* :mod:`verl_run_store.rundir`: the directory's lock and the check that a resume trains what it holds;
* :mod:`verl_run_store.run_model`: the run's own copy of its models.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

from verl_core.config import load_raw_config
from verl_core.contracts import RunStore
from verl_run_store import run_model, rundir
from verl_run_store.checkpoints import CheckpointManager, pid_alive

__version__ = "0.1.0"
__all__ = ["LocalRunStore", "CheckpointManager", "pid_alive"]


class LocalRunStore(RunStore):
    """A run directory: ``config.toml``, ``run.lock``, ``resumes.jsonl``, ``checkpoints/step_*``, ``model/``."""

    def __init__(self, run_dir: str | os.PathLike, *, keep: int = 0) -> None:
        super().__init__(run_dir, keep=keep)
        self.checkpoints = CheckpointManager(self.run_dir, keep=keep)
        self.lock: rundir.RunLock | None = None  # from claim() on

    @classmethod
    def find(cls, path: str | os.PathLike, *, verify: bool = True) -> tuple["LocalRunStore", Path]:
        ckpt = CheckpointManager.resolve(path)
        if verify:
            CheckpointManager.verify(ckpt)
        return cls(ckpt.parent.parent), ckpt

    def check(self, config: Any, registry: Any) -> None:
        rundir.check_output_dir(self.run_dir)
        problem = rundir.refused_resume(self.run_dir, config, registry)
        if problem is not None:
            raise problem

    def claim(self, config: Any, registry: Any, *, model_path: str, model: Any, tokenizer: Any,
              critic: Any) -> None:
        run_model.check_same_model(self.run_dir, config.run.resume, path=model_path, module=model,
                                   tokenizer=tokenizer)
        self.lock = rundir.open_run_dir(config, registry)
        run_model.write_run_models(self.run_dir, config.model, model=model, tokenizer=tokenizer, critic=critic)

    def hold(self) -> None:
        if self.lock is not None:
            self.lock.acquire()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def save(self, step: int, write: Callable[[Path], None], *, info: Mapping[str, Any]) -> Path:
        return self.checkpoints.save(step, write, info=dict(info))

    def latest(self, *, verify: bool = True, fallback: bool = True) -> Path | None:
        if not verify:
            return self.checkpoints.latest()
        return self.checkpoints.latest_intact(fallback=fallback)[0]

    def recorded_config(self) -> dict[str, Any] | None:
        path = self.run_dir / rundir.CONFIG_FILE
        return load_raw_config(path) if path.is_file() else None

    def model_copies(self, saved_model: Mapping[str, Any]) -> dict[str, str]:
        return {key: str(self.run_dir / run_model.COPY_OF[key])
                for key in sorted(run_model.copied_keys(self.run_dir, dict(saved_model)))}

    def stand_in(self, key: str, value: str, *, note: bool = True) -> str:
        return run_model.stand_in(self.run_dir, key, value, note=note)
