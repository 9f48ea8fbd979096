"""Where each RL step's batch comes from: the step-source contract (``trainer.mode`` names the plugin).

The trainer's loop is the same whatever the source: ``step = source.next(n)``, the algorithm's dataflow
on it, ``source.after_update(n)``. The core's ``sync`` source draws prompts and lets the step's rollout
stage generate from them, then hands the engine the new weights. An overlapping source (the
``colocate_async`` and ``separate_async`` modes of verl-trainer-async) generates ahead on weights of its
own and hands over batches it already scored.

A source registers under the ``verl.step_sources`` entry points with the ``trainer.mode`` it serves; its
``Config`` dataclass types the rest of the ``[trainer]`` section.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping

if TYPE_CHECKING:
    from verl_core.batch import Batch

__all__ = ["StepSource", "StepSourceConfig", "SourcedStep"]


@dataclass
class StepSourceConfig:
    """The ``[trainer]`` settings of a source that has none besides ``mode``."""

    def validate(self) -> None:
        """Raise :class:`~verl_core.contracts.ConfigError` on a bad value (nothing to check here)."""


@dataclass
class SourcedStep:
    """One step's prompts, and the batch when the source generated and scored it already.

    Attributes:
        prompts: the step's prompt rows.
        indices: their indices in the training rows, which a checkpoint records; None: the trainer's
            prompt sampler drew them (``Trainer.draw_prompts`` recorded them).
        produced: the scored batch the step trains on: the rollout stage takes it instead of
            generating. None: the step's rollout stage generates from ``prompts``.
        staleness: weight versions between the policy that generated ``produced`` and the one it trains.
        epoch: the pass over the training prompts these come from (None: the trainer's sampler's).
        metrics: the source's own figures for the step (``async/*``).
    """

    prompts: list[dict[str, Any]]
    indices: list[int] | None = None
    produced: Batch | None = None
    staleness: int = 0
    epoch: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class StepSource(abc.ABC):
    """Hands the trainer each step's prompts (or batch) and takes the new weights after each update.

    Built after the worker groups start, with the trainer, whose public attributes it may read
    (``config``, ``registry``, ``run_threads``, ``rollout``, ``actor``, ``sampler``, ``train_rows``, ``tokenizer``,
    ``dataflow``, ``algorithm``, ``reward``, ``boundary``, ``model_spec``, ``step``, ``max_steps``, ``hooks``,
    ``draw_prompts``, ``step_context``), and, on a resume, the checkpoint and its ``trainer_state.json``.
    Built again after the worker groups restart.
    """

    Config: ClassVar[type] = StepSourceConfig

    def __init__(self, config: Any, *, trainer: Any, resumed: tuple[Path, Mapping[str, Any]] | None = None) -> None:
        self.config = config
        self.trainer = trainer

    # -------------------------------------------------------------------- before anything loads
    @classmethod
    def check(cls, config: Any, *, mode: str, algorithm: str, generates: bool, off_policy: bool,
              executor: Any, executor_config: Any) -> None:
        """Refuse a run this source cannot drive (:class:`~verl_core.contracts.ConfigError` on
        ``trainer.*``), before any model loads. ``generates``: the algorithm's step has a rollout stage;
        ``off_policy``: it can train on samples of older weights; ``executor``: the executor's class."""

    @classmethod
    def torch_threads(cls, config: Any, threads: int) -> int:
        """The trainer process's torch threads, given ``run.threads`` (a source that generates in a
        thread of the trainer's process takes its share)."""
        return threads

    @classmethod
    def defaults(cls, raw: Mapping[str, Any], registry: Any) -> tuple[dict[str, dict[str, Any]], str]:
        """Settings of other sections this source recommends for the raw config ``raw``, layered under
        the user's (who wins), and a note on them for ``verl config show``; ``({}, "")``: none."""
        return {}, ""

    # -------------------------------------------------------------------- the run
    def start(self) -> None:
        """The run starts stepping (after the first validation)."""

    @abc.abstractmethod
    def next(self, step: int) -> SourcedStep:
        """The prompts (or the scored batch) RL step ``step`` trains on."""

    @abc.abstractmethod
    def after_update(self, step: int) -> None:
        """Step ``step`` updated the actor: hand its weights to whatever generates the next steps."""

    @contextlib.contextmanager
    def validation(self) -> Iterator[None]:
        """Held while the trainer validates on the run's rollout engine."""
        yield

    def checkpoint_state(self) -> dict[str, Any]:
        """Entries of the step's ``trainer_state.json`` (a ``"sampler"`` entry replaces the trainer's)."""
        return {}

    def write_checkpoint(self, directory: Path) -> None:
        """Write files of the source's own into the checkpoint being saved (after :meth:`checkpoint_state`)."""

    def close(self) -> None:
        """Stop generating and release what the source started (the run ended or its workers restart)."""
