"""``trainer.mode = "auto"``: sync, or an overlapping mode where the first steps show that it pays (issue 33).

The run starts synchronously (the core's ``sync`` source). After the first step of the process (a warm-up,
left out), ``trainer.auto_steps`` steps are measured: the rollout stage (``timing/rollout``: generation and
scoring, what a producer would take over) against the rest of the step (``timing/step`` minus it: log-probs,
update, weight sync, which the trainer keeps). :func:`pick_mode` then decides from those medians and the
machine's cores. Overlapping, the source hands over to ``colocate_async`` (``separate_async`` where the
executor places only that one) from the next step on, as a resume from that step's checkpoint would: the
same weights, the sampler where the sync steps left it, so no prompt is trained twice or lost.

Where the two sides would share cores, no prediction holds: sharing slowed the 0.5M-parameter job's steps
1.2-2.2x (bench/results/auto_mode.md), while at the 0.5B shape on the same 2 cores the overlapped step took
~40 s against ~71 s in sync (generation is memory-bound and barely slower on the producer's one thread;
bench/results/real_shape.json). There ``auto`` measures instead: a TRIAL hands over as above, leaves the
first overlapped step out (the producer's start-up), measures ``auto_steps`` overlapped steps and compares
their median ``timing/step`` with the measured sync steps' (:func:`judge_trial`). At least
``trainer.auto_trial_margin`` under sync, the overlapping mode stays for good; otherwise the run HANDS BACK
to sync: the producer is closed, the trainer's sampler goes back to where the prompts of the last
overlapped step left it (the producer's buffered and in-flight batches are dropped, and sync draws their
prompts again), so no prompt is trained twice or lost here either.

The choice is logged as one line (a trial: one when it starts, one with its outcome), added to the next
step's metrics (``auto/*``) and kept in every later checkpoint (``trainer_state.json``'s ``"auto"``), so a
resumed run goes on in the mode it picked, never in another one chosen from other figures. A checkpoint
taken during a trial keeps the trial (its sync figures and the overlapped steps measured so far); a run
resumed from it goes on in the overlapping mode (the buffered batches restored as in that mode's own
resume), leaves its own first overlapped step out, and finishes the trial from the saved figures.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from verl_core import hookimpl
from verl_core.contracts import ConfigError, SourcedStep, StepSource
from verl_core.kit import sync_rollout_weights
from verl_trainer_async.source import AsyncConfig, AsyncSource, _producer_threads

__all__ = ["AUTO_MARGIN", "AUTO_TRIAL_MARGIN", "AutoChoice", "AutoConfig", "AutoSource", "SPARE_CORES",
           "judge_trial", "pick_mode"]

logger = logging.getLogger(__name__)

#: Share of the sync step that the predicted overlapped step must save before ``auto`` overlaps: on the small
#: job the per-round speed ratios of two modes spread by 10-30% on a shared 2-core machine
#: (bench/results/trl_comparison_async_small.md, bench/results/auto_mode.md), so a smaller predicted gain
#: is within noise, and sync (no stale samples, no second copy of the weights) keeps the run.
AUTO_MARGIN = 0.2
#: Share of the measured sync step that a trial's measured overlapped step must save to keep the overlap
#: (``trainer.auto_trial_margin``; :func:`judge_trial`). Smaller than AUTO_MARGIN: that one also covers a
#: prediction that can be off (generation does not scale with threads as the model assumes, sharing cores
#: is not modelled at all), and the spread between separate runs. A trial compares steps measured in the
#: same process, a few steps apart, so only their step-to-step noise remains; 10% keeps sync where the
#: overlap wins by little (on the small job the shared-core overlap went 4-20% ahead in some rounds and
#: behind in others, bench/results/auto_mode.md) and the overlap where it wins clearly (0.5B shape on 2
#: cores: ~40 s against ~71 s, 44% under). A gain that small is not worth what the step time leaves out:
#: one-step-stale samples and a second copy of the weights.
AUTO_TRIAL_MARGIN = 0.1
#: Cores the two sides need besides their torch threads: the trainer's process dispatches, scores and copies
#: the weights out in Python, and the producer's loads them and ships its batches back, outside torch's
#: thread pool. Without them the two sides share cores, and whether the overlap pays is not predictable:
#: on 2 cores, one trainer thread next to one producer thread ran the small job's update 1.5-3x slower than
#: sync does and its step 1.2-2.2x longer (bench/results/auto_mode.md; issue 33 measured 0.036 s against
#: 0.019 s), while the 0.5B shape's overlapped step took ~40 s against ~71 s in sync. With fewer cores than
#: the two sides need, ``auto`` therefore runs a measured trial (:func:`judge_trial`) instead of predicting.
SPARE_CORES = 1
#: Seconds a hand-back waits for a producer batch still generating on the run's engine (after the producer's own
#: 30 s): past them the engine is taken as stuck and the run stops with an error rather than race it.
_HAND_BACK_WAIT_S = 600.0


def _secs(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds < 10 else f"{seconds:.1f} s"


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` picked, and the figures it picked it from.

    Attributes:
        mode: ``"sync"``, ``"colocate_async"`` or ``"separate_async"`` (during a trial: the mode tried).
        generate_s: the sync step's rollout stage (median over the measured steps, seconds).
        update_s: the rest of the sync step (median, seconds).
        cores: the CPU cores this process may run on.
        trainer_threads: the trainer's torch threads (``run.threads``).
        producer_threads: the producer's (``trainer.producer_threads``).
        predicted_s: the overlapped step the figures predict (seconds; 0 where no overlap was possible).
        reason: why, in words.
        trial: the figures cannot decide (the two sides would share cores): a measured trial of ``mode`` is
            under way (:func:`judge_trial` turns it into the final choice).
        sync_step_s: a trial's yardstick, the measured sync steps' median ``timing/step`` (seconds).
        trial_step_s: the trial's measured overlapped steps' median ``timing/step`` (seconds; 0: no trial).
        trial_steps: how many overlapped steps the trial measured (0: the choice was predicted).
    """

    mode: str
    generate_s: float
    update_s: float
    cores: int
    trainer_threads: int
    producer_threads: int
    predicted_s: float
    reason: str
    trial: bool = False
    sync_step_s: float = 0.0
    trial_step_s: float = 0.0
    trial_steps: int = 0

    def line(self) -> str:
        """The one line the run logs."""
        if self.trial_steps:
            steps = f"{self.trial_steps} step{'s' if self.trial_steps != 1 else ''}"
            return (f"trainer.mode=auto picked {self.mode}: measured {_secs(self.trial_step_s)} overlapped against "
                    f"{_secs(self.sync_step_s)} sync on {self.cores} cores shared (trial of {steps}) -> "
                    f"{self.reason}")
        verb = "tries" if self.trial else "picked"
        return (f"trainer.mode=auto {verb} {self.mode}: generation {self.generate_s:.3f} s, update "
                f"{self.update_s:.3f} s per step, {self.cores} cores -> {self.reason}")

    def metrics(self) -> dict[str, float]:
        out = {"auto/generate_s": self.generate_s, "auto/update_s": self.update_s, "auto/cores": float(self.cores),
               "auto/predicted_step_s": self.predicted_s}
        if self.trial:  # auto/overlapped comes with the final choice only
            out.update({"auto/trial": 1.0, "auto/sync_step_s": self.sync_step_s})
        else:
            out["auto/overlapped"] = float(self.mode != "sync")
        if self.trial_steps:
            out.update({"auto/sync_step_s": self.sync_step_s, "auto/trial_step_s": self.trial_step_s,
                        "auto/trial_steps": float(self.trial_steps)})
        return out


