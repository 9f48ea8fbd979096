"""The ``console`` logger: a progress bar plus one short line per step (a ``verl.loggers`` plugin, on by default)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from verl_core.kit import hookimpl

__all__ = ["ConsoleLogger"]


class ConsoleLogger:
    """A progress bar plus one short line per step on the terminal (plain lines when not a TTY)."""

    #: Metric -> column; a tuple of metrics shows the first one present. ``kl`` is the KL to the reference the
    #: algorithm computes (PPO subtracts it from the reward, GRPO with kl_coef adds it to the loss), else the
    #: policy's drift from the old log-probs (0 with one on-policy mini-batch).
    KEYS = (("reward/mean", "reward"), ("val/reward_mean", "val"), ("ppo/actor_loss", "loss"),
            (("ppo/kl_in_reward", "ppo/kl_loss", "actor/ref_kl", "ppo/kl_divergence"), "kl"),
            ("response_length/mean", "len"), ("timing/step", "s/step"))

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

            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.fields[figures]}"), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("RL steps", total=max_steps, completed=start_step, figures="")

    def _print(self, line: str) -> None:
        if self._progress is not None:
            self._progress.console.print(line, highlight=False)
        else:
            print(line, flush=True)

    @hookimpl
    def verl_step_end(self, step: int, metrics: dict[str, float]) -> None:
        parts = [f"step {step}/{self._max_steps}"]
        for keys, label in self.KEYS:
            key = next((k for k in ((keys,) if isinstance(keys, str) else keys) if k in metrics), None)
            if key is not None:
                parts.append(f"{label} {metrics[key]:.4g}")
        done = step - self._start_step
        if done > 0 and self._progress is None:
            eta = (time.perf_counter() - self._start) / done * (self._max_steps - step)
            parts.append(f"eta {eta:.0f}s")
        if self._progress is not None:  # the bar keeps the latest figures in view, drawn now: after a print rich
            # redraws what its last refresh rendered, and a step faster than the refresh tick would never show
            self._progress.update(self._task, completed=step, figures=" | ".join(parts[1:]), refresh=True)
        self._print(" | ".join(parts))

    @hookimpl
    def verl_validation_start(self, step: int, samples: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"validating {samples} samples @ step {step}")
            self._progress.refresh()  # drawn now, not at the next tick: a fast validation is shown too

    @hookimpl
    def verl_validation_end(self, step: int, metrics: dict[str, float]) -> None:
        shown = ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith("val/"))
        self._print(f"validation @ step {step}: {shown}")
        if self._progress is not None:
            self._progress.update(self._task, description="RL steps")

    @hookimpl
    def verl_checkpoint_saved(self, step: int, path: Path) -> None:
        self._print(f"checkpoint saved: {path}")

    @hookimpl
    def verl_health(self, step: int, check: str, message: str) -> None:
        self._print(f"warning (step {step}, {check}): {message}")

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
