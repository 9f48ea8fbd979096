"""The run directory holds one run: one process at a time, and a resume only of what it holds (issue 31).

:func:`open_run_dir` does everything a run does to its directory before anything loads:

* the output path must be a directory this user can write, on a filesystem with space left;
* a lock (:class:`RunLock`, ``fcntl.flock`` on ``run.lock``) is held for the whole run. The kernel drops
  it when the process ends, however it ends, so a second run into the same directory stops at once naming
  the first, and a lock left by a killed run is simply taken (with a note naming it). On NFS the lock
  holds across machines where the server supports locks (NFSv4; v3 with lockd); on a filesystem without
  locks a warning says so, and the host and pid in ``run.lock`` are the only check;
* ``config.toml`` is the first run's and is never rewritten. A run that resumes must train what the
  directory holds (:func:`resume_conflicts`: algorithm, model, reward, data, environment, seed, backend and
  its parallel layout, the training sampling); settings safe to change (``run.max_steps``, loggers, cadences,
  ...) are recorded, one line per resumed segment, in ``resumes.jsonl`` and listed on the console.
  ``run.resume = "never"`` starts over after moving the earlier run's files to ``superseded-<time>/``;
  ``run.resume = "force"`` resumes whatever differs.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from verl_core.contracts import CheckpointError
from verl_run_store.checkpoints import MANIFEST, CheckpointManager, pid_alive
from verl_core.config import Config, ConfigError, config_to_dict, dump_toml, load_raw_config, resolve_config
from verl_run_store.run_model import CRITIC_COPY, MODEL_COPY, stands_for

__all__ = ["RunLock", "RunDirectoryError", "open_run_dir", "resume_conflicts", "check_output_dir",
           "LOCK_FILE", "RESUME_LOG", "CONFIG_FILE"]

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
RESUME_LOG = "resumes.jsonl"
CONFIG_FILE = "config.toml"
SUPERSEDED_PREFIX = "superseded-"
#: Below this much free space a run refuses to start (or the size of the latest checkpoint, when larger).
MIN_FREE_BYTES = 1 << 20

#: Sections whose every setting is part of what a checkpoint was trained as ...
TRAINED_SECTIONS = ("algorithm", "model", "reward", "data", "environment")
#: ... except these, which change only what is validated, or how a run handles failures.
SAFE_KEYS = frozenset({"data.val", "data.val_split", "data.max_val_samples", "data.val_batch_size",
                       "data.max_bad_rows", "reward.on_error", "reward.on_invalid", "reward.timeout",
                       "reward.isolation", "reward.workers",
                       # The staleness correction follows trainer.mode (2.0 in the async modes, 0 in sync), and
                       # an async checkpoint resumes in sync mode with its buffered prompts (the README's promise).
                       "algorithm.rollout_is_cap"})
#: Settings of other sections that are part of it: the backend (the parallel layout is found from
#: ``BackendConfig.for_single_process``), the adapters that decide which parameters exist, the seed, and the
#: training sampling: the group size (GRPO's baseline), the distribution the samples come from, and the response
#: budget (Dr. GRPO's loss divides by it). The engine and the validation sampling may change.
TRAINED_KEYS = frozenset({"backend.name", "backend.lora_rank", "backend.lora_alpha", "backend.lora_target_modules",
                          "run.seed", "rollout.n", "rollout.temperature", "rollout.top_p", "rollout.top_k",
                          "rollout.max_new_tokens"})


class RunDirectoryError(ConfigError):
    """The run directory cannot take this run: in use, not writable, full, or holding another run."""


# ----------------------------------------------------------------------------- the path
def check_output_dir(run_dir: Path) -> None:
    """Refuse an output path that is a file, is not writable, or is on a full filesystem (before anything loads)."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == run_dir else f"is under {str(existing)!r}, which is a file"
        raise RunDirectoryError("run.output_dir", f"{str(run_dir)!r} {what}; give --output-dir a directory "
                                                  f"(created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirectoryError("run.output_dir", f"{str(existing)!r} is not writable by this user; give "
                                                  f"--output-dir a directory you can write, or change its permissions")
    latest = CheckpointManager(run_dir).latest() if run_dir.is_dir() else None
    needed = max(MIN_FREE_BYTES, _checkpoint_bytes(latest))
    free = shutil.disk_usage(existing).free
    if free < needed:
        what = (f"the latest checkpoint takes {needed / 2**20:.1f} MiB" if needed > MIN_FREE_BYTES
                else "the disk is full")
        raise RunDirectoryError("run.output_dir", f"the filesystem of {str(existing)!r} has {free / 2**20:.1f} MiB "
                                                  f"free and {what}; free space, or give --output-dir another disk")


