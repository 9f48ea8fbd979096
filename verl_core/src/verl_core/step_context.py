"""The typed context every node of an RL step sees (:class:`StepContext`), apart from the dataflow that
runs the nodes, so that the stages the nodes call (the rollout stage) and the dataflow both import it
and neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from verl_core.batch import Batch
from verl_core.boundary import Boundary

if TYPE_CHECKING:
    from verl_core.contracts import (Algorithm, Environment, EnvironmentConfig, RewardScorer, RolloutEngine,
                                      SamplingParams, WorkerGroup)

__all__ = ["StepContext"]


@dataclass
class StepContext:
    """What nodes see while one RL step runs. The controller fills it in.

    Attributes:
        tokenizer: the run's tokenizer, for nodes that turn text into tokens (offline data).
        draw_prompts: returns the next batch of training prompt rows, for nodes that need more
            prompts than the step's own (dynamic sampling); None where no more can be drawn.
        max_log_prob_gap: the most the engine's log-probs may differ from the trainer's (mean
            absolute difference per token) before the step stops as a broken weight sync; 0 off.
        log_prob_gap_action: ``"error"`` (stop) or ``"warn"`` when the gap is exceeded.
        rollout_name: the rollout engine's plugin name, for messages.
        engine_released: the rollout stage released the engine's memory; the trainer reacquires it
            before the weight sync.
        make_environment: creates one environment per trajectory when the run has one
            (``[environment]``); the rollout stage then runs the multi-turn loop.
        environment_config: that environment's settings (max turns, token budget, concurrency).
        produced: the step's scored batch, already made by the overlapping modes' producer; the
            rollout node then takes it instead of generating (``trainer.mode``).
        staleness: how many weight versions the batch lags the policy it trains (0: on-policy).
        reuse_update_log_probs: the run allows skipping the old-log-prob forward where it provably
            equals the update's own log-probs detached (see :func:`old_log_probs_reusable`).
        boundary: the checks on what the engine, the scorer and the environment hand the rollout
            stage, with their names for the messages (:class:`~verl_core.boundary.Boundary`).
    """

    step: int
    prompts: list[dict[str, Any]]
    algorithm: Algorithm
    actor: WorkerGroup | None
    rollout: RolloutEngine
    reward: RewardScorer
    sampling: SamplingParams
    critic: WorkerGroup | None = None
    reference: WorkerGroup | None = None
    batch: Batch | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None  # a Hugging Face tokenizer
    draw_prompts: Callable[[], list[dict[str, Any]]] | None = None
    max_log_prob_gap: float = 0.0
    log_prob_gap_action: str = "error"
    rollout_name: str = ""
    engine_released: bool = False
    make_environment: Callable[[], Environment] | None = None
    environment_config: EnvironmentConfig | None = None
    produced: Batch | None = None
    staleness: int = 0
    reuse_update_log_probs: bool = False
    boundary: Boundary = field(default_factory=Boundary)
