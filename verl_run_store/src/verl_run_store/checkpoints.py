"""Checkpoint directories: atomic writes, a ``latest`` pointer, manifests, and retention.

Layout under ``<run_dir>/checkpoints``::

    step_000010/            # complete checkpoint: worker states + trainer_state.json + manifest.json
    latest                  # text file naming the newest complete checkpoint, written last
    corrupt-step_000012/    # a checkpoint that failed its manifest on resume, set aside (never taken)
    rewound-step_000020/    # one past the checkpoint a run resumed from, set aside when that run saved again

A checkpoint is written under a temporary name and renamed into place only when complete, so a crash
mid-write never leaves a directory that resume would take; a write that fails (a full disk, an I/O
error) removes what it wrote and leaves ``latest`` where it was (:class:`CheckpointWriteError`).
``manifest.json`` records the size and a checksum of every file; :meth:`CheckpointManager.verify`
checks them, in parallel threads. The checksum is XXH3-128 where the ``xxhash`` package is installed
(it comes with ``datasets``; about 6x faster than SHA-256 here, ``bench/results/checkpoint_faults.md``)
and SHA-256 otherwise; manifests written with either verify with either installed. Every file and
directory of a checkpoint is fsync'd before its rename, and the rename before ``latest`` moves (and
``latest`` before the next checkpoint's), so a power cut leaves the previous checkpoint named, never an
empty file under a complete one's name.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from verl_core.contracts import CheckpointError, CheckpointWriteError, WorkerFailedError

__all__ = ["CheckpointManager", "CheckpointError", "CheckpointWriteError", "CorruptCheckpointError", "pid_alive"]

logger = logging.getLogger(__name__)


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is missing or does not match its manifest (``file``: its path in the checkpoint)."""

    def __init__(self, message: str, *, path: Path, file: str) -> None:
        super().__init__(message)
        self.path = path
        self.file = file


MANIFEST = "manifest.json"
QUARANTINE_PREFIX = "corrupt-"
#: Prefix of the checkpoints a run left behind when it resumed an earlier one and saved again.
REWOUND_PREFIX = "rewound-"


# ----------------------------------------------------------------------------- checksums
def _hasher(algorithm: str) -> Any:
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise CheckpointError("the manifest uses xxh3_128 checksums; pip install xxhash to verify it") from None
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r} in the manifest")


def _default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401 - only whether it is there
    except ImportError:
        return "sha256"
    return "xxh3_128"


def _checksum(path: Path, algorithm: str) -> str:
    h = _hasher(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)  # both hashers release the GIL on large blocks: files hash in parallel
    return h.hexdigest()


def _parallel(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    workers = min(len(items), os.cpu_count() or 1, 8)
    if workers <= 1:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="verl-checksum") as pool:
        return list(pool.map(fn, items))