def _checkpoint_bytes(path: Path | None) -> int:
    try:
        return sum(m["bytes"] for m in json.loads((path / MANIFEST).read_text())["files"].values()) if path else 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0


# ----------------------------------------------------------------------------- the lock
#: Locks this process holds, by directory: a later Trainer of the same process (a notebook cell run
#: again) takes its directory's lock over instead of waiting on itself.
_HELD: dict[str, "RunLock"] = {}


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<run_dir>/run.lock``, which names its holder (host, pid, start).

    The file stays when released (deleting a flock'ed file lets two processes lock two different files);
    it is emptied, so a holder's record left in it means that holder was killed.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirectoryError` naming the run that holds it."""
        key = os.path.realpath(self.run_dir)
        mine = _HELD.get(key)
        if mine is not None and mine is not self and mine._fd is not None:
            self._fd, mine._fd = mine._fd, None  # the same process ran again: take its lock over
            _HELD[key] = self
            self._write_holder()
            return
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl_lock(fd)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirectoryError("run.output_dir", f"{self.run_dir} is in use by another run: "
                                                      f"{_describe(holder)}. Wait for it to finish or stop it, or "
                                                      f"give this run another --output-dir") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            holder = _read_holder(fd)
            if holder.get("host") == socket.gethostname() and pid_alive(int(holder.get("pid", 0) or 0)) \
                    and holder.get("pid") != os.getpid():
                os.close(fd)
                raise RunDirectoryError("run.output_dir", f"{self.run_dir} is in use by another run: "
                                                          f"{_describe(holder)}; give this run another --output-dir")
            logger.warning("the filesystem of %s does not support file locks (%s), so a second run into it from "
                           "another machine would not be noticed; run one run per directory", self.run_dir, exc)
        else:
            holder = _read_holder(fd)
            if holder.get("pid") and holder.get("pid") != os.getpid():
                logger.warning("taking over the lock of %s from a run that ended without releasing it (%s)",
                               self.run_dir, _describe(holder))
        self._fd = fd
        _HELD[key] = self
        self._write_holder()

    def _write_holder(self) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                  "command": " ".join(sys.argv[:1] + sys.argv[1:8])}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(record).encode(), 0)

    def release(self) -> None:
        """Empty the record and drop the lock (nothing when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if _HELD.get(os.path.realpath(self.run_dir)) is self:
            del _HELD[os.path.realpath(self.run_dir)]
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing drops the flock


def fcntl_lock(fd: int) -> None:
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "a process that has not written its name yet"
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {when} ({holder.get('command', '')})"


# ----------------------------------------------------------------------------- the config
def _flat(data: dict[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in data.items() if isinstance(values, dict)
            for key, value in values.items()}


def _layout_keys(*configs: Config | None) -> set[str]:
    """The backend settings that name a parallel layout: those ``for_single_process`` collapses."""
    keys: set[str] = set()
    for cfg in configs:
        backend = getattr(getattr(cfg, "backend", None), "config", None)
        if backend is None or not dataclasses.is_dataclass(backend) or not hasattr(backend, "for_single_process"):
            continue
        whole, single = dataclasses.asdict(backend), dataclasses.asdict(backend.for_single_process())
        keys |= {f"backend.{k}" for k, v in whole.items() if single.get(k) != v}
    return keys


def _trained(key: str, layout: set[str]) -> bool:
    return (key.split(".", 1)[0] in TRAINED_SECTIONS and key not in SAFE_KEYS) or key in TRAINED_KEYS or key in layout


def _same(a: Any, b: Any, key: str = "", run_dir: Path | None = None) -> bool:
    if a == b or (run_dir is not None and stands_for(run_dir, key, a, b)):  # the run's copy of its model
        return True
    if isinstance(a, str) and isinstance(b, str) and a and b:  # one local path spelled two ways
        pa, pb = Path(a).expanduser(), Path(b).expanduser()
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    return False


def resume_conflicts(saved: dict[str, Any], config: Config, registry: Any) -> tuple[list[tuple[str, Any, Any]],
                                                                                  dict[str, list[Any]]]:
    """Compare a saved raw config with ``config``: (differences that change what is trained, safe differences).

    The saved config is resolved as it was (defaults of keys added since are filled in); one that no longer
    resolves (a plugin since removed) is compared key by key where both have the key.
    """
    try:
        saved_cfg: Config | None = resolve_config(saved, registry)
        old = _flat(config_to_dict(saved_cfg))
    except Exception:  # noqa: BLE001 - whatever it is, the raw keys still compare
        saved_cfg, old = None, _flat(saved)
    new = _flat(config_to_dict(config))
    layout = _layout_keys(saved_cfg, config)
    conflicts: list[tuple[str, Any, Any]] = []
    safe: dict[str, list[Any]] = {}
    for key in dict.fromkeys([*old, *new]):
        if key in ("run.output_dir", "run.resume") or (saved_cfg is None and (key not in old or key not in new)):
            continue
        a, b = old.get(key), new.get(key)
        if _same(a, b, key, Path(config.run.output_dir)):
            continue
        if _trained(key, layout):
            conflicts.append((key, a, b))
        else:
            safe[key] = [a, b]
    # Another plugin in a section (algorithm grpo -> ppo): its name says it; its settings are another plugin's.
    renamed = {k.split(".", 1)[0] for k, _, _ in conflicts if k.split(".", 1)[0] in config.sections
               and config.section_spec(k.split(".", 1)[0]).plugin_kind
               and k.split(".", 1)[1] == config.section_spec(k.split(".", 1)[0]).key}
    conflicts = [c for c in conflicts if c[0].split(".", 1)[0] not in renamed
                 or c[0].split(".", 1)[1] == config.section_spec(c[0].split(".", 1)[0]).key]
    return conflicts, safe


def _value(v: Any) -> str:
    return "(unset)" if v is None else json.dumps(v, default=str)


def _change(key: str, a: Any, b: Any) -> str:
    return f"{key}: {_value(a)} -> {_value(b)}"


def _reference_config(run_dir: Path, resume: str) -> Path | None:
    """The config a resume must match: the directory's, else that of the checkpoint named by ``run.resume``."""
    if (run_dir / CONFIG_FILE).is_file():
        return run_dir / CONFIG_FILE
    if resume not in ("auto", "never", "force"):
        try:
            ckpt = CheckpointManager.resolve(resume)
        except CheckpointError:
            return None  # the resume itself names the problem
        for candidate in (ckpt / CONFIG_FILE, ckpt.parent.parent / CONFIG_FILE):
            if candidate.is_file():
                return candidate
    return None


