"""reasoning-gym's generators as verl prompt rows, and each task's verifier as the reward.

reasoning-gym (https://github.com/open-thought/reasoning-gym) builds a task's entries with
``create_dataset(name, size=, seed=)``; each entry has a ``question``, an ``answer`` and ``metadata``,
and the task's ``score_answer(answer, entry)`` grades a model's answer (1.0 right, partial credit
for some tasks). Rows carry ``data_source = "reasoning_gym/<task>"`` and the task name and the whole
entry in ``extra_info``, so the reward rebuilds the grader of that task and scores exactly as
reasoning-gym does; rows of several tasks can be mixed in one dataset and each is graded by its own.

``data.train = "reasoning_gym:<tasks>"`` (:class:`ReasoningGym`) makes such rows for any task, or a
weighted mixture of tasks: ``reasoning_gym:chain_sum=0.7,basic_arithmetic=0.3``, each task with reasoning-gym's
default config or its own: ``reasoning_gym:chain_sum{"min_terms": 2, "max_terms": 2}``.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import random
import re
from typing import Any, ClassVar

from verl_core.contracts import DatasetProvider

__all__ = ["DATA_SOURCE", "TEST_SEED", "task_rows", "mixture_rows", "parse_tasks", "parse_spec",
           "check_task_config", "ReasoningGymReward",
           "ReasoningGym", "ChainSum"]

#: ``data_source`` prefix of every row (``reasoning_gym/chain_sum``); ``reward.name = "auto"`` routes it to
#: :class:`ReasoningGymReward`, and the reward manager logs ``reward/source/<data_source>/mean`` per task.
DATA_SOURCE = "reasoning_gym"
#: Seed of the test rows. A task's entry ``i`` comes from ``Random(seed + i)``, so train rows (seed 0) and
#: test rows of a nearby seed would be the same entries shifted; these are ``TEST_SEED`` entries further on.
TEST_SEED = 1_000_000_000
_SYNTAX = ('write one task (chain_sum), tasks with weights (chain_sum=0.7,basic_arithmetic=0.3), each with an '
           'optional JSON config of its fields (chain_sum{"min_terms": 2, "max_terms": 2}=0.7)')


def task_rows(task: str, *, size: int, seed: int, **task_config: Any) -> list[dict[str, Any]]:
    """``size`` rows of reasoning-gym task ``task`` in the verl row format (seeded: the same rows each call)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    return [{"data_source": f"{DATA_SOURCE}/{task}",
             "prompt": [{"role": "user", "content": entry["question"]}],
             "reward_model": {"style": "rule", "ground_truth": entry["answer"]},
             "extra_info": {"task": task, "entry": dict(entry), "config": dict(task_config)}} for entry in dataset]


def parse_tasks(argument: str) -> dict[str, float]:
    """``"chain_sum=0.7,basic_arithmetic=0.3"`` -> ``{"chain_sum": 0.7, "basic_arithmetic": 0.3}``.

    A task without ``=weight`` weighs 1 (``chain_sum,basic_arithmetic``: half each). ``ValueError`` with
    the fix for a weight that is not a number >= 0, weights summing to 0, a task named twice, a task
    reasoning-gym does not have (naming the closest ones) or a bad task config (:func:`parse_spec`).
    """
    return parse_spec(argument)[0]


