"""Metric sinks for verl that need an extra package: ``tensorboard`` and ``wandb`` (``verl.loggers`` plugins).

``run.loggers = ["console", "jsonl", "tensorboard"]``; the sink's package is imported when a run starts,
so ``pip install verl-loggers[tensorboard]`` (or ``[wandb]``) is needed only for the sinks used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_core.hooks import hookimpl
from verl_core.loggers import scalars

__version__ = "0.1.0"

__all__ = ["TensorBoardLogger", "WandbLogger"]


class TensorBoardLogger:
    """Writes scalars to ``<run_dir>/tensorboard`` (needs the ``tensorboard`` package)."""

    def __init__(self) -> None:
        self._writer = None

    @hookimpl
    def verl_run_start(self, config: Any, run_dir: Path, start_step: int, max_steps: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError("the tensorboard logger needs `pip install tensorboard`") from exc
        self._writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    @hookimpl
    def verl_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in scalars(metrics).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    @hookimpl
    def verl_run_end(self, step: int, status: str, error: BaseException | None) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbLogger:
    """Logs to Weights & Biases (needs the ``wandb`` package; honours ``WANDB_MODE``)."""

    def __init__(self) -> None:
        self._run = None

    @hookimpl
    def verl_run_start(self, config: Any, run_dir: Path, start_step: int, max_steps: int) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError("the wandb logger needs `pip install wandb`") from exc
        from verl_core.config import config_to_dict

        self._run = wandb.init(project=config.run.project, name=config.run.name or Path(run_dir).name,
                               dir=str(run_dir), config=config_to_dict(config), resume="allow")

    @hookimpl
    def verl_metrics(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(scalars(metrics), step=step)

    @hookimpl
    def verl_run_end(self, step: int, status: str, error: BaseException | None) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "completed" else 1)