def _describe(exc: BaseException) -> str:
    """One line for a write failure; torch.distributed.checkpoint wraps each rank's error in a traceback."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = next(iter(failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"{type(inner).__name__} on rank {rank}: {inner}"
    return f"{type(exc).__name__}: {exc}"


def _fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk (a filesystem that cannot sync a directory is let be)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if not path.is_dir() or exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _sync_tree(root: Path) -> None:
    """fsync every file under ``root`` (in parallel), then every directory, deepest first, ``root`` last."""
    paths = sorted(root.rglob("*"))
    _parallel(_fsync, [p for p in paths if p.is_file()])
    for d in sorted((p for p in paths if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        _fsync(d)
    _fsync(root)


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (a lock's holder, a run's status)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CheckpointManager:
    """Saves and finds checkpoints of one run directory."""

    def __init__(self, run_dir: str | os.PathLike, *, keep: int = 0) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def save(self, step: int, write: Callable[[Path], None], *, info: dict[str, Any]) -> Path:
        """Call ``write(tmp_dir)`` to fill a checkpoint, then publish it atomically.

        Raises:
            CheckpointWriteError: ``write`` or the manifest failed with an error (a full disk, an I/O
                error); what was written is removed and ``latest`` still names the previous checkpoint.
                An interruption (``KeyboardInterrupt``) cleans up the same way and propagates as it is.
        """
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".tmp-step_{step:06d}-{os.getpid()}"
        published = False
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temporaries()
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            write(tmp)
            algorithm = _default_algorithm()
            paths = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
            sums = _parallel(lambda p: _checksum(p, algorithm), paths)
            files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, algorithm: s} for p, s in zip(paths, sums)}
            (tmp / MANIFEST).write_text(json.dumps({"step": step, "info": info, "checksum": algorithm,
                                                    "files": files}, indent=1))
            _sync_tree(tmp)  # on disk before the name says complete: a power cut never publishes empty files
            self._set_aside_later(step)
            if final.exists():  # incomplete, or past `latest` (never published): replaced
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync(self.root)  # the rename itself, before `latest` names it
            published = True
            self._write_latest(final.name)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if published:  # complete but not the latest: take it back, so that no resume can pick it
                shutil.rmtree(final, ignore_errors=True)
            for stray in self.root.glob(f".latest-{os.getpid()}"):
                stray.unlink(missing_ok=True)
            # An interruption, or a worker that died while saving (the run may restart it), stays what it is.
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit, WorkerFailedError)):
                raise
            previous = self.latest()
            kept = f"latest still names {previous.name}" if previous is not None else "there is no earlier checkpoint"
            cause = _describe(exc) + self._space_note(previous)
            raise CheckpointWriteError(f"cannot write checkpoint {final}: {cause}; the partial checkpoint was removed "
                                       f"and {kept}", path=final, cause=cause) from exc
        self._prune()
        return final

    def _space_note(self, previous: Path | None) -> str:
        """Torch reports a full disk as "unexpected pos 704 vs 598": say so when free space is short."""
        try:
            free = shutil.disk_usage(self.root).free
            size = (sum(m["bytes"] for m in json.loads((previous / MANIFEST).read_text())["files"].values())
                    if previous is not None else 0)
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        if free < max(size, 1 << 20):
            return (f" (the filesystem has {free / 2**20:.1f} MiB free" +
                    (f", less than the {size / 2**20:.1f} MiB the previous checkpoint takes" if size else "") +
                    ": the disk is probably full)")
        return ""

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f".latest-{os.getpid()}"
        tmp.write_text(name + "\n")
        _fsync(tmp)
        os.replace(tmp, self.root / "latest")
        _fsync(self.root)

    def _set_aside_later(self, step: int) -> None:
        """Set aside the published checkpoints from ``step`` up to the one ``latest`` names, before ``step`` is
        published: a run that resumed an earlier checkpoint (``run.resume=<path>``) left them behind. Pruned by
        step, they would delete the new checkpoints instead, and a ``latest`` that falls back to the highest step
        would resume them. Renamed ``rewound-step_*``: kept for inspection, never taken or pruned. One past
        ``latest`` was never published (a kill between its rename and ``latest``) and is replaced as before."""
        pointer = self.root / "latest"
        top = _step_of(Path(pointer.read_text().strip())) if pointer.is_file() else None
        if top is None:
            return
        later = [p for p in self.complete() if step <= (_step_of(p) or 0) <= top]
        if later:
            aside = [self._set_aside(p, REWOUND_PREFIX).name for p in later]
            _fsync(self.root)
            logger.warning("step %d is saved again while checkpoints at or past it exist (the run resumed an earlier "
                           "one): they were set aside as %s (kept, never resumed or pruned; delete them when not "
                           "needed)", step, ", ".join(aside))

    def _remove_stale_temporaries(self) -> None:
        """Half-written (or half-deleted) checkpoints of processes that are gone (killed mid-save) only take space."""
        for stale in [*self.root.glob(".tmp-step_*"), *self.root.glob(".prune-step_*")]:
            pid = stale.name.rpartition("-")[2]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for old in self.complete()[:-self.keep]:
            # Renamed first: a deletion cut short must not leave a manifest over missing files.
            doomed = self.root / f".prune-{old.name}-{os.getpid()}"
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first (temporary, set-aside and manifest-less directories skipped)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.glob("step_*")
                 if p.is_dir() and (p / MANIFEST).is_file() and _step_of(p) is not None]
        return sorted(found, key=lambda p: _step_of(p) or 0)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, per the ``latest`` pointer (else the highest step)."""
        pointer = self.root / "latest"
        if pointer.is_file():
            candidate = self.root / pointer.read_text().strip()
            if (candidate / MANIFEST).is_file():
                return candidate
        complete = self.complete()
        return complete[-1] if complete else None

    def latest_intact(self, *, fallback: bool = True) -> tuple[Path | None, list[CorruptCheckpointError]]:
        """The newest checkpoint that passes :meth:`verify`, and the errors of those that did not.

        A corrupt one is renamed ``corrupt-step_...`` (kept for inspection, never taken or pruned) and
        the one before it is tried, when ``fallback``; otherwise its error is raised.

        Raises:
            CorruptCheckpointError: a checkpoint is corrupt and ``fallback`` is false, or every
                complete checkpoint is corrupt (starting over would silently drop the run).
        """
        first = self.latest()
        if first is None:
            return None, []
        order = [first, *[p for p in reversed(self.complete()) if p != first]]
        skipped: list[CorruptCheckpointError] = []
        for candidate in order:
            try:
                self.verify(candidate)
            except CorruptCheckpointError as exc:
                if not fallback:
                    raise CorruptCheckpointError(
                        f"{exc}; set run.on_corrupt_checkpoint=\"fallback\" to resume from the checkpoint before it",
                        path=exc.path, file=exc.file) from None
                skipped.append(exc)
                aside = self._set_aside(candidate, QUARANTINE_PREFIX)
                logger.warning("%s; set aside as %s, trying the checkpoint before it", exc, aside.name)
                continue
            if skipped:
                self._write_latest(candidate.name)
            return candidate, skipped
        raise CorruptCheckpointError(
            f"every checkpoint in {self.root} is corrupt ({'; '.join(str(e) for e in skipped)}); they were set aside "
            f"as {QUARANTINE_PREFIX}step_*. Restore a copy, or start over with --resume never",
            path=skipped[-1].path, file=skipped[-1].file)

    @staticmethod
    def _set_aside(path: Path, prefix: str) -> Path:
        target = path.with_name(prefix + path.name)
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{prefix}{path.name}.{n}")
        os.replace(path, target)
        return target

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
        """Check every file against the manifest (sizes first, then checksums in parallel); returns the manifest.

        Raises:
            CorruptCheckpointError: a file is missing, has another size or another checksum (naming it).
            CheckpointError: there is no manifest, or it cannot be read.
        """
        path = Path(path)
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise CheckpointError(f"{path} has no {MANIFEST}: it is incomplete or not a checkpoint")
        try:
            manifest = json.loads(manifest_path.read_text())
            files = dict(manifest["files"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {MANIFEST} cannot be read ({exc})",
                                         path=path, file=MANIFEST) from None
        for rel, meta in files.items():
            f = path / rel
            if not f.is_file():
                raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {rel} is missing", path=path, file=rel)
            size = f.stat().st_size
            if size != meta["bytes"]:
                raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {rel} has {size} bytes, the manifest "
                                             f"says {meta['bytes']} (truncated or overwritten)", path=path, file=rel)

        def check(item: tuple[str, dict[str, Any]]) -> str | None:
            rel, meta = item
            algorithm = "xxh3_128" if "xxh3_128" in meta else "sha256"
            return None if _checksum(path / rel, algorithm) == meta[algorithm] else rel

        bad = [rel for rel in _parallel(check, list(files.items())) if rel is not None]
        if bad:
            raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {bad[0]} does not match its checksum",
                                         path=path, file=bad[0])
        return manifest