def parse_spec(argument: str) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The weights and the task configs of ``<task>[{config}][=weight],...``.

    ``{config}`` is a JSON object of the task's reasoning-gym config fields (``chain_sum{"min_terms": 2,
    "max_terms": 2}``), checked by :func:`check_task_config`; a task without one has reasoning-gym's defaults.
    """
    from reasoning_gym.factory import DATASETS

    weights: dict[str, float] = {}
    configs: dict[str, dict[str, Any]] = {}
    position = 0
    while True:
        task = re.match(r"[^{=,]*", argument[position:]).group()
        position += len(task)
        task = task.strip()
        if not task:
            raise ValueError(f"an empty task name in {argument!r}; {_SYNTAX}")
        config: dict[str, Any] = {}
        if argument.startswith("{", position):
            try:
                config, position = json.JSONDecoder().raw_decode(argument, position)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the config of {task} is not a JSON object ({exc.msg} at character {exc.pos} "
                                 f"of {argument!r}); {_SYNTAX}") from None
        sep, text = "", ""
        if argument.startswith("=", position):
            end = argument.find(",", position)
            end = len(argument) if end < 0 else end
            sep, text, position = "=", argument[position + 1:end].strip(), end
        if argument[position:position + 1] not in ("", ","):
            raise ValueError(f"{argument[position:]!r} after {task} in {argument!r}; {_SYNTAX}")
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
        weights[task], configs[task] = weight, check_task_config(task, config)
        if position == len(argument):
            break
        position += 1
    if not sum(weights.values()) > 0:
        raise ValueError(f"the weights sum to 0; give at least one task a weight > 0 ({_SYNTAX})")
    return weights, configs


def check_task_config(task: str, config: Any) -> dict[str, Any]:
    """``config`` when it is a JSON object of fields of ``task``'s reasoning-gym config that the task accepts
    (its ``validate()`` passes and an entry can be made); ``ValueError`` naming the field otherwise."""
    import dataclasses

    from reasoning_gym.factory import DATASETS, create_dataset

    if not isinstance(config, dict):
        raise ValueError(f"the config of {task} is {config!r}; write a JSON object of its fields ({_SYNTAX})")
    config_cls = DATASETS[task][1]
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for key in config:
        if key in ("seed", "size"):
            raise ValueError(f"{task}: {key!r} is set by verl (data.size, data.val_size; the seeds of the splits), "
                             f"not in the task config; remove it")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=2, cutoff=0.6)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise ValueError(f"{task} has no config field {key!r}; {hint}{config_cls.__name__}'s fields: "
                             f"{', '.join(fields)}")
    try:
        create_dataset(task, size=1, seed=0, **config)[0]
    except Exception as exc:  # reasoning-gym checks with assert, and a wrong type fails anywhere in building
        raise ValueError(f"{task} refuses the config {json.dumps(config)}: {type(exc).__name__}: {exc} "
                         f"(see {config_cls.__name__}'s fields and their types)") from None
    return config


def mixture_rows(weights: dict[str, float], *, size: int, seed: int,
                 configs: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``size`` rows, each task's share of them in proportion to its weight (largest remainders), shuffled
    (seeded) so that any prefix of them is mixed too; ``configs`` (task -> config fields) for tasks that
    do not use reasoning-gym's defaults."""
    total = sum(weights.values())
    exact = {task: size * w / total for task, w in weights.items()}
    counts = {task: int(x) for task, x in exact.items()}
    for task in sorted(exact, key=lambda t: counts[t] - exact[t])[: size - sum(counts.values())]:
        counts[task] += 1
    configs = configs or {}
    rows = [row for task, n in counts.items() if n
            for row in task_rows(task, size=n, seed=seed, **configs.get(task, {}))]
    random.Random(seed).shuffle(rows)
    return rows


class ReasoningGymReward:
    """The row's task's own verifier: ``score_answer(response, entry)``, a score in [0, 1], of the task
    built with the row's config (``extra_info["config"]``; reasoning-gym's defaults when it has none)."""

    # "reasoning_gym/*": any task's rows (the reward manager matches these as shell patterns).
    data_sources: ClassVar[tuple[str, ...]] = (DATA_SOURCE, f"{DATA_SOURCE}/*")

    def __call__(self, response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
        task, entry = extra_info.get("task"), extra_info.get("entry")
        if not task or not isinstance(entry, dict):
            raise ValueError("reasoning_gym reward: the row's extra_info lacks 'task' and 'entry' (rows built by "
                             "verl_reasoning_gym.task_rows carry them)")
        config = json.dumps(extra_info.get("config") or {}, sort_keys=True)
        return float(_grader(task, config)(response.strip(), entry))


@functools.lru_cache(maxsize=64)
def _grader(task: str, config: str) -> Any:
    """``score_answer`` of ``task`` built with ``config`` (JSON; built once per task and config)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=1, seed=0, **json.loads(config)).score_answer


class ReasoningGym(DatasetProvider):
    """``data.train = "reasoning_gym:<tasks>"``: rows of one reasoning-gym task or a weighted mixture
    (:func:`parse_tasks`), ``data.size`` training rows (default 1000) from seed 0 and ``data.val_size``
    test rows (default 100) from :data:`TEST_SEED`: the same rows in every run."""

    argument = ('a reasoning-gym task (chain_sum) or tasks with weights (chain_sum=0.7,basic_arithmetic=0.3), '
                'each with an optional JSON config (chain_sum{"min_terms": 2})')
    splits = ("train", "test")
    default_sizes: ClassVar[tuple[int, int]] = (1000, 100)

    def __init__(self, weights: dict[str, float], *, size: int, val_size: int,
                 configs: dict[str, dict[str, Any]] | None = None) -> None:
        self.weights, self.configs = weights, configs or {}
        self.sizes = {"train": (size, 0), "test": (val_size, TEST_SEED)}

    @classmethod
    def from_spec(cls, argument: str, *, size: int, val_size: int) -> ReasoningGym:
        train, test = cls.default_sizes
        weights, configs = parse_spec(argument)
        return cls(weights, size=size or train, val_size=val_size or test, configs=configs)

    def rows(self, *, split: str) -> list[dict[str, Any]]:
        if split not in self.splits:
            raise ValueError(f"reasoning_gym data has splits {list(self.splits)}, not {split!r} (data.val_split)")
        size, seed = self.sizes[split]
        return mixture_rows(self.weights, size=size, seed=seed, configs=self.configs)


class ChainSum(ReasoningGym):
    """``builtin:reasoning-gym-chain-sum``: reasoning-gym's ``chain_sum`` (sums and differences of
    small integers), 2000 training and 200 test rows (``reasoning_gym:chain_sum`` with those sizes)."""

    argument = ""

    def __init__(self) -> None:
        super().__init__({"chain_sum": 1.0}, size=2000, val_size=200)
