"""``trainer.mode = "auto"``: sync, or an overlapping mode where the first steps show that it pays (issue 33).

The run starts synchronously (the core's ``sync`` source). After the first step of the process (a warm-up,
left out), ``trainer.auto_steps`` steps are measured: the rollout stage (``timing/rollout``: generation and
scoring, what a producer would take over) against the rest of the step (``timing/step`` minus it: log-probs,
update, weight sync, which the trainer keeps). :func:`pick_mode` then decides from those medians and the
machine's cores. Overlapping, the source hands over to ``colocate_async`` (``separate_async`` where the
executor places only that one) from the next step on, as a resume from that step's checkpoint would: the
same weights, the sampler where the sync steps left it, so no prompt is trained twice or lost.

The choice is logged as one line, added to the next step's metrics (``auto/*``) and kept in every later
checkpoint (``trainer_state.json``'s ``"auto"``), so a resumed run goes on in the mode it picked, never
in another one chosen from other figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from verl_core import hookimpl
from verl_core.contracts import ConfigError, SourcedStep, StepSource
from verl_trainer_async.source import AsyncConfig, AsyncSource, _producer_threads

__all__ = ["AUTO_MARGIN", "AutoChoice", "AutoConfig", "AutoSource", "SPARE_CORES", "pick_mode"]

logger = logging.getLogger(__name__)

#: Share of the sync step that the predicted overlapped step must save before ``auto`` overlaps: on the small
#: job the per-round speed ratios of two modes spread by 10-30% on a shared 2-core machine
#: (bench/results/trl_comparison_async_small.md, bench/results/auto_mode.md), so a smaller predicted gain
#: is within noise, and sync (no stale samples, no second copy of the weights) keeps the run.
AUTO_MARGIN = 0.2
#: Cores the two sides need besides their torch threads: the trainer's process dispatches, scores and copies
#: the weights out in Python, and the producer's loads them and ships its batches back, outside torch's
#: thread pool. Without them the two sides share cores and both slow down: on 2 cores, one trainer thread
#: next to one producer thread ran the small job's update 1.5-3x slower than sync does and its step
#: 1.2-2.2x longer (bench/results/auto_mode.md; issue 33 measured 0.036 s against 0.019 s).
SPARE_CORES = 1


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` picked, and the figures it picked it from.

    Attributes:
        mode: ``"sync"``, ``"colocate_async"`` or ``"separate_async"``.
        generate_s: the sync step's rollout stage (median over the measured steps, seconds).
        update_s: the rest of the sync step (median, seconds).
        cores: the CPU cores this process may run on.
        trainer_threads: the trainer's torch threads (``run.threads``).
        producer_threads: the producer's (``trainer.producer_threads``).
        predicted_s: the overlapped step the figures predict (seconds; 0 where no overlap was possible).
        reason: why, in words.
    """

    mode: str
    generate_s: float
    update_s: float
    cores: int
    trainer_threads: int
    producer_threads: int
    predicted_s: float
    reason: str

    def line(self) -> str:
        """The one line the run logs."""
        return (f"trainer.mode=auto picked {self.mode}: generation {self.generate_s:.3f} s, update "
                f"{self.update_s:.3f} s per step, {self.cores} cores -> {self.reason}")

    def metrics(self) -> dict[str, float]:
        return {"auto/overlapped": float(self.mode != "sync"), "auto/generate_s": self.generate_s,
                "auto/update_s": self.update_s, "auto/cores": float(self.cores),
                "auto/predicted_step_s": self.predicted_s}


