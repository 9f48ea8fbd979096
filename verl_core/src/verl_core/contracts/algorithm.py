"""Algorithms: their settings, the roles they need, what they ask of the rollout stage, the contract."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

# Annotations only: importing the contracts loads no torch (reward worker processes read RewardInput).
if TYPE_CHECKING:
    import torch
    from verl_core.batch import Batch

__all__ = ["AlgorithmConfig", "Requirements", "RolloutRequest", "Algorithm"]


@dataclass
class AlgorithmConfig:
    """Settings every algorithm has. Algorithms subclass it (the PPO family through
    :class:`verl_algorithms.base.PPOFamilyConfig`, in the verl-algorithms distribution).

    Attributes:
        epochs: passes over each batch per step.
        mini_batch_size: samples per optimizer step, counted over all data-parallel ranks (each
            rank steps on its equal share; 0 = the whole batch, one step per epoch).

    Every field must change what the step trains on (advantages, losses, update settings, the
    rollout request); the conformance suite moves each off its default and checks
    (:mod:`verl_core.testing`). The exceptions are declared, with the reason, in two class
    attributes that subclasses extend (they are merged along the MRO):

    * ``inert_fields``: field -> why it never changes them (a data column name: it acts when the
      batch is built from data, which the suite's fixed batch skips; say where it is tested);
    * ``inert_when``: ``(field, other)`` -> why ``field`` stops mattering once ``other`` moves (an
      epsilon of a division that ``other`` turns off).

    ``value_aliases`` maps a field to the other names its values accept (``{"kl_estimator": {"k3":
    "low_var_kl"}}``): an alias means what its target means, so the suite does not expect a change.
    """

    inert_fields: ClassVar[dict[str, str]] = {}
    inert_when: ClassVar[dict[tuple[str, str], str]] = {}
    value_aliases: ClassVar[dict[str, dict[str, str]]] = {}

    epochs: int = 1
    mini_batch_size: int = 0

    def validate(self) -> None:
        if self.epochs < 1:
            raise ValueError("epochs: must be at least 1")
        if self.mini_batch_size < 0:
            raise ValueError("mini_batch_size: must be >= 0 (0 = whole batch)")


@dataclass(frozen=True)
class Requirements:
    """What an algorithm needs besides the actor: worker roles, and the rows its training data must hold.

    Attributes:
        critic: a critic role (value model).
        reference: a reference role (the frozen initial policy).
        data: the training rows' format: ``"prompts"`` (a prompt and its ground truth: every online
            algorithm) or ``"preference_pairs"`` (also a preferred and a dispreferred response in
            ``chosen`` and ``rejected`` columns: the offline preference algorithms). A ``builtin:``
            dataset is asked for rows in this format (:attr:`DatasetProvider.formats`); one that
            cannot give them fails before any model loads. Data files are used as they are.
        off_policy: the algorithm trains correctly on samples a few weight versions old (its loss
            has an importance ratio against the sampling policy), so the overlapping trainer modes
            (``trainer.mode = "colocate_async"``/``"separate_async"``) may feed it; those modes refuse
            an algorithm that leaves this false.
    """

    critic: bool = False
    reference: bool = False
    data: str = "prompts"
    off_policy: bool = False


@dataclass(frozen=True)
class RolloutRequest:
    """What an algorithm asks of the run's rollout stage, beyond generating and scoring.

    Attributes:
        filter: keeps the samples worth training on (whole groups, e.g. DAPO's groups whose rewards
            differ); applied to the scored batch before anything else sees it.
        max_extra_rounds: while fewer groups than the step's prompts survive ``filter``, draw more
            prompts and generate again, at most this many times (dynamic sampling); 0 filters once.
        greedy_baseline: also score one greedy response per prompt with the current policy and put
            it in ``batch.extras["baseline_scores"]`` (ReMax's baseline).
    """

    filter: Callable[[Batch], Batch] | None = None
    max_extra_rounds: int = 0
    greedy_baseline: bool = False


class Algorithm(abc.ABC):
    """An RL or preference algorithm: its dataflow and the small pure functions the dataflow calls.

    The controller never looks at an algorithm's name: everything it needs comes through these
    methods. Policy-gradient algorithms usually subclass
    :class:`verl_algorithms.base.PolicyGradient` (verl-algorithms), which declares the standard step.
    """

    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig

    def __init__(self, config: AlgorithmConfig) -> None:
        self.config = config

    def requirements(self) -> Requirements:
        """Roles this algorithm needs besides the actor."""
        return Requirements()

    @abc.abstractmethod
    def build_dataflow(self, df: Any) -> None:
        """Declare the nodes of one RL step on a :class:`~verl_core.dataflow.DataflowBuilder`.

        Online algorithms start with ``df.rollout(...)`` (the run's rollout stage), offline ones with
        ``df.batch_from_data(...)``. The trainer syncs the rollout engine's weights after the step.
        """

    @abc.abstractmethod
    def compute_advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(advantages, returns)``, both ``[B, R]``, from a scored batch."""

    @abc.abstractmethod
    def policy_loss(self, *, batch: Batch, log_probs: torch.Tensor | None = None,
                    entropy: torch.Tensor | None = None, values: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The actor's loss on one micro-batch (a :class:`LossFn`)."""

    def value_loss(self, *, batch: Batch, values: torch.Tensor | None = None, log_probs: torch.Tensor | None = None,
                   entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The critic's loss (only algorithms with a critic are asked for it)."""
        raise NotImplementedError(f"{type(self).__name__} has no critic")

    def loss_units(self, batch: Batch) -> float:
        """How many units :meth:`policy_loss` and :meth:`value_loss` on ``batch`` are a mean over.

        Backends weight each micro-batch's loss by its units over the whole mini-batch's (on every
        data-parallel rank), so the gradient does not depend on how the batch is cut. A token-mean
        loss returns ``batch.response_mask.sum()``; the default, one unit per sample, fits a mean
        over samples (or over pairs of two samples each).
        """
        return float(len(batch))

    @classmethod
    def saved_settings(cls, section: dict[str, Any]) -> dict[str, Any]:
        """The ``[algorithm]`` section of a run an earlier release saved, as this release takes it (a resume
        reads it): a plugin that dropped or renamed settings maps them here. Unchanged by default."""
        return section

    def step_metrics(self, batch: Batch, metrics: Mapping[str, float]) -> dict[str, float]:
        """Figures of the algorithm's own, logged with the step's ``metrics`` (a KL, say); none by default.

        Called once per step after the dataflow ran, with the step's batch and its metrics so far.
        """
        return {}
