"""The overlapping step sources: ``trainer.mode = "colocate_async"`` and ``"separate_async"`` (issue 19).

A producer (:mod:`verl_trainer_async.producer`) runs the run's rollout stage on an engine of its own, one
batch ahead of the trainer, behind a replay buffer bounded by ``trainer.max_staleness``; the trainer takes
its scored batches in order and publishes a copy of the weights after each update.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from verl_core.config import CORE_SECTIONS
from verl_core.contracts import SourcedStep, StepSource, WorldInfo
from verl_core.kit import WeightSyncError, check_log_prob_gap, generate_batch, produce_rollout
from verl_core.contracts import ConfigError
from verl_trainer_async.producer import (BUFFER_FILE, ProducedBatch, RolloutProducer, load_buffer, save_buffer,
                                         snapshot_weights, with_version)

__all__ = ["AsyncConfig", "AsyncSource", "ASYNC_ROLLOUT_IS_CAP", "EngineCheck", "check_engine_sync",
           "check_stale_samples", "generation_device", "stale_sample_defaults"]

#: The truncated importance-sampling cap stale samples are weighed with, unless the algorithm section sets
#: ``rollout_is_cap`` (0 turns it off). Measured in bench/results/async_curves.md: without it, one-step
#: off-policy GRPO on the built-in task ended 9 points below sync over 3 seeds; with it, level.
ASYNC_ROLLOUT_IS_CAP = 2.0
PRODUCER_PLACES = ("process", "thread")
#: The weight-sync check's greedy samples (one per training prompt) and their most tokens: enough for a
#: broken sync to show (bench/results/weight_sync_guard.md), cheap next to a step.
SYNC_CHECK_SAMPLES, SYNC_CHECK_TOKENS = 4, 16


@dataclass
class AsyncConfig:
    """The ``[trainer]`` settings of the overlapping modes.

    Attributes:
        max_staleness: how many weight versions a sample may lag the policy it trains (1: one-step
            off-policy; 0: always the current policy, no overlap). Sample staleness is reported in
            ``async/staleness``; the algorithm's importance-sampling correction (``algorithm.rollout_is_cap``,
            2.0 by default when ``max_staleness > 0``, ``ASYNC_ROLLOUT_IS_CAP``) weighs stale samples.
        on_stale: ``"wait"`` (the producer waits for new enough weights before it generates: nothing
            is ever over the bound) or ``"drop"`` (the producer never waits for weights; batches over the
            bound are thrown away and counted in ``async/dropped_samples``).
        producer: where ``colocate_async``'s producer runs an engine that generates inside the trainer's
            process (the ``hf`` rollout): ``"process"`` (the default: a child process with an engine of its
            own and ``producer_threads`` torch threads, weights synced through shared memory; the trainer
            keeps all of ``run.threads``) or ``"thread"`` (a thread of the trainer's process; both sides
            then share its interpreter lock and its one torch thread pool, ``producer_threads`` threads
            each). Engines that already generate in processes of their own (``vllm``, ``sglang``) are used
            as they are. ``separate_async`` runs the producer on the executor's rollout pool.
        producer_threads: torch threads of the producer (0: half of ``run.threads``, at least one).
        sync_check_every: every this many updates the weight-sync guard (``rollout.max_log_prob_gap``) checks
            the producer's engine: it loads the weights just published and a few greedy samples' log-probs are
            compared with the actor's (:func:`check_engine_sync`). The step's own check sees only batches of
            the current weights, and these modes train older ones. 0: off (a broken sync then trains unseen).
    """

    max_staleness: int = 1
    on_stale: str = "wait"
    producer: str = "process"
    producer_threads: int = 0
    sync_check_every: int = 1

    def validate(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError("max_staleness", f"must be >= 0 weight versions (0: on-policy, 1: one-step "
                                               f"off-policy), got {self.max_staleness}")
        if self.on_stale not in ("wait", "drop"):
            raise ConfigError("on_stale", f"must be 'wait' or 'drop', got {self.on_stale!r}")
        if self.producer not in PRODUCER_PLACES:
            raise ConfigError("producer", f"must be one of {list(PRODUCER_PLACES)}, got {self.producer!r}")
        if self.producer_threads < 0:
            raise ConfigError("producer_threads", "must be >= 0 (0: half of run.threads)")
        if self.sync_check_every < 0:
            raise ConfigError("sync_check_every", "must be >= 0 updates (0: never check the producer's engine)")


def stale_sample_defaults(raw: Mapping[str, Any], registry: Any) -> tuple[dict[str, dict[str, Any]], str]:
    """``algorithm.rollout_is_cap = ASYNC_ROLLOUT_IS_CAP`` for a mode that trains stale samples, unless the user
    set it or takes the rollout's log-probs as the old ones, and the algorithm has the setting."""
    trainer = raw.get("trainer") if isinstance(raw.get("trainer"), Mapping) else {}
    algorithm = raw.get("algorithm") if isinstance(raw.get("algorithm"), Mapping) else {}
    if ("rollout_is_cap" in algorithm or algorithm.get("use_rollout_log_probs") is True
            or algorithm.get("old_log_probs") == "rollout"):  # the engine's log-probs are the old ones: weights of 1
        return {}, ""
    name = algorithm.get("name", CORE_SECTIONS["algorithm"].default)
    config_cls = getattr(registry.load("algorithm", name), "Config", None) if isinstance(name, str) else None
    if config_cls is None or "rollout_is_cap" not in {f.name for f in dataclasses.fields(config_cls)}:
        return {}, ""
    return ({"algorithm": {"rollout_is_cap": ASYNC_ROLLOUT_IS_CAP}},
            f"; trainer.mode={trainer.get('mode')!r} sets algorithm.rollout_is_cap={ASYNC_ROLLOUT_IS_CAP} "
            f"(truncated importance weights for stale samples; algorithm.rollout_is_cap=0 turns them off)")


