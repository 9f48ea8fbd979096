"""Conformance tests for :class:`~verl_core.contracts.Environment` implementations.

Subclass :class:`EnvironmentConformance` and provide the fixtures:

* ``environment``: a factory returning a new environment (one per trajectory, as the episode runner
  makes them), e.g. ``lambda: MyEnv(MyEnv.Config())``;
* ``task_row``: a prompt row as the data gives it (``{"prompt": [messages], "extra_info": {...},
  "ground_truth": ...}``);
* ``responses`` (optional): model turns to step with; the default has a plausible answer, an empty
  turn and garbage, since a policy early in training writes all three.

Each value is checked with the core's own boundary checks (:mod:`verl_core.boundary`), so an
environment that passes here is not stopped by them in a run. ``reset``, ``step`` and ``close`` may be
coroutines, as the multi-turn loop allows. The class must have an episode runner
(:meth:`~verl_core.contracts.Environment.run_episodes`): subclassing ``verl_env_kit.MultiTurnEnvironment``
gives it one.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable

import pytest

from verl_core.boundary import check_messages, check_step_result
from verl_core.contracts import Environment, EnvironmentConfig

__all__ = ["EnvironmentConformance"]


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    out = fn(*args, **kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


class EnvironmentConformance:
    """Contract tests every environment must pass."""

    #: Model turns :meth:`test_step_returns_a_valid_result_for_any_turn` steps with, one episode each.
    default_responses = ("The answer is 4.", "", "}}}{{ <tool_call>not json</tool_call> \x00\ufffd")

    @pytest.fixture
    def environment(self) -> Callable[[], Environment]:
        pytest.fail(f"{type(self).__name__} must provide an `environment` fixture (a factory)")

    @pytest.fixture
    def task_row(self) -> dict[str, Any]:
        pytest.fail(f"{type(self).__name__} must provide a `task_row` fixture")

    @pytest.fixture
    def responses(self) -> tuple[str, ...]:
        return self.default_responses

    def _reset(self, env: Environment, row: dict[str, Any]) -> list[dict[str, Any]]:
        extra = {**(row.get("extra_info") or {}), "ground_truth": row.get("ground_truth")}
        return _call(env.reset, prompt=list(row["prompt"]), extra_info=extra)

    def test_is_an_environment_with_a_config(self, environment: Callable[[], Environment]) -> None:
        env = environment()
        try:
            assert isinstance(env, Environment), f"{type(env).__name__} does not subclass Environment"
            assert isinstance(env.config, EnvironmentConfig), "config must be an EnvironmentConfig (or a subclass)"
            env.config.validate()
            assert isinstance(type(env).task, dict), "task must be a dict of config sections"
        finally:
            _call(env.close)

    def test_has_an_episode_runner(self, environment: Callable[[], Environment]) -> None:
        """A run calls the class's run_episodes; the core's own raises (the loop lives in verl-env-kit)."""
        env = environment()
        try:
            runner = getattr(type(env).run_episodes, "__func__", None)
            assert runner is not None and runner is not Environment.run_episodes.__func__, (
                f"{type(env).__name__} has no episode runner: subclass verl_env_kit.MultiTurnEnvironment "
                f"(pip install verl-env-kit) instead of verl_core.contracts.Environment")
        finally:
            _call(env.close)

    def test_reset_returns_chat_messages(self, environment: Callable[[], Environment],
                                         task_row: dict[str, Any]) -> None:
        env = environment()
        try:
            messages = check_messages(self._reset(env, task_row), source=type(env).__name__, where="from reset()")
            assert messages, "reset() returned no message: the policy would see an empty prompt"
        finally:
            _call(env.close)

    def test_step_returns_a_valid_result_for_any_turn(self, environment: Callable[[], Environment],
                                                       task_row: dict[str, Any], responses: tuple[str, ...]) -> None:
        """Every turn, garbage included, gets a well-typed StepResult (a bad turn is the environment's
        to answer, with an error observation or a done, never an exception the run must absorb)."""
        for response in responses:
            env = environment()
            try:
                self._reset(env, task_row)
                for turn in range(env.config.max_turns):
                    result = check_step_result(_call(env.step, response), source=type(env).__name__,
                                               where=f"from step({response!r}), turn {turn + 1}")
                    if result.done or not result.observation:
                        break
            finally:
                _call(env.close)

    def test_close_can_be_called_after_any_point(self, environment: Callable[[], Environment],
                                                 task_row: dict[str, Any]) -> None:
        """The episode runner closes every environment it made, whether reset ran, a step raised or the
        episode ended; closing twice must not fail either."""
        env = environment()
        _call(env.close)  # never reset
        env = environment()
        self._reset(env, task_row)
        _call(env.close)
        _call(env.close)

    def test_tools_are_valid_function_schemas(self, environment: Callable[[], Environment]) -> None:
        env = environment()
        try:
            tools = env.tools()
        finally:
            _call(env.close)
        if tools is None:
            return
        assert isinstance(tools, list) and tools, "tools() returns None or a non-empty list of schemas"
        names = []
        for tool in tools:
            assert tool.get("type") == "function", f"a tool schema has type 'function': {tool}"
            fn = tool.get("function") or {}
            assert isinstance(fn.get("name"), str) and fn["name"], f"a tool needs a name: {tool}"
            assert isinstance(fn.get("description", ""), str)
            params = fn.get("parameters", {"type": "object"})
            assert params.get("type") == "object", f"{fn['name']}: parameters must be a JSON schema object"
            assert set(params.get("required", [])) <= set(params.get("properties", {})), (
                f"{fn['name']}: a required parameter is not among its properties")
            names.append(fn["name"])
        assert len(names) == len(set(names)), f"tool names repeat: {names}"
