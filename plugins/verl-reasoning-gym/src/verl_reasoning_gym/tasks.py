"""reasoning-gym's generators as verl prompt rows, and each task's verifier as the reward.

reasoning-gym (https://github.com/open-thought/reasoning-gym) builds a task's entries with
``create_dataset(name, size=, seed=)``; each entry has a ``question``, an ``answer`` and ``metadata``,
and the task's ``score_answer(answer, entry)`` grades a model's answer (1.0 right, partial credit
for some tasks). Rows carry ``data_source = "reasoning_gym/<task>"`` and the task name and the whole
entry in ``extra_info``, so the reward rebuilds the grader of that task and scores exactly as
reasoning-gym does; rows of several tasks can be mixed in one dataset and each is graded by its own.

``data.train = "reasoning_gym:<tasks>"`` (:class:`ReasoningGym`) makes such rows for any task, or a
weighted mixture of tasks: ``reasoning_gym:chain_sum=0.7,basic_arithmetic=0.3``.
"""

from __future__ import annotations

import difflib
import math
import random
from typing import Any, ClassVar

from verl_core.contracts import DatasetProvider

__all__ = ["DATA_SOURCE", "TEST_SEED", "task_rows", "mixture_rows", "parse_tasks", "ReasoningGymReward",
           "ReasoningGym", "ChainSum"]

#: ``data_source`` prefix of every row (``reasoning_gym/chain_sum``); ``reward.name = "auto"`` routes it to
#: :class:`ReasoningGymReward`, and the reward manager logs ``reward/source/<data_source>/mean`` per task.
DATA_SOURCE = "reasoning_gym"
#: Seed of the test rows. A task's entry ``i`` comes from ``Random(seed + i)``, so train rows (seed 0) and
#: test rows of a nearby seed would be the same entries shifted; these are ``TEST_SEED`` entries further on.
TEST_SEED = 1_000_000_000
_SYNTAX = "write one task (chain_sum) or tasks with weights (chain_sum=0.7,basic_arithmetic=0.3)"


def task_rows(task: str, *, size: int, seed: int, **task_config: Any) -> list[dict[str, Any]]:
    """``size`` rows of reasoning-gym task ``task`` in the verl row format (seeded: the same rows each call)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    return [{"data_source": f"{DATA_SOURCE}/{task}",
             "prompt": [{"role": "user", "content": entry["question"]}],
             "reward_model": {"style": "rule", "ground_truth": entry["answer"]},
             "extra_info": {"task": task, "entry": dict(entry)}} for entry in dataset]


def parse_tasks(argument: str) -> dict[str, float]:
    """``"chain_sum=0.7,basic_arithmetic=0.3"`` -> ``{"chain_sum": 0.7, "basic_arithmetic": 0.3}``.

    A task without ``=weight`` weighs 1 (``chain_sum,basic_arithmetic``: half each). ``ValueError`` with
    the fix for a weight that is not a number >= 0, weights summing to 0, a task named twice, or a task
    reasoning-gym does not have (naming the closest ones).
    """
    from reasoning_gym.factory import DATASETS

    weights: dict[str, float] = {}
    for item in argument.split(","):
        task, sep, text = (part.strip() for part in item.partition("="))
        if not task:
            raise ValueError(f"an empty task name in {argument!r}; {_SYNTAX}")
        try:
            weight = float(text) if sep else 1.0
        except ValueError:
            raise ValueError(f"the weight {text!r} of {task} is not a number; {_SYNTAX}") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"the weight of {task} is {text}; weights are numbers >= 0 ({_SYNTAX})")
        if task in weights:
            raise ValueError(f"{task} is named twice; name each task once ({_SYNTAX})")
        if task not in DATASETS:
            close = difflib.get_close_matches(task, list(DATASETS), n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(f"reasoning-gym has no task {task!r}; {hint}its {len(DATASETS)} tasks: "
                             f"{', '.join(sorted(DATASETS))}")
        weights[task] = weight
    if not sum(weights.values()) > 0:
        raise ValueError(f"the weights sum to 0; give at least one task a weight > 0 ({_SYNTAX})")
    return weights


def mixture_rows(weights: dict[str, float], *, size: int, seed: int) -> list[dict[str, Any]]:
    """``size`` rows, each task's share of them in proportion to its weight (largest remainders), shuffled
    (seeded) so that any prefix of them is mixed too."""
    total = sum(weights.values())
    exact = {task: size * w / total for task, w in weights.items()}
    counts = {task: int(x) for task, x in exact.items()}
    for task in sorted(exact, key=lambda t: counts[t] - exact[t])[: size - sum(counts.values())]:
        counts[task] += 1
    rows = [row for task, n in counts.items() if n for row in task_rows(task, size=n, seed=seed)]
    random.Random(seed).shuffle(rows)
    return rows


class ReasoningGymReward:
    """The row's task's own verifier: ``score_answer(response, entry)``, a score in [0, 1]."""

    # "reasoning_gym/*": any task's rows (the reward manager matches these as shell patterns).
    data_sources: ClassVar[tuple[str, ...]] = (DATA_SOURCE, f"{DATA_SOURCE}/*")

    def __call__(self, response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
        import reasoning_gym

        task, entry = extra_info.get("task"), extra_info.get("entry")
        if not task or not isinstance(entry, dict):
            raise ValueError("reasoning_gym reward: the row's extra_info lacks 'task' and 'entry' (rows built by "
                             "verl_reasoning_gym.task_rows carry them)")
        return float(reasoning_gym.get_score_answer_fn(task)(response.strip(), entry))


class ReasoningGym(DatasetProvider):
    """``data.train = "reasoning_gym:<tasks>"``: rows of one reasoning-gym task or a weighted mixture
    (:func:`parse_tasks`), ``data.size`` training rows (default 1000) from seed 0 and ``data.val_size``
    test rows (default 100) from :data:`TEST_SEED`: the same rows in every run."""

    argument = "a reasoning-gym task (chain_sum) or tasks with weights (chain_sum=0.7,basic_arithmetic=0.3)"
    splits = ("train", "test")
    default_sizes: ClassVar[tuple[int, int]] = (1000, 100)

    def __init__(self, weights: dict[str, float], *, size: int, val_size: int) -> None:
        self.weights = weights
        self.sizes = {"train": (size, 0), "test": (val_size, TEST_SEED)}

    @classmethod
    def from_spec(cls, argument: str, *, size: int, val_size: int) -> ReasoningGym:
        train, test = cls.default_sizes
        return cls(parse_tasks(argument), size=size or train, val_size=val_size or test)

    def rows(self, *, split: str) -> list[dict[str, Any]]:
        if split not in self.splits:
            raise ValueError(f"reasoning_gym data has splits {list(self.splits)}, not {split!r} (data.val_split)")
        size, seed = self.sizes[split]
        return mixture_rows(self.weights, size=size, seed=seed)


class ChainSum(ReasoningGym):
    """``builtin:reasoning-gym-chain-sum``: reasoning-gym's ``chain_sum`` (sums and differences of
    small integers), 2000 training and 200 test rows (``reasoning_gym:chain_sum`` with those sizes)."""

    argument = ""

    def __init__(self) -> None:
        super().__init__({"chain_sum": 1.0}, size=2000, val_size=200)