def check_stale_samples(*, mode: str, algorithm: str, generates: bool, off_policy: bool) -> None:
    """Refuse (``trainer.mode``) an algorithm that generates nothing, or cannot train samples of older weights."""
    if not generates:
        raise ConfigError("trainer.mode", f"algorithm {algorithm!r} generates nothing (its step has no rollout "
                                          f"stage), so {mode!r} has no generation to overlap or carry over; use "
                                          f"trainer.mode='sync'")
    if not off_policy:
        raise ConfigError("trainer.mode", f"{mode!r} trains on samples from older weights, and algorithm "
                                          f"{algorithm!r} cannot (its Requirements.off_policy is false: no "
                                          f"importance ratio); use trainer.mode='sync', or an algorithm with one "
                                          f"(grpo, ppo, dapo)")


def check_engine_sync(trainer: Any, engine: Any, step: int) -> dict[str, float]:
    """The weight-sync guard on an ``engine`` that holds the actor's weights after update ``step`` and generates
    the batches of later steps: greedy samples of the first training prompts, their log-probs against the
    actor's. Over ``rollout.max_log_prob_gap`` it stops the run (:class:`~verl_core.kit.WeightSyncError`,
    naming step ``step + 1``) before a batch of these weights trains; returns the ``rollout/log_prob_diff_*``
    figures (``{}`` where nothing could stop the run: an engine on the actor's own module or one serving fixed
    weights on purpose, or ``rollout.max_log_prob_gap = 0``)."""
    if engine.shares_actor_weights or not engine.follows_actor_weights or not trainer.max_log_prob_gap:
        return {}  # it cannot be out of sync, serves fixed weights on purpose, or the guard is off
    ctx = trainer.step_context(step + 1, trainer.train_rows[:SYNC_CHECK_SAMPLES], rollout=engine)
    sampling = dataclasses.replace(ctx.sampling, n=1, greedy=True,
                                   max_new_tokens=min(ctx.sampling.max_new_tokens, SYNC_CHECK_TOKENS))
    probe = generate_batch(engine, ctx.prompts, sampling, boundary=dataclasses.replace(ctx.boundary, last_version=None),
                           step=ctx.step)
    if probe.rollout_log_probs is None:  # an engine that returns no log-probs cannot be checked
        return {}
    check_log_prob_gap(ctx, trainer.actor.compute_log_probs(probe).log_probs, probe)
    return {k: v for k, v in ctx.metrics.items() if k.startswith("rollout/log_prob_diff")}