def pick_mode(generate_s: float, update_s: float, *, cores: int, trainer_threads: int, producer_threads: int,
              overlap_mode: str = "colocate_async", margin: float = AUTO_MARGIN,
              spare_cores: int = SPARE_CORES) -> AutoChoice:
    """Sync, ``overlap_mode``, or a trial of it, for a run whose sync step generates for ``generate_s`` and
    updates for ``update_s`` seconds on ``trainer_threads`` torch threads, on a machine of ``cores`` cores.

    * Both sides at once need ``trainer_threads + producer_threads + spare_cores`` cores
      (:data:`SPARE_CORES`). With fewer, they share cores, and no prediction holds (sharing slowed the small
      job's steps 1.2-2.2x; the 0.5B shape's overlapped step still took 40 s against 71 s): the choice is a
      ``trial`` of ``overlap_mode``, which measured steps decide (:func:`judge_trial`).
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
        return AutoChoice(mode=overlap_mode, trial=True, reason=(
            f"a trial (overlapped, the trainer and a producer need {need} cores, {threads} and {spare_cores} for "
            f"their Python work, and would share {cores}: whether the overlap saves more than sharing costs is "
            f"measured, not predicted)"), **figures)
    if sync_s > 0 and predicted <= (1.0 - margin) * sync_s:
        return AutoChoice(mode=overlap_mode, reason=(
            f"{overlap_mode} (overlapped step predicted {predicted:.3f} s on {threads}, {1 - predicted / sync_s:.0%} "
            f"under the sync step's {sync_s:.3f} s, more than the {margin:.0%} margin)"), **figures)
    return AutoChoice(mode="sync", reason=(
        f"sync (overlapped step predicted {predicted:.3f} s on {threads} against {sync_s:.3f} s in sync: less "
        f"than the {margin:.0%} margin saved)"), **figures)


def judge_trial(tried: AutoChoice, *, sync_step_s: float, trial_step_s: float, trial_steps: int,
                margin: float = AUTO_TRIAL_MARGIN) -> AutoChoice:
    """The final choice after a trial of ``tried.mode``: kept where the overlapped steps' median
    (``trial_step_s``, over ``trial_steps`` steps) is at least ``margin`` (:data:`AUTO_TRIAL_MARGIN`) under the
    sync steps' (``sync_step_s``), sync otherwise (the run hands back)."""
    saved = 1.0 - trial_step_s / sync_step_s if sync_step_s > 0 else 0.0
    gain = f"{saved:.0%} under sync" if saved >= 0 else f"{-saved:.0%} over sync"
    if sync_step_s > 0 and trial_step_s <= (1.0 - margin) * sync_step_s:
        mode, reason = tried.mode, f"{tried.mode} ({gain}, at least the {margin:.0%} margin)"
    else:
        mode, reason = "sync", f"sync ({tried.mode} {gain}, not the {margin:.0%} margin: handed back)"
    return dataclasses.replace(tried, mode=mode, reason=reason, trial=False, sync_step_s=sync_step_s,
                               trial_step_s=trial_step_s, trial_steps=trial_steps)


