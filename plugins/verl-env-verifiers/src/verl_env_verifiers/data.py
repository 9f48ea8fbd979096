"""``data.train = "verifiers:<env-id>"`` (``verl.datasets``): a verifiers taskset's tasks as verl prompt rows,
and ``verifiers`` (``verl.rewards``), the rows' own reward: 0, the reward being the environment's.

``verl run --env verifiers environment.id=<env-id>`` sets this data itself
(:meth:`verl_env_verifiers.env.VerifiersEnvironment.task_for`); the argument is the id, then optionally the
taskset's config fields as a JSON object: ``verifiers:my-env{"size": 200}``.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from verl_core.contracts import DatasetProvider

__all__ = ["DATA_SOURCE", "VerifiersData", "VerifiersRowReward", "parse_spec"]

#: ``data_source`` prefix of every row (``verifiers/<env-id>``).
DATA_SOURCE = "verifiers"


def parse_spec(argument: str) -> tuple[str, dict[str, Any]]:
    """``'my-env{"size": 200}'`` -> ``("my-env", {"size": 200})``."""
    env_id, brace, rest = argument.partition("{")
    env_id = env_id.strip()
    if not env_id:
        raise ValueError(f"write the environment id, then optionally its args as JSON: verifiers:my-env or "
                         f"verifiers:my-env{{\"size\": 200}} (got {argument!r})")
    args: Any = {}
    if brace:
        try:
            args = json.loads(brace + rest)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the args of {env_id} are not a JSON object ({exc.msg}): {brace + rest!r}") from None
        if not isinstance(args, dict):
            raise ValueError(f"the args of {env_id} must be a JSON object, not {brace + rest!r}")
    return env_id, args


class VerifiersData(DatasetProvider):
    """The taskset's tasks in ``load()`` order: the last ``data.val_size`` of them (default: a tenth, at most
    100) are the ``test`` split, the others (at most ``data.size``) the ``train`` split. A row's prompt is the
    task's system prompt and prompt, its ``extra_info.index`` the task's index, its ground truth the task's
    ``answer`` field where it has one."""

    argument = 'a verifiers environment id, optionally with its args: my-env or my-env{"size": 200}'
    splits = ("train", "test")

    def __init__(self, env_id: str, args: dict[str, Any], *, size: int = 0, val_size: int = 0) -> None:
        self.env_id, self.args, self.size, self.val_size = env_id, args, size, val_size

    @classmethod
    def from_spec(cls, argument: str, *, size: int, val_size: int) -> VerifiersData:
        from verl_env_verifiers import tasks

        env_id, args = parse_spec(argument)
        tasks.check_installed(env_id)
        return cls(env_id, args, size=size, val_size=val_size)

    def rows(self, *, split: str) -> list[dict[str, Any]]:
        from verl_env_verifiers import tasks

        if split not in self.splits:
            raise ValueError(f"verifiers data has splits {list(self.splits)}, not {split!r} (data.val_split)")
        loaded = tasks.load(self.env_id, self.args).tasks
        n_test = self.val_size or min(100, len(loaded) // 10)
        if n_test >= len(loaded):
            raise ValueError(f"verifiers:{self.env_id} has {len(loaded)} tasks, too few for {n_test} test rows "
                             f"(data.val_size) and training rows")
        chosen = loaded[len(loaded) - n_test:] if split == "test" else loaded[:len(loaded) - n_test]
        if split == "train" and self.size:
            chosen = chosen[:self.size]
        return [{"data_source": f"{DATA_SOURCE}/{self.env_id}", "prompt": tasks.prompt_messages(task.data),
                 "reward_model": {"style": "rule", "ground_truth": _answer(task.data)},
                 "extra_info": {"index": task.data.idx}} for task in chosen]


def _answer(data: Any) -> str | None:
    answer = getattr(data, "answer", None)
    return None if answer is None else str(answer)


class VerifiersRowReward:
    """The reward of ``verifiers/*`` rows: 0. A verifiers environment's rewards are scored on the whole
    conversation by the environment (``Task.score``), which the text scorer cannot see."""

    data_sources: ClassVar[tuple[str, ...]] = (DATA_SOURCE, f"{DATA_SOURCE}/*")

    def __call__(self, response: str, ground_truth: Any, extra_info: dict[str, Any]) -> float:
        return 0.0