class EngineCheck:
    """A step source's :func:`check_engine_sync` every ``every`` updates (``trainer.sync_check_every``; 0: never).

    A failure is held and raised by :meth:`result` when the next step asks for its batch, so the step that ended
    (trained on checked weights) is still reported and saved, and the next one stops before it trains.
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.metrics: dict[str, float] = {}  # the last check's figures, for the next step's metrics
        self.error: Exception | None = None

    def due(self, trainer: Any, step: int, *, starting: bool = False) -> bool:
        """Whether the weights after update ``step`` are checked (at the start: whatever ``every`` divides)."""
        return bool(self.every) and step < trainer.max_steps and (starting or step % self.every == 0)

    def run(self, trainer: Any, engine: Any, step: int) -> None:
        try:
            self.metrics = check_engine_sync(trainer, engine, step)
        except (WeightSyncError, FloatingPointError) as exc:
            self.error = exc

    def result(self) -> dict[str, float]:
        """The last check's figures, once; its failure raised instead."""
        if self.error is not None:
            raise self.error
        metrics, self.metrics = self.metrics, {}
        return metrics


def generation_device(engine: Any) -> str:
    """The device an engine that shares the actor's weights generates on: that of the actor's module."""
    with engine.actor.generation_module() as module:
        param = next(module.parameters(), None)
    return "cpu" if param is None or param.device.type == "meta" else str(param.device)


