"""An OpenEnv environment: add two numbers, with retries. Nothing verl in it: an OpenEnv server as any is.

Serve it with ``uvicorn verl_env_openenv.examples.addition:app --port 8000`` (or let verl start it:
``verl run --env openenv environment.launch=verl_env_openenv.examples.addition:app``).

* ``reset(seed=None, prompt=None, attempts=1)``: the question is ``prompt`` when it reads ``a+b=``
  (a verl row's prompt, passed by the adapter's default ``reset_args_from_row``), else two numbers of
  10..99 drawn with ``seed``. The observation's ``text`` is the question.
* ``step(AdditionAction(answer=...))``: reward 1.0 and ``done`` for the sum; a wrong answer gets
  reward 0.0 and, while attempts are left, ``text = "wrong, try again: a+b="``; else ``done``.

``$OPENENV_MAX_SESSIONS`` (default 4096) caps the concurrent sessions: a verl step holds one per
trajectory.
"""

from __future__ import annotations

import os
import random
import re
import uuid
from typing import Any, Optional

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

__all__ = ["AdditionAction", "AdditionEnvironment", "AdditionObservation", "app"]

_QUESTION = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*=\s*$")


class AdditionAction(Action):
    """The answer, as the model wrote it."""

    answer: str = Field(..., description="the sum, as text")


class AdditionObservation(Observation):
    """What the model reads next: the question, or the verdict on a wrong answer."""

    text: str = Field(default="", description="the question, or 'wrong, try again: ...'")
    attempts_left: int = Field(default=0, description="answers still allowed")


class AdditionEnvironment(Environment):
    """One question per episode; its state counts the steps."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance: no shared state

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)
        self._a = self._b = 0
        self._attempts_left = 0

    async def reset_async(self, seed: Optional[int] = None, episode_id: Optional[str] = None,
                          prompt: Optional[str] = None, attempts: int = 1) -> AdditionObservation:
        return self.reset(seed=seed, episode_id=episode_id, prompt=prompt, attempts=attempts)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, prompt: Optional[str] = None,
              attempts: int = 1) -> AdditionObservation:
        match = _QUESTION.match(prompt or "")
        if match:
            self._a, self._b = int(match.group(1)), int(match.group(2))
        else:
            rng = random.Random(seed)
            self._a, self._b = rng.randint(10, 99), rng.randint(10, 99)
        self._attempts_left = max(1, int(attempts))
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0, question=self.question)
        return AdditionObservation(text=self.question, attempts_left=self._attempts_left, reward=0.0)

    @property
    def question(self) -> str:
        return f"{self._a}+{self._b}="

    async def step_async(self, action: AdditionAction, timeout_s: Any = None, **kwargs: Any) -> AdditionObservation:
        return self.step(action)

    def step(self, action: AdditionAction, timeout_s: Any = None, **kwargs: Any) -> AdditionObservation:  # type: ignore[override]
        self._state.step_count += 1
        self._attempts_left -= 1
        if action.answer.strip() == str(self._a + self._b):
            return AdditionObservation(text="correct", attempts_left=self._attempts_left, reward=1.0, done=True)
        done = self._attempts_left <= 0
        text = "wrong" if done else f"wrong, try again: {self.question}"
        return AdditionObservation(text=text, attempts_left=self._attempts_left, reward=0.0, done=done)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(AdditionEnvironment, AdditionAction, AdditionObservation,
                         max_concurrent_envs=int(os.environ.get("OPENENV_MAX_SESSIONS", "4096")))