@dataclass
class AutoConfig(AsyncConfig):
    """The ``[trainer]`` settings of ``auto``: those of the overlapping mode it may hand over to
    (:class:`~verl_trainer_async.source.AsyncConfig`), and

    Attributes:
        auto_steps: sync steps measured before the choice, after the process's first step (a warm-up, not
            counted). The choice comes after step ``auto_steps + 1`` of a fresh run. Where the two sides would
            share cores, a trial then measures as many overlapped steps, after the producer's first: its
            outcome comes after step ``2 * auto_steps + 2``.
        auto_trial_margin: share of the measured sync step the trial's overlapped step must save to keep the
            overlap (:data:`AUTO_TRIAL_MARGIN`, 0.1); below 1. A negative one keeps an overlap up to that share
            slower than sync; one close to 1 hands back whatever was measured.
    """

    auto_steps: int = 3
    auto_trial_margin: float = AUTO_TRIAL_MARGIN

    def validate(self) -> None:
        super().validate()
        if self.auto_steps < 1:
            raise ConfigError("auto_steps", f"must be >= 1 measured sync step, got {self.auto_steps}")
        if not self.auto_trial_margin < 1.0:  # NaN too
            raise ConfigError("auto_trial_margin", f"must be below 1 (the share of the sync step an overlapped "
                                                   f"step must save; 1 would ask for a step of 0 s), got "
                                                   f"{self.auto_trial_margin}")
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
    """Sync steps, measured; then sync for good, an :class:`AsyncSource` from the next step, or a trial of one
    that keeps it or hands back to sync (see the module)."""

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
        #: ``[step, step seconds]`` of each overlapped step a trial measured.
        self.trial: list[list[float]] = []
        self.choice: AutoChoice | None = None
        self._warmed = False  # this process's first step is not measured
        self._trial_warmed = False  # nor its first overlapped step (the producer starts)
        self._announce: dict[str, float] = {}
        self._handover_sampler: dict[str, Any] | None = None
        saved = (resumed[1].get("auto") or {}) if resumed is not None else {}
        self.figures = [list(f) for f in saved.get("figures", [])]
        self.trial = [list(f) for f in saved.get("trial", [])]
        if saved.get("choice"):
            self.choice = AutoChoice(**saved["choice"])
            if self.choice.trial:
                logger.warning("trainer.mode=auto goes on with the trial of the run it resumes (%d of %d overlapped "
                               "steps measured): %s", len(self.trial), config.auto_steps, self.choice.line())
            else:
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
        """Step ``step`` ended with ``metrics``: a measured sync step, and the choice after the last one; or a
        trial's overlapped step, and its outcome after the last one."""
        if self.choice is not None:
            if self.choice.trial and self.overlapped is not None:
                self._observe_trial(step, metrics)
            return
        if not self._warmed:
            self._warmed = True
            return
        rollout = float(metrics.get("timing/rollout", 0.0))
        self.figures.append([float(step), rollout, float(metrics.get("timing/step", rollout))])
        if len(self.figures) < self.config.auto_steps:
            return
        self.choice = self._choose()
        line = self.choice.line()
        if self.choice.trial:
            n, margin = self.config.auto_steps, self.config.auto_trial_margin
            line += (f"; measuring {n} overlapped step{'s' if n != 1 else ''} after the producer's first, kept "
                     f"where at least {margin:.0%} under sync's {_secs(self.choice.sync_step_s)}")
        logger.warning("%s", line)
        self._announce = self.choice.metrics()
        if self.choice.mode != "sync" and step < self.trainer.max_steps:
            self._hand_over()

    def _observe_trial(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self._trial_warmed:  # this process's first overlapped step: the producer starting
            self._trial_warmed = True
            return
        self.trial.append([float(step), float(metrics.get("timing/step", 0.0))])
        if len(self.trial) < self.config.auto_steps:
            return
        self.choice = judge_trial(self.choice, sync_step_s=self.choice.sync_step_s,
                                  trial_step_s=statistics.median(f[1] for f in self.trial),
                                  trial_steps=len(self.trial), margin=self.config.auto_trial_margin)
        logger.warning("%s", self.choice.line())
        self._announce = self.choice.metrics()
        if self.choice.mode == "sync":
            self._hand_back()

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
        choice = pick_mode(generate, update, cores=cores, trainer_threads=t.run_threads,
                           producer_threads=producer_threads, overlap_mode=mode, spare_cores=SPARE_CORES)
        if choice.trial and not t.rollout.shares_actor_weights and t.actor.lora_adapter() is not None:
            # The producer loads full (merged) weights into the run's engine; after a hand-back, sync would lay
            # the adapter over them, and the policy sampled would hold it twice.
            return dataclasses.replace(choice, mode="sync", trial=False, reason=(
                "sync (no trial: the actor syncs LoRA adapters to an engine with weights of its own, and a trial "
                "that handed back would leave merged weights under the next adapter; backend.lora_sync='merged' "
                "allows the trial)"))
        if choice.trial:  # the yardstick of the trial: the sync steps as measured, whole
            choice = dataclasses.replace(choice, sync_step_s=statistics.median(f[2] for f in self.figures))
        return choice

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

    def _hand_back(self) -> None:
        """A trial that did not pay: sync from the next step on, from the prompts the last overlapped step
        trained on. The producer's buffered and in-flight batches are dropped; sync draws their prompts again."""
        t = self.trainer
        overlapped, self.overlapped = self.overlapped, None
        trained, producer = overlapped.trained, overlapped.producer
        overlapped.close()
        if trained is not None:
            # A copy, set back: a producer thread that outlived close() (it waits 30 s) draws from the old one.
            sampler = copy.copy(t.sampler)
            sampler.load_state_dict(trained.sampler_state)
            t.sampler = sampler
        self._handover_sampler = None
        # An engine the producer generated on holds older weights. A producer thread that outlived close() may
        # still generate on it: its lock waits for that batch, after which the stopped thread leaves the engine.
        if not producer.engine_lock.acquire(timeout=_HAND_BACK_WAIT_S):
            raise RuntimeError(f"trainer.mode=auto: handing back to sync, the producer's last batch was still "
                               f"generating on the run's engine after {_HAND_BACK_WAIT_S:.0f} s; its weights cannot "
                               f"be loaded under it (the engine may be stuck)")
        try:
            sync_rollout_weights(t.rollout, t.actor)
        finally:
            producer.engine_lock.release()
        sync_cls = t.registry.load("step_source", "sync")
        self.sync = sync_cls(sync_cls.Config(), trainer=t)  # the first one was closed at the hand-over
        self.sync.start()

    # -------------------------------------------------------------------- checkpoints and the rest
    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        with self._current.validation():
            yield

    def checkpoint_state(self) -> dict[str, Any]:
        state = dict(self._current.checkpoint_state())
        if self.overlapped is not None and "sampler" not in state and self._handover_sampler is not None:
            state["sampler"] = self._handover_sampler  # nothing trained from the producer yet
        state["auto"] = {"figures": self.figures, "trial": self.trial,
                         "choice": dataclasses.asdict(self.choice) if self.choice is not None else None}
        return state

    def write_checkpoint(self, directory: Path) -> None:
        self._current.write_checkpoint(directory)

    def close(self) -> None:
        hooks = getattr(self.trainer, "hooks", None)
        if self._hook is not None and hooks is not None and hooks.is_registered(self._hook):
            hooks.unregister(self._hook)
        self._hook = None
        if (self.choice is not None and self.choice.trial and self.overlapped is not None
                and self.trainer.step < self.trainer.max_steps):  # at max_steps the trial had no steps left
            logger.warning("trainer.mode=auto: the run stopped during its trial of %s (%d of %d overlapped steps "
                           "measured); a run resumed from its last checkpoint finishes it", self.choice.mode,
                           len(self.trial), self.config.auto_steps)
        if self.overlapped is not None:
            self.overlapped.close()
        self.sync.close()
