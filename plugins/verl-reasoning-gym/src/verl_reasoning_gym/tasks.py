"""reasoning-gym's generators as verl prompt rows, and each task's verifier as the reward.

reasoning-gym (https://github.com/open-thought/reasoning-gym) builds a task's entries with
``create_dataset(name, size=, seed=)``; each entry has a ``question``, an ``answer`` and ``metadata``,
and the task's ``score_answer(answer, entry)`` grades a model's answer (1.0 right, partial credit
for some tasks). Rows carry the task name and the whole entry in ``extra_info``, so the reward
rebuilds the grader of that task and scores exactly as reasoning-gym does; rows of several tasks can
be mixed in one dataset and each is graded by its own.
"""

from __future__ import annotations

from typing import Any, ClassVar

from verl_core.contracts import DatasetProvider

__all__ = ["DATA_SOURCE", "task_rows", "ReasoningGymReward", "ChainSum"]

#: ``data_source`` of every row; ``reward.name = "auto"`` routes it to :class:`ReasoningGymReward`.
DATA_SOURCE = "reasoning_gym"


def task_rows(task: str, *, size: int, seed: int, **task_config: Any) -> list[dict[str, Any]]:
    """``size`` rows of reasoning-gym task ``task`` in the verl row format (seeded: the same rows each call)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    return [{"data_source": DATA_SOURCE,
             "prompt": [{"role": "user", "content": entry["question"]}],
             "reward_model": {"style": "rule", "ground_truth": entry["answer"]},
             "extra_info": {"task": task, "entry": dict(entry)}} for entry in dataset]


class ReasoningGymReward:
    """The row's task's own verifier: ``score_answer(response, entry)``, a score in [0, 1]."""

    data_sources: ClassVar[tuple[str, ...]] = (DATA_SOURCE,)

    def __call__(self, response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
        import reasoning_gym

        task, entry = extra_info.get("task"), extra_info.get("entry")
        if not task or not isinstance(entry, dict):
            raise ValueError("reasoning_gym reward: the row's extra_info lacks 'task' and 'entry' (rows built by "
                             "verl_reasoning_gym.task_rows carry them)")
        return float(reasoning_gym.get_score_answer_fn(task)(response.strip(), entry))


class ChainSum(DatasetProvider):
    """``builtin:reasoning-gym-chain-sum``: reasoning-gym's ``chain_sum`` (sums and differences of
    small integers), 2000 training and 200 test rows from different seeds."""

    splits = ("train", "test")
    sizes: ClassVar[dict[str, tuple[int, int]]] = {"train": (2000, 0), "test": (200, 1)}

    def rows(self, *, split: str) -> list[dict[str, Any]]:
        if split not in self.splits:
            raise ValueError(f"builtin:reasoning-gym-chain-sum has splits {list(self.splits)}, not {split!r}")
        size, seed = self.sizes[split]
        return task_rows("chain_sum", size=size, seed=seed)