#: What a run writes into its directory (loggers included); only these are set aside, never a user's own files.
RUN_FILES = (CONFIG_FILE, RESUME_LOG, "checkpoints", "metrics.jsonl", "samples", "health.jsonl", "status.json",
             "tensorboard", MODEL_COPY, CRITIC_COPY)


def _set_aside(run_dir: Path) -> Path | None:
    """Move an earlier run's files (:data:`RUN_FILES`) to ``superseded-<time>/``; None when there are none."""
    moving = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if not moving:
        return None
    target = run_dir / f"{SUPERSEDED_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while target.exists():
        n += 1
        target = target.with_name(f"{target.name.split('.')[0]}.{n}")
    target.mkdir()
    for p in moving:
        os.replace(p, target / p.name)
    return target


def _starts_over(run_dir: Path, resume: str, reference: Path) -> bool:
    """A resume of a directory whose run wrote its config but no checkpoint: there is nothing to resume."""
    if resume != "auto" or reference != run_dir / CONFIG_FILE:
        return False
    try:
        return CheckpointManager(run_dir).latest() is None
    except CheckpointError:
        return False  # a checkpoint is there, if unreadable: the resume names the problem


def _refusal(run_dir: Path, reference: Path, conflicts: list[tuple[str, Any, Any]]) -> RunDirectoryError:
    listed = "".join(f"\n  {_change(*c)}" for c in conflicts)
    return RunDirectoryError("", f"{run_dir} holds a run trained with other settings (its {reference.name}); "
                                 f"resuming it with these would train something else:{listed}\nNothing was "
                                 f"changed. Resume it with its own settings, give this run a new --output-dir, "
                                 f"start over in it with --resume never (the earlier files are moved to "
                                 f"{SUPERSEDED_PREFIX}<time>/), or resume anyway with run.resume=\"force\"")


