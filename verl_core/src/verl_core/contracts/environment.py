"""Environments: multi-turn tasks the agent loop drives, one instance per trajectory."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

# Annotations only: importing the contracts loads no torch (reward worker processes read RewardInput).
if TYPE_CHECKING:
    from verl_core.batch import Batch
    from verl_core.contracts.rollout import RolloutEngine, SamplingParams

__all__ = ["ENV_REWARDS", "StepResult", "EnvironmentConfig", "Environment"]


#: ``batch.extras`` key of the environment's rewards in :meth:`Environment.run_episodes`'s batch, ``[B, R]``:
#: each turn's reward on the last model token of that turn. The rollout stage adds them to the scorer's.
ENV_REWARDS = "env_token_rewards"


@dataclass
class StepResult:
    """What an environment returns after the policy acts."""

    observation: list[dict[str, str]] | None
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class EnvironmentConfig:
    """Settings of the multi-turn loop every environment has (``[environment]``). Environments
    subclass it to add their own.

    Attributes:
        max_turns: model turns per trajectory at most.
        max_response_tokens: response tokens per trajectory, model and environment together; 0
            means ``rollout.max_new_tokens`` (the budget of one turn) times ``max_turns``.
        concurrency: environment steps (tool calls) run at once.
    """

    max_turns: int = 4
    max_response_tokens: int = 0
    concurrency: int = 8

    def validate(self) -> None:
        if self.max_turns < 1:
            raise ValueError("max_turns: must be at least 1")
        if self.max_response_tokens < 0:
            raise ValueError("max_response_tokens: must be >= 0 (0: rollout.max_new_tokens x max_turns)")
        if self.concurrency < 1:
            raise ValueError("concurrency: must be at least 1")


class Environment(abc.ABC):
    """A multi-turn environment, created once per trajectory: reset with a task, then step with
    each model turn. The class's :meth:`run_episodes` drives its instances; the rollout stage and
    validation call it instead of a plain ``generate`` when the run has an ``[environment]``.

    ``reset``, ``step`` and ``close`` may be coroutines. An environment that offers tools returns
    their OpenAI-style function schemas from :meth:`tools`; the chat template gets them as ``tools=``.
    ``task`` is the built-in task ``verl run --env NAME`` runs (settings by section, layered under
    the user's, e.g. ``{"model": {"path": "builtin:..."}, "data": {"train": "builtin:..."}}``); a class
    method ``task_for(section)`` gives one that depends on the ``[environment]`` section instead.
    """

    Config: ClassVar[type[EnvironmentConfig]] = EnvironmentConfig
    task: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, config: EnvironmentConfig | None = None) -> None:
        self.config = config if config is not None else self.Config()

    @abc.abstractmethod
    def reset(self, *, prompt: list[dict[str, str]], extra_info: dict[str, Any]) -> list[dict[str, str]]:
        """Start an episode; return the chat messages the policy sees first."""

    @abc.abstractmethod
    def step(self, response: str) -> StepResult:
        """Apply the policy's turn (its text, without the stop token); return the observation
        messages to append (``None`` with ``done``), a reward for this turn, and whether it ended.
        ``info["tool_error"]`` counts a failed tool call in the metrics; ``info["rewards"]`` (names to
        numbers) are the reward's parts, logged as ``reward/<name>`` (their mean over the trajectories)."""

    def tools(self) -> list[dict[str, Any]] | None:
        """Function schemas of the tools this environment offers (None: no tools)."""
        return None

    def close(self) -> None:
        """Release what the episode holds (processes, files)."""

    @classmethod
    def run_episodes(cls, engine: RolloutEngine, prompts: Sequence[dict[str, Any]], sampling: SamplingParams,
                     make_env: Callable[[], Environment], config: EnvironmentConfig, *, pad_id: int,
                     metrics: dict[str, float] | None = None, boundary: Any = None, step: int = 0) -> Batch:
        """Run ``sampling.n`` whole trajectories per prompt row on ``engine``, one environment from
        ``make_env()`` each, within ``config``'s limits; the batch of their responses, ``response_mask``
        0 on the environment's tokens, its rewards in ``extras[ENV_REWARDS]``, the trajectories' token
        budget in ``info["max_new_tokens"]``. Adds ``env/...`` figures
        to ``metrics``; checks what the environments return with ``boundary``
        (:class:`~verl_core.boundary.Boundary`, which names the plugin in errors) at step ``step``.

        The multi-turn loop is not in the core: ``verl_env_kit.MultiTurnEnvironment`` implements it.
        """
        raise NotImplementedError(
            f"environment {cls.__name__} has no episode runner: subclass verl_env_kit.MultiTurnEnvironment "
            f"(pip install verl-env-kit), which runs the multi-turn loop, instead of verl_core's Environment")
