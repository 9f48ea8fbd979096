"""Progress of long work outside an RL step (a model's warm start, a data reader's tokenizing): a bar with
ETA and key figures on a terminal, a few plain lines when output goes to a file or a CI log. The plugin
doing the work shows it (the RL steps' bar is the ``console`` logger's).

Example::

    with Progress("warm start", total=400, unit="steps") as bar:
        for step in range(1, 401):
            ...
            bar.update(step, loss=loss)
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

__all__ = ["Progress", "format_figures"]


def format_figures(figures: dict[str, Any]) -> str:
    """``{"loss": 0.51234, "acc": 0.5}`` -> ``"loss 0.5123 | acc 0.5"`` (``None`` values left out)."""
    return " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()
                      if v is not None)


class Progress:
    """A progress report for ``total`` units of work.

    On a terminal: a transient rich bar (label, bar, done/total, ETA, the figures). Otherwise: a line
    when it starts, one at most every ``every`` seconds while it runs, and one when it ends, so that a
    CI log stays readable (no carriage returns, no colour codes).

    Args:
        label: what is running (``"warm start"``).
        total: units of work in all.
        unit: what a unit is, for the plain lines (``"steps"``).
        stream: where to write (default ``sys.stderr``: progress is not the program's output).
        every: seconds between plain lines.
    """

    def __init__(self, label: str, total: int, *, unit: str = "", stream: IO[str] | None = None,
                 every: float = 10.0) -> None:
        self.label, self.total, self.unit, self.every = label, total, unit, every
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.figures: dict[str, Any] = {}
        self._start = self._last_line = time.perf_counter()
        self._bar = None
        self._task = None

    def __enter__(self) -> "Progress":
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(TextColumn(self.label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[figures]}"), transient=True,
                                     console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total, figures="")
        else:
            self._line(f"{self.label}: started ({self.total} {self.unit})".replace(" )", ")"))
        return self

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
        self._last_line = time.perf_counter()

    def eta(self) -> float | None:
        """Seconds left at the pace so far (``None`` before the first unit)."""
        if not self.done:
            return None
        return (time.perf_counter() - self._start) / self.done * max(0, self.total - self.done)

    def update(self, done: int, **figures: Any) -> None:
        """``done`` units finished so far; ``figures`` are shown beside the bar (loss, accuracy, ...)."""
        self.done = done
        self.figures.update(figures)
        if self._bar is not None:
            self._bar.update(self._task, completed=done, figures=format_figures(self.figures))
        elif time.perf_counter() - self._last_line >= self.every:
            shown = format_figures(self.figures)
            self._line(f"{self.label}: {done}/{self.total} {self.unit}, eta {self.eta():.0f}s"
                       + (f" | {shown}" if shown else ""))

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()
        shown = format_figures(self.figures)
        self._line(f"{self.label}: {'stopped' if exc[0] else 'done'} after {self.done}/{self.total} {self.unit} in "
                   f"{time.perf_counter() - self._start:.1f}s" + (f" | {shown}" if shown else ""))
