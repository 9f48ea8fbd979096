"""``vision`` (``verl.environments``): one turn over a prompt with images, scored by the reward stage."""

from __future__ import annotations

from typing import Any

from verl_core.contracts import StepResult
from verl_env_kit import MultiTurnEnvironment

__all__ = ["VisionEnvironment"]


class VisionEnvironment(MultiTurnEnvironment):
    """The policy answers a question about the prompt's image once; the reward function
    (``vision_shapes`` for the built-in task) scores the answer.

    The prompt (with its images) is the data's, unchanged: the rollout keeps the processor's tokens
    and image tensors. ``task`` is what ``verl run --env vision`` runs.
    """

    task = {
        "model": {"path": "builtin:tiny-qwen2-vl"},
        "data": {"train": "builtin:vision-shapes"},
        "environment": {"max_turns": 1},
    }

    def reset(self, *, prompt: list[dict[str, Any]], extra_info: dict[str, Any]) -> list[dict[str, Any]]:
        return list(prompt)

    def step(self, response: str) -> StepResult:
        return StepResult(observation=None, reward=0.0, done=True)
