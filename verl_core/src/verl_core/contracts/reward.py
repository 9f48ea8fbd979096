"""Rewards: reward functions, their inputs and errors, and the scorer the reward stage is."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, ClassVar, Iterable, Protocol, Sequence, runtime_checkable

# Annotations only: importing the contracts loads no torch (reward worker processes read RewardInput).
if TYPE_CHECKING:
    import torch
    from verl_core.batch import Batch

__all__ = ["RewardInput", "RewardFunction", "RewardError", "ScorerConfig", "RewardScorer"]


@dataclass
class RewardInput:
    """What a batch reward function is given: parallel lists, one entry per response.

    Attributes:
        responses: the decoded responses.
        prompts: the rendered prompts the responses answer.
        ground_truths: each row's ``reward_model.ground_truth`` (or answer column).
        data_sources: each row's ``data_source``.
        extra_infos: each row's ``extra_info`` dict, passed through untouched.
    """

    responses: list[str]
    prompts: list[str]
    ground_truths: list[Any]
    data_sources: list[str]
    extra_infos: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.responses)

    def select(self, indices: Sequence[int]) -> "RewardInput":
        """The rows at ``indices``, in that order."""
        extras = self.extra_infos or [{} for _ in self.responses]
        return RewardInput(responses=[self.responses[i] for i in indices], prompts=[self.prompts[i] for i in indices],
                           ground_truths=[self.ground_truths[i] for i in indices],
                           data_sources=[self.data_sources[i] for i in indices],
                           extra_infos=[extras[i] for i in indices])


@runtime_checkable
class RewardFunction(Protocol):
    """Scores a batch of responses; may be ``async``. Returns one float per response."""

    def __call__(self, inputs: RewardInput) -> Sequence[float] | Awaitable[Sequence[float]]: ...


class RewardError(RuntimeError):
    """A reward failed on a sample and the run cannot go on (the CLI reports it as a user error)."""


@dataclass
class ScorerConfig:
    """Settings of ``[reward]`` that the core reads, whichever scorer fills the section (its ``Config``
    subclasses this).

    Attributes:
        on_invalid: a NaN or infinite reward (from the scorer or an environment): ``"stop"`` ends the
            run before the step trains, naming the plugin and row, and keeps the last checkpoint;
            ``"skip"`` drops those rows, counts them in ``reward/invalid_rows`` and goes on (the health
            checks warn).
    """

    on_invalid: str = "stop"

    def validate(self) -> None:
        if self.on_invalid not in ("stop", "skip"):
            raise ValueError(f"on_invalid: must be 'stop' or 'skip', not {self.on_invalid!r}")


class RewardScorer(abc.ABC):
    """The run's reward stage: one score per generated response (``verl.scorers``, ``reward.scorer``).

    The trainer builds it once, before any model loads, from the ``[reward]`` section: ``reward.scorer``
    names the plugin and the rest of the section fills its ``Config``. ``verl-rewards`` provides
    ``default``, which combines :class:`RewardFunction` plugins by data_source and weight.

    Args:
        config: the ``Config`` instance (``None`` when the class has no ``Config``).
        registry: the plugin registry, to find reward functions in.
        tokenizer: the policy's tokenizer (to decode responses).
        data_sources: every data_source the data holds; resolve their rewards now, so a missing one
            fails before any model loads.
    """

    Config: ClassVar[type | None] = None

    def __init__(self, *, config: Any, registry: Any, tokenizer: Any, data_sources: Iterable[str] = ()) -> None:
        self.config = config
        self.registry = registry
        self.tokenizer = tokenizer

    @abc.abstractmethod
    def score(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[B]`` for a generated batch (decoded with ``tokenizer``), plus ``reward/...`` metrics."""

    @abc.abstractmethod
    def score_texts(self, responses: Sequence[str], meta: dict[str, list[Any]],
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores ``[N]`` for decoded responses, plus metrics (validation calls this).

        ``meta`` holds per-response lists: ``ground_truth``, ``data_source``, ``extra_info``,
        ``prompt_text`` and ``prompt_messages``.
        """

    def reward_model_path(self) -> str | None:
        """A reward model the trainer starts on the training backend as the ``reward_model`` role, if any."""
        return None

    def attach_reward_model(self, group: Any, tokenizer: Any) -> None:
        """Take the started ``reward_model`` worker group and its tokenizer (see :meth:`reward_model_path`)."""
        raise NotImplementedError(f"{type(self).__name__} uses no reward model")

    def close(self) -> None:
        """Release what the scorer holds (worker processes); called when the run ends."""
