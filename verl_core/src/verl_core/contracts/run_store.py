"""Run stores: where a run keeps what outlives its processes (``run.store``; verl-run-store's ``local``)."""

from __future__ import annotations

import abc
import os
from pathlib import Path
from typing import Any, Callable, Mapping

__all__ = ["RunStore", "CheckpointError", "CheckpointWriteError"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt or from another setup."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error); nothing of it is left, the latest is unchanged.

    Attributes:
        path: the checkpoint directory that was being written.
        cause: the underlying error, as text.
    """

    def __init__(self, message: str, *, path: Path, cause: str) -> None:
        super().__init__(message)
        self.path = path
        self.cause = cause


class RunStore(abc.ABC):
    """One run's directory (``run.output_dir``): who holds it, what it trains, its checkpoints, its model copies.

    Registered under ``verl.run_stores`` and built with the run directory and ``keep`` (``run.keep_checkpoints``).
    The core decides *what* a checkpoint holds (it fills the directory :meth:`save` hands it: the workers'
    states, ``trainer_state.json``, ``config.toml``) and *when* one is written or resumed; the store decides
    *where* and guarantees the rest, which its conformance suite checks (:class:`verl_core.testing.RunStoreConformance`):

    * a checkpoint is published whole or not at all, and one that does not verify is never resumed;
    * one run at a time holds the directory (:meth:`claim` to :meth:`release`), and a resume trains only
      what the directory holds (a refused one is a :class:`~verl_core.contracts.ConfigError` naming the
      settings, raised before any model loads, with nothing in the directory changed);
    * the run keeps its own copy of its models, so a resume and an export need no model directory.

    Checkpoints are local paths (backends write and read files there): a store on remote storage stages them
    in a local directory and uploads in :meth:`save`, downloads in :meth:`find` / :meth:`latest`.
    """

    def __init__(self, run_dir: str | os.PathLike, *, keep: int = 0) -> None:
        self.run_dir = Path(run_dir)
        self.keep = keep

    @classmethod
    @abc.abstractmethod
    def find(cls, path: str | os.PathLike, *, verify: bool = True) -> tuple["RunStore", Path]:
        """The checkpoint ``path`` names (a checkpoint, or a run directory: its latest) with a store of its run.

        Raises:
            CheckpointError: ``path`` holds no complete checkpoint; with ``verify``, a corrupt one (naming
                the file).
        """

    @abc.abstractmethod
    def check(self, config: Any, registry: Any) -> None:
        """Raise a ``ConfigError`` where :meth:`claim` would refuse ``config``, writing nothing (the dry run)."""

    @abc.abstractmethod
    def claim(self, config: Any, registry: Any, *, model_path: str, model: Any, tokenizer: Any,
              critic: Any) -> None:
        """Hold the directory for this run, refuse a resume that would train something else (the model
        ``model_path`` / ``model`` included, from metadata), record ``config``, and keep the run's copies of
        its models (``model``, ``critic``: objects it was given, else None). On the controller, before any
        weights load; nothing is changed when it raises."""

    @abc.abstractmethod
    def hold(self) -> None:
        """Hold the directory again after :meth:`release` (nothing before :meth:`claim`, or when held)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Let another run have the directory (nothing when not held)."""

    @abc.abstractmethod
    def save(self, step: int, write: Callable[[Path], None], *, info: Mapping[str, Any]) -> Path:
        """Call ``write(directory)`` to fill step ``step``'s checkpoint, publish it whole, drop the oldest
        beyond ``keep``; returns its path. ``info``: what it trains, for people reading the directory.

        Raises:
            CheckpointWriteError: ``write`` or the store failed (a full disk); nothing of it is left.
        """

    @abc.abstractmethod
    def latest(self, *, verify: bool = True, fallback: bool = True) -> Path | None:
        """The newest complete checkpoint (None: there is none). With ``verify``, the newest that verifies: a
        corrupt one is set aside and, with ``fallback``, the one before it taken; else its error raised."""

    @abc.abstractmethod
    def recorded_config(self) -> dict[str, Any] | None:
        """The raw config the run recorded when it started (None: it has none)."""

    @abc.abstractmethod
    def model_copies(self, saved_model: Mapping[str, Any]) -> dict[str, str]:
        """``{key: copy}`` for each entry of a saved ``[model]`` section the run's own copy stands for."""

    @abc.abstractmethod
    def stand_in(self, key: str, value: str, *, note: bool = True) -> str:
        """``value`` (config entry ``key``, e.g. ``model.path``), or the run's copy of it where it is gone."""
