"""The ``jsonl`` logger: the run directory's own record (a ``verl.loggers`` plugin, on by default).

``metrics.jsonl``, ``samples/``, ``health.jsonl`` and ``status.json`` are what ``verl dashboard`` and any
other tool read; on a resume (and a rewind) the rows of the steps that run again are dropped first.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from verl_core.kit import hookimpl

__all__ = ["JsonlLogger", "scalars"]


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of ``metrics`` as floats (what a metric sink can plot)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


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