def refused_resume(run_dir: Path, config: Config, registry: Any) -> RunDirectoryError | None:
    """The error :func:`record_config` would stop this run with, found without writing anything (the dry run)."""
    resume = config.run.resume
    reference = None if resume in ("never", "force") else _reference_config(run_dir, resume)
    if reference is None:
        return None
    conflicts, _ = resume_conflicts(load_raw_config(reference), config, registry)
    return _refusal(run_dir, reference, conflicts) if conflicts and not _starts_over(run_dir, resume, reference) else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def record_config(run_dir: Path, config: Config, registry: Any) -> None:
    """Write ``config.toml`` for a new run; check a resume against it and log the resume (see the module doc)."""
    resume = config.run.resume
    text = dump_toml(config_to_dict(config))
    if resume == "never":
        aside = _set_aside(run_dir)
        if aside is not None:
            logger.warning("run.resume='never': the earlier run's files in %s were moved to %s", run_dir, aside.name)
        _write_atomic(run_dir / CONFIG_FILE, text)
        return
    reference = _reference_config(run_dir, resume)
    if reference is None:
        _write_atomic(run_dir / CONFIG_FILE, text)
        return
    conflicts, safe = resume_conflicts(load_raw_config(reference), config, registry)
    if conflicts and _starts_over(run_dir, resume, reference):
        # The earlier run stopped before its first checkpoint (often at a config error during set-up):
        # nothing was trained that these settings could mix with. Start over, keeping its files aside.
        aside = _set_aside(run_dir)
        logger.warning("%s held a run with other settings but no checkpoint; its files were moved to %s and this "
                       "run starts over", run_dir, aside.name if aside is not None else "(none)")
        _write_atomic(run_dir / CONFIG_FILE, text)
        return
    if conflicts and resume != "force":
        raise _refusal(run_dir, reference, conflicts)
    if conflicts:
        logger.warning("run.resume='force': resuming %s with settings that change what is trained: %s", run_dir,
                       "; ".join(_change(*c) for c in conflicts))
    if safe:  # said once here, or only resumes.jsonl would show what the recorded config no longer says
        logger.warning("resuming %s with other settings that do not change what is trained (recorded in %s; the "
                       "earlier ones are in %s): %s", run_dir, RESUME_LOG, reference,
                       "; ".join(_change(k, a, b) for k, (a, b) in safe.items()))
    if not (run_dir / CONFIG_FILE).is_file():  # a new directory resumed from another run's checkpoint
        _write_atomic(run_dir / CONFIG_FILE, text)
    try:  # the checkpoint this segment starts from (a corrupt one set aside on resume is not known yet)
        start = (CheckpointManager(run_dir).latest() if resume in ("auto", "force")
                 else CheckpointManager.resolve(resume))
    except CheckpointError:
        start = None  # the resume itself names the problem
    entry = {"time": time.time(), "host": socket.gethostname(), "pid": os.getpid(), "resume": resume,
             "checkpoint": start.name if start is not None else None,
             "changed": {**safe, **{k: [a, b] for k, a, b in conflicts}}, "forced": [k for k, _, _ in conflicts]}
    with open(run_dir / RESUME_LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry, default=str) + "\n")


def open_run_dir(config: Config, registry: Any) -> RunLock:
    """Check the output path, take the directory's lock and record (or check) the config; returns the held lock.

    Raises:
        RunDirectoryError: the path cannot hold a run, another run holds it, or a resume would train
            something other than what it holds. Nothing in the directory has changed then.
    """
    run_dir = Path(config.run.output_dir)
    check_output_dir(run_dir)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirectoryError("run.output_dir", f"cannot create {str(run_dir)!r}: {exc.strerror or exc}") from None
    lock = RunLock(run_dir)
    try:
        lock.acquire()
        record_config(run_dir, config, registry)
    except BaseException:
        lock.release()
        if created:  # a refused run leaves no directory behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return lock
