"""Reading run directories while their runs write them.

A run directory (``verl run --output-dir``) holds ``config.toml``, ``metrics.jsonl``, ``status.json``,
``health.jsonl``, ``samples/`` and ``checkpoints/``; every file may be partly written, growing, or
rewritten (a rewound run trims ``metrics.jsonl``). Nothing here writes to a run directory.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from verl_run_store import pid_alive  # the liveness check of the run directory's lock

__all__ = ["RunSet", "Run", "JsonLines", "is_run_dir", "flatten", "RunDirError"]

#: Files that make a directory a run directory.
RUN_MARKERS = ("metrics.jsonl", "config.toml", "status.json")


class RunDirError(ValueError):
    """A path given as a run directory is neither a run nor a folder of runs."""


def is_run_dir(path: Path) -> bool:
    return any((path / name).is_file() for name in RUN_MARKERS)


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class JsonLines:
    """A JSON-lines file read incrementally: complete lines only; a file that shrank or was replaced is
    read again from the start, and ``epoch`` counts those restarts so that a reader knows to start over."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.epoch = 0
        self._offset = 0
        self._inode: int | None = None
        self._lock = threading.Lock()

    def refresh(self) -> list[dict[str, Any]]:
        with self._lock:
            try:
                stat = self.path.stat()
            except FileNotFoundError:
                if self.rows or self._offset:
                    self._restart(None)
                return self.rows
            if stat.st_ino != self._inode or stat.st_size < self._offset:
                self._restart(stat.st_ino)
            if stat.st_size > self._offset:
                with open(self.path, "rb") as f:
                    f.seek(self._offset)
                    chunk = f.read(stat.st_size - self._offset)
                end = chunk.rfind(b"\n") + 1  # a line still being written waits for its newline
                for line in chunk[:end].splitlines():
                    if line.strip():
                        try:
                            self.rows.append(json.loads(line))
                        except json.JSONDecodeError:
                            continue  # a damaged line is skipped, not fatal to the view
                self._offset += end
            return self.rows

    def _restart(self, inode: int | None) -> None:
        self.rows, self._offset, self._inode = [], 0, inode
        self.epoch += 1


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


