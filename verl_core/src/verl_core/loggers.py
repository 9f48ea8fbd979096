"""Built-in metric sinks, registered as ``verl.loggers`` plugins like any third-party logger.

``tensorboard`` and ``wandb`` come from the verl-loggers distribution.
"""

from __future__ import annotations

import json
import math
import os
import socket
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
        if self._progress is not None:  # the bar keeps the latest figures in view; updated before the print
            # so that the redraw that comes with the print shows this step (a fast step can beat the refresh tick)
            self._progress.update(self._task, completed=step, figures=" | ".join(parts[1:]))
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


def _step_of(line: str) -> float:
    """The ``step`` of a JSON line; a line cut short by a kill (not JSON) counts as past every step."""
    try:
        row = json.loads(line)
        return float(row.get("step", 0)) if isinstance(row, dict) else math.inf
    except (ValueError, TypeError):
        return math.inf


def _drop_after(path: Path, step: int) -> None:
    """Remove the JSON lines of ``path`` whose ``step`` is past ``step`` (atomically)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
            if _step_of(line) <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


def _cut_back(run_dir: Path, step: int) -> None:
    """Drop what the run directory's files hold of the steps after ``step`` (all of it for ``step < 0``)."""
    _drop_after(run_dir / "metrics.jsonl", step)
    _drop_after(run_dir / "samples" / "train.jsonl", step)
    _drop_after(run_dir / "health.jsonl", step)
    for stale in (run_dir / "samples").glob("val_step_*.jsonl"):
        if int(stale.stem.rpartition("_")[2]) > step:
            stale.unlink()


def _append(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(row, default=str) + "\n" for row in rows))


class JsonlLogger:
    """The run directory's own record, in files any tool can read while the run writes them.

    - ``metrics.jsonl``: one JSON object per emitted metrics dict (``{"step": N, ...}``);
    - ``samples/val_step_<N>.jsonl`` (each validation) and ``samples/train.jsonl`` (a few per step):
      generated samples, one per line (``run.val_samples``, ``run.train_samples``);
    - ``health.jsonl``: the health checks that failed (``{"step", "check", "message", "time"}``);
    - ``status.json``: ``running`` (with the pid and host), then ``completed``, ``failed`` (with the
      error) or ``interrupted``.
    """

    def __init__(self) -> None:
        self._file = None
        self._run_dir: Path | None = None
        self._status: dict[str, Any] = {}

    def _write_status(self, **changes: Any) -> None:
        self._status.update(changes, updated=time.time())
        path = self._run_dir / "status.json"
        tmp = path.with_name("status.json.tmp")
        tmp.write_text(json.dumps(self._status, indent=1), encoding="utf-8")
        tmp.replace(path)

    @hookimpl
    def verl_run_start(self, config: Any, run_dir: Path, start_step: int, max_steps: int) -> None:
        self._run_dir = Path(run_dir)
        # What a killed run wrote after its checkpoint runs again now (from step 0: everything), so that each
        # step appears once. Step ``start_step``'s own rows stay: they belong to the checkpoint resumed from.
        _cut_back(self._run_dir, start_step if start_step > 0 else -1)
        self._file = open(self._run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._status = {}
        self._write_status(status="running", pid=os.getpid(), host=socket.gethostname(), start_step=start_step,
                           max_steps=max_steps, started=time.time(), error=None)

    @hookimpl
    def verl_metrics(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in scalars(metrics).items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    @hookimpl
    def verl_samples(self, step: int, split: str, samples: list[dict[str, Any]]) -> None:
        folder = self._run_dir / "samples"
        folder.mkdir(exist_ok=True)
        if split == "val":  # a validation is written whole, so a reader never sees half of one
            path = folder / f"val_step_{step}.jsonl"
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in samples), encoding="utf-8")
            tmp.replace(path)
        else:
            _append(folder / f"{split}.jsonl", samples)

    @hookimpl
    def verl_health(self, step: int, check: str, message: str) -> None:
        _append(self._run_dir / "health.jsonl", [{"step": step, "check": check, "message": message,
                                                  "time": time.time()}])

    @hookimpl
    def verl_run_rewound(self, step: int, reason: str) -> None:
        # The steps after ``step`` run again: drop their rows, so that each step appears once, as uninterrupted.
        path = Path(self._file.name)
        self._file.close()
        _cut_back(self._run_dir, step)
        self._file = open(path, "a", encoding="utf-8")

    @hookimpl
    def verl_run_end(self, step: int, status: str, error: BaseException | None) -> None:
        if self._file is not None:
            self._file.close()
        if self._run_dir is not None:
            self._write_status(status=status, step=step, ended=time.time(),
                               error=f"{type(error).__name__}: {error}" if error is not None else None)
