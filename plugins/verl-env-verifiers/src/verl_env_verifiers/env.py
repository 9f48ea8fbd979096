"""``verifiers`` (``verl.environments``): a verifiers 0.4 environment's tasks, tools, stops and rewards as a
verl environment (``verl run --env verifiers environment.id=<env-id> environment.args='{...}'``).

One trajectory is one task of the taskset (the row's ``extra_info.index``, rows from
:class:`verl_env_verifiers.data.VerifiersData`). The model's turns are sampled by verl's agent loop; a turn
with hermes tool calls (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) is answered with the
task's tools' outputs, a turn without one is the answer. The episode ends there, when a ``@vf.stop``
predicate of the task says so, or at ``environment.max_turns``; then ``Task.score`` scores the trace and
its weighted sum is the trajectory's reward (each component in ``StepResult.info["rewards"]``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from verl_core.contracts import EnvironmentConfig, StepResult
from verl_env_kit import MultiTurnEnvironment
from verl_env_tools.parsing import ToolCallError, parse_hermes

from verl_env_verifiers import tasks

__all__ = ["VerifiersConfig", "VerifiersEnvironment"]

log = logging.getLogger(__name__)


@dataclass
class VerifiersConfig(EnvironmentConfig):
    """``[environment]`` with ``name = "verifiers"``.

    Attributes:
        id: the verifiers environment (taskset) id: an installed module exporting a ``vf.Taskset`` subclass
            (``my-env`` imports ``my_env``; a hub id ``owner/my-env@1.0`` is installed as ``my_env``).
        args: the taskset's config fields (its ``TasksetConfig`` subclass), e.g. ``{size = 200}``.
    """

    id: str = ""
    args: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        super().validate()
        if not self.id or not isinstance(self.id, str):
            raise ValueError("id: name the verifiers environment to run, environment.id = \"<env-id>\" (an "
                             "installed package exporting a vf.Taskset)")
        if not isinstance(self.args, dict):
            raise ValueError(f"args: must be a table of the environment's config fields (environment.args = "
                             f"'{{\"size\": 100}}'), not {type(self.args).__name__}")
        tasks.check_installed(self.id)


class VerifiersEnvironment(MultiTurnEnvironment):
    """A trajectory is one task of a verifiers taskset, scored by the task's own rewards.

    A malformed tool call is answered with the error (a tool error, counted in ``env/tool_errors``) and
    the episode goes on. A reward function that raises ends the trajectory with a NaN reward and an error
    naming the environment and the row, so ``reward.on_invalid`` stops the run (default) or drops the row:
    it never trains on a made-up 0.
    """

    Config: ClassVar[type[EnvironmentConfig]] = VerifiersConfig
    #: The data follows environment.id (:meth:`task_for`).
    task: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def task_for(cls, section: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The taskset's tasks are the data: ``data.train = "verifiers:<id>{args}"``."""
        env_id, args = section.get("id"), section.get("args") or {}
        if not env_id or not isinstance(env_id, str) or not isinstance(args, Mapping):
            return {}  # the config's validate() names what is missing
        return {"data": {"train": f"verifiers:{env_id}{json.dumps(dict(args), sort_keys=True) if args else ''}"}}

    def __init__(self, config: VerifiersConfig | None = None) -> None:
        super().__init__(config)
        self._task: Any = None
        self._tools: tasks.Tools | None = None
        self._messages: list[dict[str, Any]] = []
        self._calls: dict[int, list[Any]] = {}
        self._first_turn = 0
        self._index: Any = None
        self._done = True

    def reset(self, *, prompt: list[dict[str, Any]], extra_info: dict[str, Any]) -> list[dict[str, Any]]:
        taskset = tasks.load(self.config.id, self.config.args)
        self._index = extra_info.get("index")
        self._task = taskset.task(self._index)
        toolsets = [*type(self._task).toolsets(self._task.config), *taskset.shared_toolsets]
        self._tools = tasks.Tools(toolsets) if toolsets else None
        self._messages = list(prompt) or tasks.prompt_messages(self._task.data)
        self._first_turn, self._calls, self._done = len(self._messages), {}, False
        return list(self._messages)

    def tools(self) -> list[dict[str, Any]] | None:
        return self._tools.schemas if self._tools else None

    def step(self, response: str) -> StepResult:
        if self._done:
            return StepResult(observation=None, reward=0.0, done=True, info={"error": "no episode in progress"})
        self._messages.append({"role": "assistant", "content": response})
        turns = sum(m["role"] == "assistant" for m in self._messages[self._first_turn:])
        observation, tool_error = self._answer_tools(response)
        stop = tasks.run(tasks.stopped(self._task, self._trace()))
        if observation and not stop and turns < self.config.max_turns:
            self._messages += observation
            return StepResult(observation=observation, reward=0.0, done=False, info={"tool_error": tool_error})
        return self._score(tool_error)

    def close(self) -> None:
        self._done, self._tools = True, None

    # -- turns ---------------------------------------------------------------------------------------------

    def _answer_tools(self, response: str) -> tuple[list[dict[str, Any]], bool]:
        """The tool messages answering the turn's calls ([] for a turn without one) and whether one failed."""
        if self._tools is None:
            return [], False
        try:
            calls = parse_hermes(response)
        except ToolCallError as exc:  # the model's malformed call: it reads why, as a tool's error
            return [{"role": "tool", "content": f"error: {exc}"}], True
        self._calls[len(self._messages) - 1] = calls
        answers = [self._tools.call(c.name, c.arguments) for c in calls]
        return [{"role": "tool", "content": text} for text, _ in answers], any(err for _, err in answers)

    def _trace(self) -> Any:
        return tasks.trace_of(self._task, self._messages, self._calls, self._first_turn)

    def _score(self, tool_error: bool) -> StepResult:
        self._done = True
        try:
            rewards = tasks.run(tasks.score(self._task, self._trace()))
        except Exception as exc:  # noqa: BLE001 - a reward function raising: named, and never scored as 0
            cause = exc.__cause__ or exc
            why = (f"verifiers environment {self.config.id!r}: scoring the row with extra_info.index = {self._index} "
                   f"({type(self._task).__name__}) failed: {type(cause).__name__}: {cause}")
            log.error("%s", why)
            return StepResult(observation=None, reward=math.nan, done=True,
                              info={"error": why, "tool_error": tool_error})
        total = sum(score * weight for score, weight in rewards.values())
        return StepResult(observation=None, reward=total, done=True,
                          info={"tool_error": tool_error, "rewards": {k: s for k, (s, _) in rewards.items()}})
