"""Overlapping generation and training: a producer thread, a replay buffer between it and the trainer,
and weight versions on every batch (``trainer.mode = "colocate_async" | "separate_async"``, issue 19).

The producer runs the same rollout stage the synchronous step runs (:func:`verl_core.rollout_stage.produce`:
generate, score, filter, greedy baseline) on an engine of its own, one batch after the other, and puts each
scored batch in the buffer; the trainer takes them in order and runs the rest of the dataflow. Batch ``s``
(the one step ``s`` trains) comes from weight version ``v`` (the policy after ``v`` updates); its staleness
is ``s - 1 - v``, at most ``trainer.max_staleness``:

* ``on_stale = "wait"``: the producer generates batch ``s`` with exactly version ``max(0, s - 1 - k)`` and
  waits for it to be published, so the schedule, and with seeded sampling the run, is deterministic
  (``k = 1`` is one-step off-policy: step ``s + 1``'s batch is generated while step ``s`` trains);
* ``on_stale = "drop"``: the producer never waits for weights (it takes the newest published ones), and
  the trainer throws away batches over the bound (``async/dropped_samples``).

The trainer publishes a copy of its weights after each update (the sync); the producer loads it between
batches, so a sync never stalls the trainer longer than the copy.

Lossless resume: every batch records the sampler's position after its prompts were drawn. A checkpoint
stores the batches already in the buffer (their samples, ``rollout_buffer.pt``), names the prompts still
being generated, and keeps the sampler at the position after the last stored batch, so a resumed run
draws the in-flight prompts again and trains on every prompt once, in the uninterrupted run's order.
In ``wait`` mode the checkpoint first lets the producer finish the batches whose weight version is older
than the checkpoint's (they could not be regenerated from it); a resumed run is then the uninterrupted one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from verl_core.batch import Batch

__all__ = ["BUFFER_FILE", "ProducedBatch", "RolloutProducer", "load_buffer", "save_buffer", "snapshot_weights",
           "with_version"]

logger = logging.getLogger(__name__)

#: The checkpoint file holding the produced batches that were waiting in the buffer.
BUFFER_FILE = "rollout_buffer.pt"
# How often blocking waits wake up to notice a stop, a producer failure or Ctrl-C.
_POLL_S = 0.2


@dataclass
class ProducedBatch:
    """One scored batch in the replay buffer.

    Attributes:
        seq: its place in the production order (in ``wait`` mode, the step that trains it).
        version: the weight version that generated it (trainer updates before those weights).
        prompt_indices: the training prompts drawn for it (dynamic sampling's extra draws included).
        sampler_state: the prompt sampler's state after those draws.
        batch: the scored batch, as the rollout stage returns it.
        metrics: the rollout stage's metrics (generation and reward timings, reward statistics).
        started, finished: ``time.perf_counter()`` when its generation began and ended (for timelines).
    """

    seq: int
    version: int
    prompt_indices: list[int]
    sampler_state: dict[str, int]
    batch: Batch
    metrics: dict[str, float]
    started: float = 0.0
    finished: float = 0.0

    def to_state(self) -> dict[str, Any]:
        return {"seq": self.seq, "version": self.version, "prompt_indices": self.prompt_indices,
                "sampler_state": self.sampler_state, "batch": self.batch, "metrics": self.metrics}


def snapshot_weights(actor: Any) -> list[tuple[str, torch.Tensor]]:
    """A copy of the actor's full weights, safe to read while the actor keeps training."""
    return [(name, tensor.detach().clone()) for name, tensor in actor.iter_weights()]


@dataclass
class _Published:
    version: int
    weights: list[tuple[str, torch.Tensor]]


@dataclass
class _State:
    buffer: list[ProducedBatch] = field(default_factory=list)
    snapshots: dict[int, list[tuple[str, torch.Tensor]]] = field(default_factory=dict)
    latest: int = -1
    in_flight: list[int] | None = None
    in_flight_seq: int = 0
    error: BaseException | None = None
    stopped: bool = False


class RolloutProducer:
    """Generates scored batches ahead of the trainer on a thread of its own (see the module docstring).

    Args:
        engine: the rollout engine the producer samples with (its own weights; loaded from published versions).
        produce: ``produce(seq, prompts, draw) -> (batch, metrics)``: the rollout stage for batch ``seq`` on
            ``prompts`` (``draw()`` gives more prompt rows, for dynamic sampling).
        sampler: the run's prompt sampler (the producer alone draws from it while it runs).
        rows: the training prompt rows the sampler's indices point into.
        max_staleness, on_stale: ``trainer.max_staleness`` and ``trainer.on_stale``.
        next_seq: the first batch to produce (the step after the one resumed from, plus restored batches).
        base_version: the oldest version that will be published (the resumed step's): older ones are
            replaced by it.
        last_seq: the last batch to produce in ``wait`` mode (the run's last step); None: until closed.
        stamp: ``stamp(batch, version)`` marks a produced batch with its weight version (:func:`with_version`).
        engine_lock: held while the engine generates or loads weights (validation shares it).
    """

    def __init__(self, *, engine: Any, produce: Callable[[int, list[dict[str, Any]], Callable[[], list]], tuple],
                 sampler: Any, rows: Sequence[dict[str, Any]], max_staleness: int, on_stale: str, next_seq: int,
                 base_version: int, last_seq: int | None = None, engine_lock: threading.Lock | None = None,
                 stamp: Callable[[Batch, int], Batch] | None = None) -> None:
        self.engine = engine
        self._produce = produce
        self.sampler = sampler
        self.rows = rows
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self.next_seq = next_seq
        self.base_version = base_version
        self.last_seq = last_seq
        self._stamp = stamp or with_version
        self.engine_lock = engine_lock or threading.Lock()
        #: The version the engine holds (-1: none loaded yet; validation may load the newest).
        self.engine_version = -1
        self.dropped_samples = 0
        self.dropped_batches = 0
        self.producer_wait_s = 0.0
        self._state = _State()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._trainer_waits = 0  # the trainer asked for the engine (engine_first): the producer lets it go first

    # ------------------------------------------------------------------ trainer side
    def restore(self, items: Sequence[ProducedBatch]) -> None:
        """Put batches saved in a checkpoint back in the buffer (before :meth:`start`)."""
        with self._cond:
            self._state.buffer.extend(items)

    def start(self, threads: int) -> None:
        """Start the producer thread (torch threads: ``threads``, see ``trainer.producer_threads``)."""
        def run() -> None:
            torch.set_num_threads(threads)
            try:
                self._loop()
            except BaseException as exc:  # handed to the trainer at its next take()
                with self._cond:
                    self._state.error = exc
                    self._cond.notify_all()

        self._thread = threading.Thread(target=run, daemon=True, name="verl-rollout-producer")
        self._thread.start()

    def publish(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Offer the policy after ``version`` updates to the producer (the weight sync)."""
        with self._cond:
            self._state.snapshots[version] = weights
            self._state.latest = max(self._state.latest, version)
            self._prune()
            self._cond.notify_all()

    def take(self, step: int) -> tuple[ProducedBatch, int]:
        """The batch step ``step`` trains and its staleness, waiting for it; batches over the bound are dropped."""
        current = step - 1  # the weight version the step starts from
        while True:
            with self._cond:
                while not self._state.buffer:
                    self._raise_if_failed()
                    if self._thread is None or not self._thread.is_alive():
                        raise RuntimeError(f"the rollout producer is not running (stopped, or done after batch "
                                           f"{self.next_seq - 1}), so step {step} gets no batch")
                    self._cond.wait(_POLL_S)
                item = self._state.buffer.pop(0)
                self._cond.notify_all()
            staleness = current - item.version
            if staleness <= self.max_staleness:
                return item, staleness
            # Only "drop" gets here: "wait" generates every batch from a version within the bound.
            self.dropped_batches += 1
            self.dropped_samples += len(item.batch)

    def pending(self, *, finish_older_than: int | None = None) -> tuple[list[ProducedBatch], list[int] | None]:
        """The buffered batches and the prompts in flight, for a checkpoint.

        ``finish_older_than``: first wait until the producer has finished every batch it generates from a
        version older than this (``wait`` mode; such a batch cannot be regenerated from the checkpoint).
        """
        with self._cond:
            if finish_older_than is not None and self.on_stale == "wait":
                while (self._state.error is None and not self._state.stopped and self._more_to_produce()
                       and self._needed_version(self.next_seq) < finish_older_than):
                    self._cond.wait(_POLL_S)
                self._raise_if_failed()
            return list(self._state.buffer), (list(self._state.in_flight) if self._state.in_flight else None)

    def stop(self) -> None:
        """Tell the producer to stop (the batch being generated is discarded), without waiting for it."""
        with self._cond:
            self._state.stopped = True
            self._cond.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """Stop producing (the batch being generated is finished and discarded) and join the thread."""
        self.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the rollout producer did not stop within %.0f s; leaving it (a daemon thread)",
                               timeout)

    @contextlib.contextmanager
    def engine_first(self) -> Iterator[None]:
        """Hold :attr:`engine_lock` before the producer's next batch. A plain lock goes to whoever asks first,
        and the producer asks again a moment after each batch: the trainer would wait a whole batch more."""
        with self._cond:
            self._trainer_waits += 1
        try:
            with self.engine_lock:
                yield
        finally:
            with self._cond:
                self._trainer_waits -= 1
                self._cond.notify_all()

    def load_newest(self) -> int:
        """Load the newest published weights into the engine (validation; hold :attr:`engine_lock`)."""
        with self._cond:
            version = self._state.latest
            weights = self._state.snapshots.get(version)
        if weights is not None and self.engine_version != version:
            self.engine.load_weights(weights)
            self.engine_version = version
        return version

    # ------------------------------------------------------------------ producer side
    def _needed_version(self, seq: int) -> int:
        """The weight version ``wait`` mode generates batch ``seq`` from."""
        return max(self.base_version, seq - 1 - self.max_staleness)

    def _more_to_produce(self) -> bool:
        return self.on_stale != "wait" or self.last_seq is None or self.next_seq <= self.last_seq

    def _prune(self) -> None:
        """Forget versions no future batch can use (called with the lock held)."""
        keep = self._needed_version(self.next_seq) if self.on_stale == "wait" else self._state.latest
        for v in [v for v in self._state.snapshots if v < keep and v != self._state.latest]:
            del self._state.snapshots[v]

    def _raise_if_failed(self) -> None:
        error = self._state.error
        if error is not None:
            # The producer's own exception, so that the trainer handles it as if its step had raised it
            # (a dead worker restarts the groups, a diverged policy stops the run).
            raise error

    def _wait_until(self, ready: Callable[[], bool]) -> bool:
        """Wait (lock held) until ``ready()``; False when stopped meanwhile."""
        start = time.perf_counter()
        while not self._state.stopped and not ready():
            self._cond.wait(_POLL_S)
        self.producer_wait_s += time.perf_counter() - start
        return not self._state.stopped

    def _loop(self) -> None:
        capacity = self.max_staleness + 1
        while True:
            seq = self.next_seq
            with self._cond:
                if not self._more_to_produce():
                    return
                if not self._wait_until(lambda: len(self._state.buffer) < capacity):
                    return
                # The trainer's turn on the engine (engine_first) comes before the next batch.
                if self.on_stale == "wait":
                    need = self._needed_version(seq)
                    if not self._wait_until(lambda need=need: self._state.latest >= need and not self._trainer_waits):
                        return
                    version = need
                else:
                    if not self._wait_until(lambda: self._state.latest >= 0 and not self._trainer_waits):
                        return
                    version = self._state.latest
                weights = self._state.snapshots[version]
            drawn: list[int] = []

            def draw(drawn: list[int] = drawn, seq: int = seq) -> list[dict[str, Any]]:
                indices = self.sampler.next_batch()
                drawn.extend(indices)
                with self._cond:
                    self._state.in_flight = list(drawn)
                    self._state.in_flight_seq = seq
                return [self.rows[i] for i in indices]

            with self.engine_lock:
                if self._state.stopped:  # stopped while it waited for the engine: it is someone else's now
                    return
                if self.engine_version != version:
                    self.engine.load_weights(weights)
                    self.engine_version = version
                started = time.perf_counter()
                prompts = draw()
                batch, metrics = self._produce(seq, prompts, draw)
                finished = time.perf_counter()
            item = ProducedBatch(seq=seq, version=version, prompt_indices=drawn,
                                 sampler_state=dict(self.sampler.state_dict()), batch=self._stamp(batch, version),
                                 metrics=metrics,
                                 started=started, finished=finished)
            with self._cond:
                if self._state.stopped:
                    return
                self._state.buffer.append(item)
                self._state.in_flight = None
                self.next_seq = seq + 1
                self._prune()
                self._cond.notify_all()


def save_buffer(items: Sequence[ProducedBatch], path: Path) -> None:
    """Write the buffered batches of a checkpoint."""
    torch.save([item.to_state() for item in items], path)


def load_buffer(path: Path) -> list[ProducedBatch]:
    """The buffered batches a checkpoint saved (none when it has no buffer file)."""
    if not path.is_file():
        return []
    return [ProducedBatch(**state) for state in torch.load(path, weights_only=False)]


def with_version(batch: Batch, version: int) -> Batch:
    """``batch`` with ``meta["weight_version"]`` filled in where the engine did not count its syncs."""
    versions = batch.meta.get("weight_version")
    if versions is not None and all(v is not None for v in versions):
        return batch
    return batch.replace(meta={**batch.meta, "weight_version": [version] * len(batch)})

