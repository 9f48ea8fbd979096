"""Stopping a run on a signal without losing it: preemption (SIGTERM) and Ctrl-C (SIGINT).

Clusters preempt with SIGTERM and a grace period; people press Ctrl-C. With ``run.save_on_signal``
(the default) the first of either is only noted: the trainer finishes the step it is in, writes a
checkpoint of it and stops with :class:`Preempted` (``verl run`` exits with :data:`PREEMPTED_EXIT`),
so that running the same command again resumes exactly there. A second signal stops at once, without
saving (:class:`Interrupted`, exit ``128 + signal``); the last complete checkpoint is kept. A third
one gets the default handling (the process dies), should clean-up itself hang.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["StopSignals", "Preempted", "Interrupted", "PREEMPTED_EXIT"]

#: Exit status of ``verl run`` stopped by a signal after saving a checkpoint: EX_TEMPFAIL of
#: sysexits.h, "try again later" (re-run to resume). Distinct from 130/143, a run killed mid-step.
PREEMPTED_EXIT = 75

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
    """The run stopped after a signal, with a checkpoint of the step it reached.

    Attributes:
        signum: the signal (``signal.SIGTERM``, ``signal.SIGINT``).
        step: the last step done.
        checkpoint: the checkpoint to resume from (``None`` when no step was done and none existed).
    """

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = (f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint (no step was done)")
        super().__init__(f"stopped by {name} after step {step}; {where}; run the same command again to resume")


class Interrupted(KeyboardInterrupt):
    """A second signal: the run stops at once, without saving (``signum``: the signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name}")
        self.signum = signum


class StopSignals:
    """Notes the first SIGTERM / SIGINT for the trainer to act on; raises :class:`Interrupted` on the second.

    A context manager; the previous handlers come back on exit. Nothing is installed when ``enabled``
    is false or outside the main thread (Python delivers signals to the main thread only).
    :meth:`install` may be called again to take the signals back from a library that set its own
    handler meanwhile (``ray.init`` installs one for SIGTERM).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def install(self) -> None:
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return
        for signum in _SIGNALS:
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested = signum
            # os.write, not print or logging: a handler may run in the middle of a write to stderr.
            os.write(2, f"\nverl: {name} received: finishing this step and saving a checkpoint, then stopping "
                        f"(send it again to stop at once, without saving)\n".encode())
            return
        for s in _SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        raise Interrupted(signum)