def _producer_threads(config: AsyncConfig, threads: int) -> int:
    return config.producer_threads or max(1, threads // 2)


def _trainer_mode_problem(executor: Any, mode: str) -> str | None:
    """Why ``executor`` cannot place the producer of ``mode``, for an executor that does not say itself.

    An executor answers with a classmethod ``trainer_mode_problem(config, mode)`` (the Ray executor's). The
    overlapping modes run a producer thread in the controller: ``colocate_async`` gives it an engine in the
    controller's process, which an in-process executor can; ``separate_async`` needs a rollout pool on
    processes of its own, which such an executor cannot place.
    """
    if mode == "separate_async":
        return (f"'separate_async' needs a rollout pool on processes of its own, which the {executor.__name__} "
                f"cannot place; use trainer.mode='colocate_async', or executor.name='ray' with "
                f"executor.pools={{gen=1}} and executor.placement={{rollout='gen'}}")
    return None


class AsyncSource(StepSource):
    """Batches from a producer that generates ahead of the trainer (see the module)."""

    Config = AsyncConfig

    # -------------------------------------------------------------------- before anything loads
    @classmethod
    def check(cls, config: AsyncConfig, *, mode: str, algorithm: str, generates: bool, off_policy: bool,
              executor: Any, executor_config: Any) -> None:
        check_stale_samples(mode=mode, algorithm=algorithm, generates=generates, off_policy=off_policy)
        ask = getattr(executor, "trainer_mode_problem", None)
        problem = ask(executor_config, mode) if ask else _trainer_mode_problem(executor, mode)
        if problem:
            raise ConfigError("trainer.mode", problem)

    @classmethod
    def torch_threads(cls, config: AsyncConfig, threads: int) -> int:
        # A thread producer shares this process's one torch thread pool: both sides run with its share. A
        # child process has threads of its own on top of the trainer's: the producer waits for weights part of
        # each step and the update is usually the longer side, so the trainer keeps all of run.threads
        # (bench/results/trl_comparison_async.md measures it).
        return _producer_threads(config, threads) if config.producer == "thread" else threads

    @classmethod
    def defaults(cls, raw: Mapping[str, Any], registry: Any) -> tuple[dict[str, dict[str, Any]], str]:
        """With stale samples allowed, the algorithm's importance-sampling correction is on
        (``ASYNC_ROLLOUT_IS_CAP``) unless the user set it, or reuses the rollout's log-probs."""
        trainer = raw.get("trainer") if isinstance(raw.get("trainer"), Mapping) else {}
        try:
            stale = int(trainer.get("max_staleness", AsyncConfig.max_staleness)) > 0
        except (TypeError, ValueError):  # the section's own check names the bad value
            return {}, ""
        return stale_sample_defaults(raw, registry) if stale else ({}, "")

    # -------------------------------------------------------------------- the run
    def __init__(self, config: AsyncConfig, *, trainer: Any,
                 resumed: tuple[Path, Mapping[str, Any]] | None = None, mode: str | None = None) -> None:
        super().__init__(config, trainer=trainer, resumed=resumed)
        #: The mode this source runs: ``trainer.mode``, or the one ``auto`` handed over to (:mod:`.auto`).
        self.mode = mode or trainer.config.trainer.name
        buffered: list[ProducedBatch] = []
        drops = (0, 0)
        if resumed is not None and resumed[1].get("async"):
            # The batches that waited in the buffer train as they were; the sampler goes on after them, so
            # the prompts that were in flight are drawn (and generated) again.
            ckpt, state = resumed
            buffered = load_buffer(ckpt / BUFFER_FILE)
            drops = (int(state["async"].get("dropped_samples", 0)), int(state["async"].get("dropped_batches", 0)))
            if buffered:
                trainer.sampler.load_state_dict(buffered[-1].sampler_state)
        #: The producer's batch the last step trained on.
        self.trained: ProducedBatch | None = None
        self._pending: list[ProducedBatch] = []
        self.engine_check = EngineCheck(config.sync_check_every)  # the producer's engine, after each update
        self.producer = self._make_producer(buffered)
        # async/dropped_* count over the whole run, across resumes.
        self.producer.dropped_samples, self.producer.dropped_batches = drops

    def _make_producer(self, buffered: list[ProducedBatch]) -> RolloutProducer:
        """The producer, on an engine with weights of its own."""
        t = self.trainer
        cfg = t.config
        engine = t.rollout
        threads = _producer_threads(self.config, t.run_threads)
        if engine.shares_actor_weights:
            # The run's engine samples from the actor's live module, which each update changes in place:
            # the producer gets its own copy of the weights, kept in step by the published versions.
            engine_cls = t.registry.load("rollout", cfg.rollout.name)
            # On the device the run's engine generates on: a CUDA trainer's copy left on the CPU would
            # generate there, silently and many times slower.
            world = WorldInfo(device=generation_device(engine))
            if self.mode == "colocate_async" and self.config.producer == "process":
                from verl_trainer_async.engine_host import HostedEngine

                # Its own process, so that generation and the update really run at once (trainer.producer).
                engine = HostedEngine(engine_cls, config=cfg.rollout.config, model=t.model_spec,
                                      tokenizer=t.tokenizer, threads=threads, world=world)
            else:
                spec = t.model_spec
                if spec.module is not None:
                    spec = dataclasses.replace(spec, module=copy.deepcopy(spec.module))
                engine = engine_cls(config=cfg.rollout.config, model=spec, tokenizer=t.tokenizer, world=world)
        request = t.dataflow.rollout_request
        boundary = t.boundary

        def produce(seq: int, prompts: list[dict[str, Any]], draw: Any) -> tuple[Any, dict[str, float]]:
            # The producer's engine reports weight versions of its own; it trains nothing (actor=None).
            ctx = t.step_context(seq, prompts, rollout=engine, actor=None, draw_prompts=draw, boundary=boundary)
            return produce_rollout(ctx, request), ctx.metrics

        self._threads = threads
        producer = RolloutProducer(engine=engine, produce=produce, sampler=t.sampler, rows=t.train_rows,
                                   max_staleness=self.config.max_staleness, on_stale=self.config.on_stale,
                                   next_seq=buffered[-1].seq + 1 if buffered else t.step + 1,
                                   base_version=t.step, last_seq=t.max_steps, stamp=with_version)
        producer.restore(buffered)
        return producer

    def _snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """A copy of the actor's weights to publish: in shared memory where the producer's engine maps it
        from there (:meth:`~verl_trainer_async.engine_host.HostedEngine.snapshot`), a plain clone otherwise."""
        own = getattr(self.producer.engine, "snapshot", None)
        return own(self.trainer.actor) if own else snapshot_weights(self.trainer.actor)

    def start(self) -> None:
        t = self.trainer
        self.producer.publish(t.step, self._snapshot())
        if self.engine_check.due(t, t.step, starting=True):  # the weights the first batch comes from
            self.producer.load_newest()  # the producer has not started: the engine is this thread's
            self.engine_check.run(t, self.producer.engine, t.step)
        self.producer.start(torch.get_num_threads())

    def next(self, step: int) -> SourcedStep:
        checked = self.engine_check.result()
        producer = self.producer
        waited = time.perf_counter()
        item, staleness = producer.take(step)
        waited = time.perf_counter() - waited
        self.trained = item
        metrics = dict(item.metrics)
        metrics.update({"async/staleness": float(staleness), "async/weight_version": float(item.version),
                        "async/wait_for_batch_s": waited, "async/dropped_samples": float(producer.dropped_samples),
                        "async/dropped_batches": float(producer.dropped_batches),
                        "async/producer_wait_s": producer.producer_wait_s, **checked})
        rows = self.trainer.train_rows
        batch_size = self.trainer.config.data.batch_size
        return SourcedStep(prompts=[rows[i] for i in item.prompt_indices[:batch_size]],
                           indices=list(item.prompt_indices), produced=item.batch, staleness=staleness,
                           epoch=float(item.sampler_state["epoch"]), metrics=metrics)

    def after_update(self, step: int) -> None:
        # A copy of the new weights, which the producer loads between batches.
        self.producer.publish(step, self._snapshot())
        if self.engine_check.due(self.trainer, step):
            # Between two producer batches, on the weights just published: the ones the next batches come from.
            with self.producer.engine_first():
                self.producer.load_newest()
                self.engine_check.run(self.trainer, self.producer.engine, step)

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        with self.producer.engine_first():  # between two producer batches: the reward stage is the producer's too
            if self.producer.engine is self.trainer.rollout:  # it samples on this engine: the newest weights
                self.producer.load_newest()
            yield

    def checkpoint_state(self) -> dict[str, Any]:
        """The buffered batches and what a checkpoint records of the producer (see :mod:`.producer`)."""
        items, in_flight = self.producer.pending(finish_older_than=self.trainer.step)
        self._pending = items
        state: dict[str, Any] = {"async": {
            "mode": self.mode, "in_flight": in_flight,
            "buffered": [{"seq": i.seq, "version": i.version, "prompt_indices": i.prompt_indices} for i in items],
            "dropped_samples": self.producer.dropped_samples, "dropped_batches": self.producer.dropped_batches}}
        if self.trained is not None:  # the sampler as it was after the prompts this step trained
            state["sampler"] = self.trained.sampler_state
        return state

    def write_checkpoint(self, directory: Path) -> None:
        if self._pending:
            save_buffer(self._pending, directory / BUFFER_FILE)

    def close(self) -> None:
        producer, self.producer = self.producer, None
        if producer is None:
            return
        producer.stop()
        if producer.engine is not self.trainer.rollout:  # its own engine (a child process, or a copy):
            producer.engine.close()  # a child still generating is stopped, not waited for
        producer.close()