def pick_mode(generate_s: float, update_s: float, *, cores: int, trainer_threads: int, producer_threads: int,
              overlap_mode: str = "colocate_async", margin: float = AUTO_MARGIN,
              spare_cores: int = SPARE_CORES) -> AutoChoice:
    """Sync, or ``overlap_mode``, for a run whose sync step generates for ``generate_s`` and updates for
    ``update_s`` seconds on ``trainer_threads`` torch threads, on a machine of ``cores`` cores.

    * Both sides at once need ``trainer_threads + producer_threads + spare_cores`` cores
      (:data:`SPARE_CORES`). With fewer, they share cores, and sync is kept: measured, sharing slows the
      update by more than the overlap saves.
    * Otherwise an overlapped step takes as long as its longer side: the producer generating on its
      ``producer_threads`` threads, ``generate_s * trainer_threads / producer_threads`` (as if generation
      scaled with threads; it scales worse, which only favours sync), or the trainer's ``update_s``. It
      overlaps when that is at least ``margin`` (:data:`AUTO_MARGIN`) under the sync step,
      ``generate_s + update_s``; a smaller gain is within noise.

    ``predicted_s`` of the choice is that overlapped step (with cores shared, times the share: a low bound).
    """
    sync_s = generate_s + update_s
    need = trainer_threads + producer_threads + spare_cores
    shared = max(1.0, need / max(1, cores))
    predicted = max(generate_s * trainer_threads / max(1, producer_threads), update_s) * shared
    figures = dict(generate_s=generate_s, update_s=update_s, cores=cores, trainer_threads=trainer_threads,
                   producer_threads=producer_threads, predicted_s=predicted)
    threads = f"{trainer_threads}+{producer_threads} threads"
    if need > cores:
        return AutoChoice(mode="sync", reason=(
            f"sync (overlapped, the trainer and a producer need {need} cores, {threads} and {spare_cores} for their "
            f"Python work, and would share {cores}: both sides slow down, and the update more than the "
            f"overlap saves)"), **figures)
    if sync_s > 0 and predicted <= (1.0 - margin) * sync_s:
        return AutoChoice(mode=overlap_mode, reason=(
            f"{overlap_mode} (overlapped step predicted {predicted:.3f} s on {threads}, {1 - predicted / sync_s:.0%} "
            f"under the sync step's {sync_s:.3f} s, more than the {margin:.0%} margin)"), **figures)
    return AutoChoice(mode="sync", reason=(
        f"sync (overlapped step predicted {predicted:.3f} s on {threads} against {sync_s:.3f} s in sync: less "
        f"than the {margin:.0%} margin saved)"), **figures)


@dataclass
class AutoConfig(AsyncConfig):
    """The ``[trainer]`` settings of ``auto``: those of the overlapping mode it may hand over to
    (:class:`~verl_trainer_async.source.AsyncConfig`), and

    Attributes:
        auto_steps: sync steps measured before the choice, after the process's first step (a warm-up, not
            counted). The choice comes after step ``auto_steps + 1`` of a fresh run.
    """

    auto_steps: int = 3

    def validate(self) -> None:
        super().validate()
        if self.auto_steps < 1:
            raise ConfigError("auto_steps", f"must be >= 1 measured sync step, got {self.auto_steps}")
        if self.producer != "process":
            raise ConfigError("producer", "trainer.mode='auto' measures the sync step on all of run.threads and "
                                          "hands over to a producer in a process of its own (the default, "
                                          "'process'); for a thread producer set trainer.mode='colocate_async'")

    def overlapped(self) -> AsyncConfig:
        """The settings of the overlapping mode it hands over to."""
        return AsyncConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(AsyncConfig)})


class _StepFigures:
    """The trainer's hook that hands each step's metrics to the source (registered on its plugin manager)."""

    def __init__(self, source: "AutoSource") -> None:
        self.source = source

    @hookimpl
    def verl_step_end(self, step: int, metrics: dict[str, float]) -> None:
        self.source.observe(step, metrics)


