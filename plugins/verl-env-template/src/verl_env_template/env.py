"""``my_env``: answer the question; a wrong answer is told to try again, up to ``max_turns`` answers.

The environment verl runs with ``verl run --env my_env`` (see docs/writing-environments.md). One
object per trajectory: :meth:`reset` gets the row's prompt and its ``extra_info`` (with the row's
``ground_truth``), :meth:`step` each model turn's text. Its reward adds to the ``[reward]`` scorer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from verl_core.contracts import EnvironmentConfig, StepResult
# The multi-turn loop your environment runs in (verl-env-kit); subclass it, not verl_core's Environment.
from verl_env_kit import MultiTurnEnvironment

__all__ = ["MyEnvironment", "MyEnvironmentConfig"]


@dataclass
class MyEnvironmentConfig(EnvironmentConfig):
    """The ``[environment]`` section with ``name = "my_env"``.

    Attributes:
        max_turns: answers per question at most (the first and the retries).
        correct_reward: the environment's reward for a right answer, on the turn that gave it.
    """

    max_turns: int = 2
    correct_reward: float = 1.0

    def validate(self) -> None:
        super().validate()
        if self.correct_reward < 0:
            raise ValueError("correct_reward: must be >= 0")


class MyEnvironment(MultiTurnEnvironment):
    """A right answer ends the episode with ``correct_reward``; a wrong one is asked the question again.

    With the built-in task the ``arithmetic`` reward also scores the whole response text, which only a
    single right answer passes: a right first answer earns 2, a right retry 1, no right answer 0.
    """

    Config: ClassVar[type[EnvironmentConfig]] = MyEnvironmentConfig
    # What `verl run --env my_env` trains by default, layered under the user's settings: the
    # built-in addition task (model, data and its reward by data_source) of verl-task-arithmetic.
    task: ClassVar[dict[str, dict[str, Any]]] = {"data": {"train": "builtin:addition"}}

    def __init__(self, config: MyEnvironmentConfig | None = None) -> None:
        super().__init__(config)
        self._question: list[dict[str, str]] = []
        self._answer: str | None = None

    def reset(self, *, prompt: list[dict[str, str]], extra_info: dict[str, Any]) -> list[dict[str, str]]:
        if extra_info.get("ground_truth") is None:
            raise ValueError("my_env needs rows with a ground truth (reward_model.ground_truth or data.answer_key)")
        self._answer = str(extra_info["ground_truth"]).strip()
        self._question = [m for m in prompt if m["role"] == "user"][-1:]
        return list(prompt)

    def step(self, response: str) -> StepResult:
        if self._answer is None:  # a turn after the episode ended, or before reset: answer it, never raise
            return StepResult(observation=None, reward=0.0, done=True, info={"error": "no question"})
        if response.strip() == self._answer:
            self._answer = None
            return StepResult(observation=None, reward=float(self.config.correct_reward), done=True)
        # Wrong: ask again. The observation is chat messages, rendered by the model's own template.
        return StepResult(observation=list(self._question), reward=0.0, done=False)

    def close(self) -> None:
        self._answer = None