class Run:
    """One run directory."""

    def __init__(self, path: Path, run_id: str) -> None:
        self.path = path
        self.id = run_id
        self.metrics = JsonLines(path / "metrics.jsonl")
        self.health = JsonLines(path / "health.jsonl")
        self._samples: dict[str, JsonLines] = {}

    # ------------------------------------------------------------------ parts
    def status(self) -> dict[str, Any]:
        """``running`` / ``completed`` / ``failed`` / ``interrupted`` / ``unknown``, with the error and progress.

        A status of ``running`` whose process (on this host) is gone becomes ``failed``: it was killed
        before it could say so.
        """
        data = _read_json(self.path / "status.json") or {}
        status = dict(data) if data else self._status_before_start()
        if status.get("status") == "running" and status.get("host") == socket.gethostname() and status.get("pid"):
            if not pid_alive(int(status["pid"])):
                status["status"] = "failed"
                status["error"] = (f"the run's process (pid {status['pid']}) ended without recording how; "
                                   f"it was killed or crashed")
        rows = self.metrics.rows
        status["step"] = max((r.get("step", 0) for r in rows), default=status.get("step", 0))
        try:
            status["last_write"] = (self.path / "metrics.jsonl").stat().st_mtime
        except FileNotFoundError:
            status["last_write"] = None
        return status

    def _status_before_start(self) -> dict[str, Any]:
        """No ``status.json``: the run never reached step 0 (its loggers start there). While ``run.lock`` names a
        live process on this host it is starting; a directory with metrics but no status is an older run's."""
        if (self.path / "metrics.jsonl").is_file():
            return {"status": "unknown", "error": None}
        holder = _read_json(self.path / "run.lock") or {}
        pid = int(holder.get("pid") or 0) if isinstance(holder, dict) else 0
        if pid and holder.get("host") == socket.gethostname() and pid_alive(pid):
            return {"status": "running", "error": None, "pid": pid, "host": holder.get("host"),
                    "note": "starting: loading the model and data"}
        error = self._start_error()
        if error is None:
            error = ("the run stopped before step 0 without recording why"
                     + (f" (its process, pid {pid}, was killed or crashed while starting)" if pid else
                        "; it failed while starting, and its console output has the error"))
        return {"status": "failed", "error": error}

    def _start_error(self) -> str | None:
        """The error a run that failed while starting left, if any: the last ``health.jsonl`` entry."""
        rows = self.health.refresh()
        return str(rows[-1].get("message")) if rows and rows[-1].get("message") else None

    def config(self) -> tuple[str, dict[str, Any]]:
        """The resolved config: its TOML text and its keys flattened (``algorithm.kl_coef``)."""
        try:
            text = (self.path / "config.toml").read_text(encoding="utf-8")
            return text, flatten(tomllib.loads(text))
        except FileNotFoundError:
            return "", {}
        except tomllib.TOMLDecodeError as exc:
            return text, {"<error>": f"config.toml does not parse: {exc}"}

    def checkpoints(self) -> list[dict[str, Any]]:
        """Complete checkpoints (with a manifest) by step; the ``latest`` one marked."""
        root = self.path / "checkpoints"
        try:
            latest = (root / "latest").read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            latest = ""
        found = []
        for folder in sorted(root.glob("step_*")) if root.is_dir() else []:
            manifest = _read_json(folder / "manifest.json")
            if manifest is None:
                continue  # being written, or broken: not a checkpoint to offer
            files = manifest.get("files", {})
            found.append({"step": int(manifest.get("step", folder.name.rpartition("_")[2] or 0)), "name": folder.name,
                          "path": str(folder), "bytes": sum(int(f.get("bytes", 0)) for f in files.values()),
                          "time": folder.stat().st_mtime, "latest": folder.name == latest})
        return sorted(found, key=lambda c: c["step"])

    def sample_files(self) -> list[dict[str, Any]]:
        """The samples files: each validation's, by step, then the training samples."""
        folder = self.path / "samples"
        if not folder.is_dir():
            return []
        out = []
        for path in folder.glob("val_step_*.jsonl"):
            try:
                step = int(path.stem.rpartition("_")[2])
            except ValueError:
                continue
            out.append({"file": path.name, "split": "val", "step": step})
        out.sort(key=lambda f: f["step"])
        if (folder / "train.jsonl").is_file():
            out.append({"file": "train.jsonl", "split": "train", "step": None})
        return out

    def samples(self, name: str) -> list[dict[str, Any]]:
        if name not in {f["file"] for f in self.sample_files()}:
            raise KeyError(name)
        reader = self._samples.setdefault(name, JsonLines(self.path / "samples" / name))
        return list(reader.refresh())

    # ------------------------------------------------------------------ views
    def summary(self) -> dict[str, Any]:
        self.metrics.refresh()
        text, flat = self.config()
        return {"id": self.id, "name": self.path.name, "path": str(self.path), "status": self.status(),
                "config_text": text, "config": flat, "checkpoints": self.checkpoints(),
                "sample_files": self.sample_files(), "health": list(self.health.refresh()),
                "metrics_rows": len(self.metrics.rows), "metrics_epoch": self.metrics.epoch}

    def metrics_since(self, start: int, epoch: int | None = None) -> dict[str, Any]:
        rows = self.metrics.refresh()
        if epoch is not None and epoch != self.metrics.epoch:
            start = 0  # the file was rewritten: the reader starts over
        return {"epoch": self.metrics.epoch, "start": start, "rows": rows[start:], "total": len(rows)}


class RunSet:
    """The runs named on the command line: run directories, or folders whose subfolders are runs
    (scanned again on every :meth:`runs`, so a run started later appears)."""

    def __init__(self, paths: Iterable[str | os.PathLike]) -> None:
        self.roots = [Path(p).expanduser().resolve() for p in paths]
        if not self.roots:
            raise RunDirError("give at least one run directory (or a folder of runs)")
        for root in self.roots:
            if not root.is_dir():
                raise RunDirError(f"{root} is not a directory; give a run directory (verl run --output-dir) "
                                  f"or a folder holding run directories")
        self._runs: dict[Path, Run] = {}
        self._lock = threading.Lock()
        self.runs()

    def runs(self) -> list[Run]:
        found: list[Path] = []
        for root in self.roots:
            if is_run_dir(root):
                found.append(root)
            else:
                found += sorted(p for p in root.iterdir() if p.is_dir() and is_run_dir(p))
        with self._lock:
            for path in found:
                if path not in self._runs:
                    taken = {r.id for r in self._runs.values()}
                    run_id, n = path.name, 2
                    while run_id in taken:
                        run_id, n = f"{path.name}-{n}", n + 1
                    self._runs[path] = Run(path, run_id)
            return [self._runs[p] for p in dict.fromkeys(found)]

    def get(self, run_id: str) -> Run:
        for run in self.runs():
            if run.id == run_id:
                return run
        raise KeyError(run_id)

    def snapshot(self, *, samples: bool = True) -> dict[str, Any]:
        """Everything at once (what ``verl report`` embeds): summaries, all metrics, all samples."""
        out = []
        for run in self.runs():
            summary = run.summary()
            summary["metrics"] = list(run.metrics.rows)
            summary["samples"] = ({f["file"]: run.samples(f["file"]) for f in summary["sample_files"]}
                                  if samples else {})
            out.append(summary)
        return {"runs": out, "generated": time.time(), "live": False}