class AutoSource(StepSource):
    """Sync steps, measured; then sync for good, or an :class:`AsyncSource` from the next step (see the module)."""

    Config = AutoConfig

    @classmethod
    def defaults(cls, raw: Mapping[str, Any], registry: Any) -> tuple[dict[str, dict[str, Any]], str]:
        """The overlapping modes' (stale samples weighed by ``algorithm.rollout_is_cap``) from the first step
        on, so the algorithm is the same before and after a hand-over (on-policy the weights are 1)."""
        return AsyncSource.defaults(raw, registry)

    def __init__(self, config: AutoConfig, *, trainer: Any,
                 resumed: tuple[Path, Mapping[str, Any]] | None = None) -> None:
        super().__init__(config, trainer=trainer, resumed=resumed)
        sync_cls = trainer.registry.load("step_source", "sync")
        self.sync: StepSource = sync_cls(sync_cls.Config(), trainer=trainer)
        #: The overlapping source, once handed over to.
        self.overlapped: AsyncSource | None = None
        #: ``[step, rollout seconds, step seconds]`` of each measured sync step.
        self.figures: list[list[float]] = []
        self.choice: AutoChoice | None = None
        self._warmed = False  # this process's first step is not measured
        self._announce: dict[str, float] = {}
        self._handover_sampler: dict[str, Any] | None = None
        saved = (resumed[1].get("auto") or {}) if resumed is not None else {}
        self.figures = [list(f) for f in saved.get("figures", [])]
        if saved.get("choice"):
            self.choice = AutoChoice(**saved["choice"])
            logger.warning("trainer.mode=auto keeps the choice of the run it resumes: %s", self.choice.line())
            if self.choice.mode != "sync":
                self.overlapped = AsyncSource(config.overlapped(), trainer=trainer, resumed=resumed,
                                              mode=self.choice.mode)
        self._hook = _StepFigures(self)
        trainer.hooks.register(self._hook)

    @property
    def _current(self) -> StepSource:
        return self.overlapped if self.overlapped is not None else self.sync

    def start(self) -> None:
        self._current.start()

    def next(self, step: int) -> SourcedStep:
        sourced = self._current.next(step)
        if self._announce:
            sourced.metrics.update(self._announce)
            self._announce = {}
        return sourced

    def after_update(self, step: int) -> None:
        self._current.after_update(step)

    # -------------------------------------------------------------------- measuring and choosing
    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        """Step ``step`` ended with ``metrics``: a measured sync step, and the choice after the last one."""
        if self.choice is not None:
            return
        if not self._warmed:
            self._warmed = True
            return
        rollout = float(metrics.get("timing/rollout", 0.0))
        self.figures.append([float(step), rollout, float(metrics.get("timing/step", rollout))])
        if len(self.figures) < self.config.auto_steps:
            return
        self.choice = self._choose()
        logger.warning("%s", self.choice.line())
        self._announce = self.choice.metrics()
        if self.choice.mode != "sync" and step < self.trainer.max_steps:
            self._hand_over()

    def _choose(self) -> AutoChoice:
        t = self.trainer
        generate = statistics.median(f[1] for f in self.figures)
        update = max(0.0, statistics.median(f[2] - f[1] for f in self.figures))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        producer_threads = _producer_threads(self.config, t.run_threads)
        if not t.rollout.shares_actor_weights:  # the run's engine generates in processes of its own, as in sync
            producer_threads = t.run_threads
        mode, problem = self._overlap_mode()
        if mode is None:
            return AutoChoice(mode="sync", generate_s=generate, update_s=update, cores=cores,
                              trainer_threads=t.run_threads, producer_threads=producer_threads, predicted_s=0.0,
                              reason=f"sync ({problem})")
        return pick_mode(generate, update, cores=cores, trainer_threads=t.run_threads,
                         producer_threads=producer_threads, overlap_mode=mode)

    def _overlap_mode(self) -> tuple[str | None, str]:
        """The overlapping mode this run could hand over to, or None and why none."""
        t = self.trainer
        cfg = t.config
        if self.config.max_staleness == 0:
            return None, "trainer.max_staleness = 0 overlaps nothing"
        problems = []
        for mode in ("colocate_async", "separate_async"):
            try:
                AsyncSource.check(self.config.overlapped(), mode=mode, algorithm=cfg.algorithm.name,
                                  generates=t.dataflow.rollout_request is not None,
                                  off_policy=t.algorithm.requirements().off_policy,
                                  executor=t.registry.load("executor", cfg.executor.name),
                                  executor_config=cfg.executor.config)
            except ConfigError as exc:
                problems.append(str(exc))
                continue
            return mode, ""
        return None, "no overlapping mode can run here: " + "; ".join(dict.fromkeys(problems))

    def _hand_over(self) -> None:
        """From the next step on, the overlapping source: built as a resume from this step would build it."""
        t = self.trainer
        # A checkpoint of this step records the sampler here, not where the producer's first draws take it.
        self._handover_sampler = dict(t.sampler.state_dict())
        self.sync.close()
        self.overlapped = AsyncSource(self.config.overlapped(), trainer=t, resumed=None, mode=self.choice.mode)
        self.overlapped.start()

    # -------------------------------------------------------------------- checkpoints and the rest
    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        with self._current.validation():
            yield

    def checkpoint_state(self) -> dict[str, Any]:
        state = dict(self._current.checkpoint_state())
        if self.overlapped is not None and "sampler" not in state and self._handover_sampler is not None:
            state["sampler"] = self._handover_sampler  # nothing trained from the producer yet
        state["auto"] = {"figures": self.figures,
                         "choice": dataclasses.asdict(self.choice) if self.choice is not None else None}
        return state

    def write_checkpoint(self, directory: Path) -> None:
        self._current.write_checkpoint(directory)

    def close(self) -> None:
        hooks = getattr(self.trainer, "hooks", None)
        if self._hook is not None and hooks is not None and hooks.is_registered(self._hook):
            hooks.unregister(self._hook)
        self._hook = None
        if self.overlapped is not None:
            self.overlapped.close()
        self.sync.close()
