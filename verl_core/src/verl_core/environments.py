"""Built-in environments (single-turn tasks expressed through the multi-turn interface)."""

from __future__ import annotations

from typing import Any

from verl_core.interfaces import Environment, StepResult

__all__ = ["ArithmeticEnvironment"]


class ArithmeticEnvironment(Environment):
    """One question, one answer: the reward is 1 when the answer equals the ground truth."""

    def __init__(self) -> None:
        self._truth: str | None = None

    def reset(self, *, prompt: list[dict[str, str]], extra_info: dict[str, Any]) -> list[dict[str, str]]:
        if "ground_truth" not in extra_info:
            raise ValueError("ArithmeticEnvironment.reset needs extra_info['ground_truth']")
        self._truth = str(extra_info["ground_truth"])
        return list(prompt)

    def step(self, response: str) -> StepResult:
        if self._truth is None:
            raise RuntimeError("call reset() before step()")
        reward = 1.0 if response.strip() == self._truth else 0.0
        self._truth = None
        return StepResult(observation=None, reward=reward, done=True)
