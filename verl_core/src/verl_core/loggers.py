"""Built-in metric sinks, registered as ``verl.loggers`` plugins like any third-party logger.

``tensorboard`` and ``wandb`` come from the verl-loggers distribution.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from verl_core.hooks import hookimpl

__all__ = ["ConsoleLogger", "JsonlLogger", "scalars"]


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of ``metrics`` as floats (what a metric sink can plot)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class ConsoleLogger:
    """A progress bar plus one short line per step on the terminal (plain lines when not a TTY)."""

    KEYS = (("reward/mean", "reward"), ("val/reward_mean", "val"), ("ppo/actor_loss", "loss"),
            ("ppo/kl_divergence", "kl"), ("response_length/mean", "len"), ("timing/step", "s/step"))

    def __init__(self) -> None:
        self._progress = None
        self._task = None
        self._start = time.perf_counter()
        self._start_step = 0
        self._max_steps = 0

    @hookimpl
    def verl_run_start(self, config: Any, run_dir: Path, start_step: int, max_steps: int) -> None:
        self._start_step, self._max_steps = start_step, max_steps
        print(f"verl: run directory {run_dir}" + (f" (resumed at step {start_step})" if start_step else ""),
              flush=True)
        if getattr(config, "profile", ""):
            print(f"verl: defaults: {config.profile}", flush=True)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("RL steps"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("train", total=max_steps, completed=start_step)

    def _print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, highlight=False)
        else:
            print(line, flush=True)

    @hookimpl
    def verl_step_end(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"step {step}/{self._max_steps}"]
        parts += [f"{label} {metrics[key]:.4g}" for key, label in self.KEYS if key in metrics]
        done = step - self._start_step
        if done > 0 and self._progress is None:
            eta = (time.perf_counter() - self._start) / done * (self._max_steps - step)
            parts.append(f"eta {eta:.0f}s")
        self._print(" | ".join(parts))
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    @hookimpl
    def verl_validation_end(self, step: int, metrics: dict[str, float]) -> None:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith("val/"))
        self._print(f"validation @ step {step}: {shown}")

    @hookimpl
    def verl_checkpoint_saved(self, step: int, path: Path) -> None:
        self._print(f"checkpoint saved: {path}")

    @hookimpl
    def verl_run_rewound(self, step: int, reason: str) -> None:
        self._print(f"verl: worker groups restarted after: {reason}; back at step {step}")
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    @hookimpl
    def verl_run_end(self, step: int, status: str, error: BaseException | None) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._print(f"verl: run {status} at step {step}" + (f": {error}" if error else ""))


class JsonlLogger:
    """Appends one JSON object per emitted metrics dict to ``<run_dir>/metrics.jsonl``."""

    def __init__(self) -> None:
        self._file = None

    @hookimpl
    def verl_run_start(self, config: Any, run_dir: Path, start_step: int, max_steps: int) -> None:
        self._file = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8")

    @hookimpl
    def verl_metrics(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in scalars(metrics).items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    @hookimpl
    def verl_run_rewound(self, step: int, reason: str) -> None:
        # The steps after ``step`` run again: drop their rows, so that each step appears once, as uninterrupted.
        path = Path(self._file.name)
        self._file.close()
        kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
                if line.strip() and json.loads(line).get("step", 0) <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(path)
        self._file = open(path, "a", encoding="utf-8")

    @hookimpl
    def verl_run_end(self, step: int, status: str, error: BaseException | None) -> None:
        if self._file is not None:
            self._file.close()
