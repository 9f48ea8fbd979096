"""Checkpoint directories: atomic writes, a ``latest`` pointer, manifests, and retention.

Layout under ``<run_dir>/checkpoints``::

    step_000010/            # complete checkpoint: worker states + trainer_state.json + manifest.json
    latest                  # text file naming the newest complete checkpoint, written last

A checkpoint is written under a temporary name and renamed into place only when complete, so a crash
mid-write never leaves a directory that resume would take. ``manifest.json`` records the size and SHA-256
of every file; loading verifies it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

__all__ = ["CheckpointManager", "CheckpointError"]

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: missing, incomplete, corrupt or from another setup."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class CheckpointManager:
    """Saves and finds checkpoints of one run directory."""

    def __init__(self, run_dir: str | os.PathLike, *, keep: int = 0) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def save(self, step: int, write: Callable[[Path], None], *, info: dict[str, Any]) -> Path:
        """Call ``write(tmp_dir)`` to fill a checkpoint, then publish it atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-step_{step:06d}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        write(tmp)
        files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "info": info, "files": files}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        self._write_latest(final.name)
        self._prune()
        return final

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f".latest-{os.getpid()}"
        tmp.write_text(name + "\n")
        os.replace(tmp, self.root / "latest")

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for old in self.complete()[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (temporary and manifest-less directories skipped)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*") if p.is_dir() and (p / MANIFEST).is_file()]
        return sorted(found, key=lambda p: int(p.name.split("_")[1]))

    def latest(self) -> Path | None:
        """The newest complete checkpoint, per the ``latest`` pointer (else the highest step)."""
        pointer = self.root / "latest"
        if pointer.is_file():
            candidate = self.root / pointer.read_text().strip()
            if (candidate / MANIFEST).is_file():
                return candidate
        complete = self.complete()
        return complete[-1] if complete else None

    @staticmethod
    def resolve(path: str | os.PathLike) -> Path:
        """A checkpoint directory from a checkpoint path or a run directory (its latest)."""
        p = Path(path)
        if (p / MANIFEST).is_file():
            return p
        found = CheckpointManager(p).latest()
        if found is None and p.name == "checkpoints":
            found = CheckpointManager(p.parent).latest()
        if found is not None:
            return found
        raise CheckpointError(f"{p} is neither a checkpoint (no {MANIFEST}) nor a run directory with a complete "
                              f"checkpoint")

    @staticmethod
    def verify(path: Path) -> dict[str, Any]:
        """Check every file against the manifest; returns the manifest."""
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"{path} has no {MANIFEST}: it is incomplete or not a checkpoint")
        manifest = json.loads(manifest_path.read_text())
        for rel, meta in manifest["files"].items():
            f = path / rel
            if not f.is_file():
                raise CheckpointError(f"checkpoint {path} is missing {rel}")
            if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
                raise CheckpointError(f"checkpoint {path} is corrupt: {rel} does not match its checksum")
        return manifest
