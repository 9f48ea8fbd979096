"""``openenv`` (``verl.environments``): an OpenEnv server's ``reset``/``step``/``state`` as a verl environment.

One WebSocket session per trajectory (OpenEnv's ``/ws``: a fresh environment instance on the server for
each): :meth:`OpenEnvEnvironment.reset` opens it and resets the server's environment, each model turn
becomes one ``step`` action, the server's observation the next chat message and its reward the turn's
reward; the episode ends when the server says ``done``. :meth:`~OpenEnvEnvironment.close` ends the session.
The server is ``environment.url``, or one :mod:`verl_env_openenv.server` launches for the run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from verl_core.contracts import EnvironmentConfig, StepResult
from verl_env_kit import MultiTurnEnvironment

from verl_env_openenv import server

try:
    from openenv.core.generic_client import GenericEnvClient
except ImportError as exc:  # `verl plugins list --check` shows this, the run stops with it
    raise ImportError(f"the openenv environment needs OpenEnv's client ({exc}): pip install "
                      f"'verl-env-openenv[openenv]', or next to pinned packages `pip install --no-deps "
                      f"openenv-core==0.3.0` and pip install 'verl-env-openenv[openenv-client]'") from None

__all__ = ["OpenEnvConfig", "OpenEnvEnvironment", "ServerAnswerError"]

log = logging.getLogger(__name__)

#: A row field that is not in ``extra_info``: the text of the row's last user message.
PROMPT_FIELD = "prompt"
#: Fields of every OpenEnv action, never the one the model's text goes into.
_ACTION_BASE_FIELDS = {"metadata"}


class ServerAnswerError(RuntimeError):
    """The server answered a message with an error (``code``: OpenEnv's ``WSErrorCode``, e.g.
    ``VALIDATION_ERROR`` for an action it refuses, ``EXECUTION_ERROR`` for its environment raising,
    ``CAPACITY_REACHED`` for no free session)."""

    def __init__(self, code: str, message: str, details: Any = None) -> None:
        self.code, self.details = code, details
        super().__init__(f"{message} ({code})" + (f": {json.dumps(details, default=str)}" if details else ""))


class _Client(GenericEnvClient):
    """OpenEnv's dict client, raising :class:`ServerAnswerError` with the server's error code and details
    (its own raises a bare ``RuntimeError`` and drops the details, e.g. which action field was wrong)."""

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        await self._send(message)
        response = await self._receive()
        if response.get("type") == "error":
            data = response.get("data") or {}
            raise ServerAnswerError(str(data.get("code", "UNKNOWN")), str(data.get("message", "unknown error")),
                                    data.get("errors"))
        return response


@dataclass
class OpenEnvConfig(EnvironmentConfig):
    """``[environment]`` with ``name = "openenv"``.

    Attributes:
        url: a running OpenEnv server (``http://host:8000``; ``ws://`` too). Set this or ``launch``.
        launch: a server this run starts on localhost and stops at its end: an ASGI app
            ``"package.module:app"`` (served with uvicorn) or a command with ``{port}`` in it (it also gets
            ``$PORT``), e.g. ``"docker run --rm -p {port}:8000 my-env:latest"``.
        port: the launched server's port; 0 picks a free one.
        startup_timeout_s: how long a launched server has to answer ``/health``.
        max_restarts: how often a launched server that died is started again before the run stops.
        connect_timeout_s: opening a session (and the health check).
        message_timeout_s: one ``reset`` or ``step`` answer.
        retries: further attempts of a ``reset`` whose session could not be opened (a restarting server).
        action_field: the action field the model's text goes into; ``""`` finds it in the server's
            ``/schema`` (its one required string field).
        action_format: ``"text"`` (the turn's text is ``action_field``) or ``"json"`` (the turn is the whole
            action as a JSON object; one that does not parse is answered with an error, a tool error).
        observation_field: the observation field the model reads; ``""``: the one string field, else the
            observation as JSON.
        observation_role: the role of the server's observations in the chat (``user`` or ``tool``).
        prompt: ``"observation"`` (the row's system messages, then the reset observation as the user
            message) or ``"data"`` (the row's prompt as it is; the reset observation is not shown).
        reset_args: keyword arguments of every ``reset`` (``{difficulty = "easy"}``).
        reset_args_from_row: ``reset`` keyword -> row field: a key of the row's ``extra_info``,
            ``ground_truth``, or ``prompt`` (the last user message's text). The default ``seed = "index"``
            gives a row's ``rollout.n`` samples the same episode; a row without the field stops the run.
    """

    max_turns: int = 4
    url: str = ""
    launch: str = ""
    port: int = 0
    startup_timeout_s: float = 60.0
    max_restarts: int = 3
    connect_timeout_s: float = 10.0
    message_timeout_s: float = 60.0
    retries: int = 2
    action_field: str = ""
    action_format: str = "text"
    observation_field: str = ""
    observation_role: str = "user"
    prompt: str = "observation"
    reset_args: dict[str, Any] = field(default_factory=dict)
    reset_args_from_row: dict[str, str] = field(default_factory=lambda: {"seed": "index", "prompt": PROMPT_FIELD})

    def validate(self) -> None:
        super().validate()
        if bool(self.url) == bool(self.launch):
            raise ValueError("url: set exactly one of environment.url and environment.launch: url = \"http://host:8000\" for "
                             "a running OpenEnv server, or launch = \"my_env.server.app:app\" (or a command with "
                             "{port}) for one this run starts (e.g. the example: launch = "
                             "\"verl_env_openenv.examples.addition:app\")")
        if self.url and not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"url: {self.url!r} is not an http(s):// or ws(s):// URL")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a port (0 picks a free one)")
        for name in ("startup_timeout_s", "connect_timeout_s", "message_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds")
        if self.retries < 0 or self.max_restarts < 0:
            raise ValueError("retries: environment.retries and environment.max_restarts must be >= 0")
        for name, allowed in (("action_format", ("text", "json")), ("observation_role", ("user", "tool")),
                              ("prompt", ("observation", "data"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {list(allowed)}")
        if not isinstance(self.reset_args, dict):
            raise ValueError("reset_args: must be a table of reset keyword arguments")
        if not isinstance(self.reset_args_from_row, dict) or not all(
                isinstance(v, str) and v for v in self.reset_args_from_row.values()):
            raise ValueError("reset_args_from_row: must map reset keywords to row fields, "
                             "e.g. {seed = \"index\"}")


class OpenEnvEnvironment(MultiTurnEnvironment):
    """A trajectory is one episode of the OpenEnv server's environment, in its own session.

    A turn the server refuses as an action (its validation error) is answered with the error and counted
    as a tool error; the episode goes on. A failing ``step`` on the server, a lost session or a timeout
    ends the trajectory (a tool error, reward 0). A ``reset`` that fails stops the run's step, with the
    setting to fix.
    """

    Config: ClassVar[type[EnvironmentConfig]] = OpenEnvConfig
    # `verl run --env openenv environment.launch=verl_env_openenv.examples.addition:app` trains the built-in
    # model on the example server. The reward is the server's: the data's own reward (arithmetic, by
    # data_source) gets weight 0, so the two do not add up.
    task: ClassVar[dict[str, dict[str, Any]]] = {
        "data": {"train": "builtin:addition"},
        "reward": {"components": [{"name": "arithmetic", "weight": 0.0}]},
    }

    def __init__(self, config: OpenEnvConfig | None = None) -> None:
        super().__init__(config)
        self._client: Any = None
        self._url = ""
        self._action_field = ""
        self._done = True

    # -- the session --------------------------------------------------------------------------------

    def _timeout(self) -> float:
        return self.config.connect_timeout_s + self.config.message_timeout_s

    def _reset_kwargs(self, prompt: list[dict[str, Any]], extra_info: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(self.config.reset_args)
        for keyword, source in self.config.reset_args_from_row.items():
            if source == PROMPT_FIELD:
                users = [m for m in prompt if m.get("role") == "user"]
                kwargs[keyword] = _text_of(users[-1].get("content")) if users else ""
            elif extra_info.get(source) is not None:
                kwargs[keyword] = extra_info[source]
            else:
                raise ValueError(f"environment.reset_args_from_row: reset argument {keyword!r} comes from the row "
                                 f"field {source!r}, which this row does not have (its extra_info: "
                                 f"{sorted(extra_info)}); add it to the data, or drop {keyword!r} from "
                                 f"environment.reset_args_from_row (= {{}} passes none)")
        return kwargs

    def _open(self) -> Any:
        """A connected client in a new session; retried while the server cannot be reached."""
        attempts = self.config.retries + 1
        for attempt in range(attempts):
            self._url = server.server_url(self.config)
            client = _Client(base_url=self._url, connect_timeout_s=self.config.connect_timeout_s,
                                      message_timeout_s=self.config.message_timeout_s)
            try:
                server.run(client.connect(), self._timeout())
                return client
            except (ConnectionError, OSError, TimeoutError) as exc:
                if attempt + 1 == attempts:
                    server.check_reachable(self._url, self.config)  # names the setting when it is down
                    raise server.ServerError(f"openenv: no session could be opened at {self._url} after "
                                             f"{attempts} attempts (environment.retries = {self.config.retries}): "
                                             f"{exc}") from None
                time.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    def reset(self, *, prompt: list[dict[str, Any]], extra_info: dict[str, Any]) -> list[dict[str, Any]]:
        kwargs = self._reset_kwargs(prompt, extra_info)
        self.close()  # a second reset starts a new session
        self._client = self._open()
        self._action_field = self._find_action_field()
        try:
            result = server.run(self._client.reset(**kwargs), self._timeout())
        except ServerAnswerError as exc:
            self.close()
            raise RuntimeError(f"openenv: the server at {self._url} failed to reset: {exc}; with reset "
                               f"arguments {kwargs} (environment.reset_args, environment.reset_args_from_row)"
                               + _CAPACITY_FIX * (exc.code == "CAPACITY_REACHED")) from None
        except TimeoutError as exc:
            self.close()
            raise TimeoutError(f"openenv: reset at {self._url}: {exc} (environment.message_timeout_s)") from None
        self._done = bool(result.done)
        if self.config.prompt == "data":
            return list(prompt)
        system = [m for m in prompt if m.get("role") == "system"]
        return [*system, {"role": "user", "content": self._observation_text(result.observation)}]

    def step(self, response: str) -> StepResult:
        if self._client is None or self._done:  # after the episode ended, or before reset: answered, never raised
            return StepResult(observation=None, reward=0.0, done=True, info={"error": "no episode in progress"})
        action = self._action(response)
        if isinstance(action, str):  # the turn is not an action: tell the model, as a tool's error would
            return self._refused(action)
        try:
            result = server.run(self._client.step(action), self._timeout())
        except ServerAnswerError as exc:
            if exc.code == "VALIDATION_ERROR":
                return self._refused(f"the environment refused the action: {exc}")
            return self._failed(f"the server's step failed: {exc}")
        except Exception as exc:  # noqa: BLE001 - a lost session, a dead server, no answer: this trajectory's end
            return self._failed(f"the session ended: {type(exc).__name__}: {exc}")
        self._done = bool(result.done)
        # The server's reward as it came: a bool counts as 0/1; anything but a number is left for the core's
        # check to refuse (naming this environment), never guessed into one.
        reward = 0.0 if result.reward is None else result.reward
        reward = float(reward) if isinstance(reward, bool) else reward
        if self._done:
            return StepResult(observation=None, reward=reward, done=True)
        text = self._observation_text(result.observation)
        return StepResult(observation=[{"role": self.config.observation_role, "content": text}], reward=reward,
                          done=False)

    def state(self) -> dict[str, Any]:
        """The server's ``state`` of this episode (``episode_id``, ``step_count`` and the environment's own)."""
        if self._client is None:
            raise RuntimeError("openenv: state() before reset(): no session is open")
        return server.run(self._client.state(), self._timeout())

    def close(self) -> None:
        client, self._client, self._done = self._client, None, True
        if client is not None:
            try:
                server.run(client.close(), self.config.connect_timeout_s)
            except Exception as exc:  # noqa: BLE001 - the session is gone either way
                log.debug("openenv: closing the session at %s: %s", self._url, exc)

    # -- actions and observations ---------------------------------------------------------------------

    def _find_action_field(self) -> str:
        if self.config.action_field or self.config.action_format == "json":
            return self.config.action_field
        action = server.schema(self._url, self.config.connect_timeout_s).get("action") or {}
        props = {k: v for k, v in (action.get("properties") or {}).items() if k not in _ACTION_BASE_FIELDS}
        strings = [k for k, v in props.items() if v.get("type") == "string"]
        required = [k for k in action.get("required") or [] if k in props]
        candidates = [k for k in required if k in strings] or (strings if len(strings) == 1 else [])
        if len(candidates) == 1 and set(required) <= set(candidates):
            return candidates[0]
        raise ValueError(f"environment.action_field: the server's action ({action.get('title', 'Action')}) has "
                         f"fields {sorted(props)} (required: {required}), so which one the model's text goes into "
                         f"is not clear: name it (environment.action_field = \"...\"), or set "
                         f"environment.action_format = \"json\" to have the model write the whole action")

    def _action(self, response: str) -> dict[str, Any] | str:
        """The action for ``response``, or why there is none."""
        if self.config.action_format == "text":
            return {self._action_field: response}
        text = response.strip()
        if text.startswith("```"):  # a fenced block: its body
            text = text.strip("`").removeprefix("json").strip()
        try:
            action = json.loads(text)
        except ValueError as exc:
            return f"the action must be a JSON object ({exc})"
        if not isinstance(action, dict):
            return f"the action must be a JSON object, not {type(action).__name__}"
        return action

    def _observation_text(self, observation: Any) -> str:
        if not isinstance(observation, dict):
            return _text_of(observation)
        name = self.config.observation_field
        if name:
            if name not in observation:
                raise ValueError(f"environment.observation_field: the server's observation has no field {name!r}; "
                                 f"its fields: {sorted(observation)}")
            return _text_of(observation[name])
        strings = [v for v in observation.values() if isinstance(v, str)]
        if len(strings) == 1:
            return strings[0]
        return json.dumps(observation, sort_keys=True, default=str)

    def _refused(self, why: str) -> StepResult:
        return StepResult(observation=[{"role": self.config.observation_role, "content": f"error: {why}"}],
                          reward=0.0, done=False, info={"tool_error": True})

    def _failed(self, why: str) -> StepResult:
        log.warning("openenv: a trajectory ends: %s (server %s)", why, self._url)
        self.close()
        return StepResult(observation=None, reward=0.0, done=True, info={"tool_error": True, "error": why})


_CAPACITY_FIX = ("; every trajectory of a step holds a session until it ends (data.batch_size x rollout.n of them): "
                 "raise the server's max_concurrent_envs (create_app(..., max_concurrent_envs=N)) or lower "
                 "data.batch_size / rollout.n")


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # chat content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return json.dumps(content, sort_keys=True, default=str)
