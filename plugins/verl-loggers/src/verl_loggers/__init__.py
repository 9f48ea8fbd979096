"""verl's metric sinks (``verl.loggers`` plugins): ``console`` and ``jsonl`` (the default ``run.loggers``),
``tensorboard`` and ``wandb``.

``run.loggers = ["console", "jsonl", "tensorboard"]``; a sink's own package is imported when a run starts,
so ``pip install verl-loggers[tensorboard]`` (or ``[wandb]``) is needed only for the sinks used.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from verl_core.kit import hookimpl
from verl_loggers.console import ConsoleLogger
from verl_loggers.jsonl import JsonlLogger, scalars

__version__ = "0.1.0"

__all__ = ["ConsoleLogger", "JsonlLogger", "TensorBoardLogger", "WandbLogger", "SAMPLE_COLUMNS", "scalars"]

#: The columns of a samples table (TensorBoard text, wandb table); a transcript joins them as JSON.
SAMPLE_COLUMNS = ("step", "index", "prompt", "response", "ground_truth", "reward", "response_tokens",
                  "finish_reason")


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str)) or value is None else json.dumps(value, default=str)


def _markdown_table(samples: list[dict[str, Any]], columns: list[str]) -> str:
    """TensorBoard renders text as markdown: one table row per sample (pipes and newlines escaped)."""
    def cell(value: Any) -> str:
        text = "" if value is None else str(_cell(value))
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(s.get(c)) for c in columns) + " |" for s in samples]
    return "\n".join(lines)


def _columns(samples: list[dict[str, Any]]) -> list[str]:
    return list(SAMPLE_COLUMNS) + (["transcript"] if any("transcript" in s for s in samples) else [])


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
    def verl_samples(self, step: int, split: str, samples: list[dict[str, Any]]) -> None:
        if samples:
            self._writer.add_text(f"samples/{split}", _markdown_table(samples, _columns(samples)), step)
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
    def verl_samples(self, step: int, split: str, samples: list[dict[str, Any]]) -> None:
        import wandb

        if samples:
            columns = _columns(samples)
            table = wandb.Table(columns=columns, data=[[_cell(s.get(c)) for c in columns] for s in samples])
            self._run.log({f"samples/{split}": table}, step=step)

    @hookimpl
    def verl_run_end(self, step: int, status: str, error: BaseException | None) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if status == "completed" else 1)
