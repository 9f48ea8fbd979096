"""A second OpenEnv server, written in the test with OpenEnv's server API and started as a command
(``python echo_server.py --port {port}``): its action has two string fields, its observation two too."""

import argparse
import os

import uvicorn
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class EchoAction(Action):
    message: str
    tone: str = "plain"


class EchoObservation(Observation):
    echoed: str = ""
    tone: str = ""


class EchoEnvironment(Environment):
    """Echoes the message; ``done`` after ``turns`` steps; reward = the message's length / 10."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self._turns = 2

    def reset(self, seed=None, episode_id=None, turns: int = 2) -> EchoObservation:
        self._state, self._turns = State(step_count=0), turns
        return EchoObservation(echoed="say something", tone="plain")

    def step(self, action: EchoAction, **kwargs) -> EchoObservation:  # type: ignore[override]
        self._state.step_count += 1
        if action.message == "crash":
            raise RuntimeError("the echo environment was asked to crash")
        return EchoObservation(echoed=action.message, tone=action.tone, reward=len(action.message) / 10,
                               done=self._state.step_count >= self._turns)

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation, max_concurrent_envs=64)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
