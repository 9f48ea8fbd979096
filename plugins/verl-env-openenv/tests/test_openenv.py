"""The openenv environment against real OpenEnv servers on localhost: the package's example (an ASGI app
verl launches) and a server written here with OpenEnv's server API (a command, or a URL we start)."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("openenv.core", reason="pip install --no-deps openenv-core==0.3.0 && "
                                           "pip install 'verl-env-openenv[openenv-client]'")

from verl_core.registry import PluginRegistry  # noqa: E402
from verl_core.testing import EnvironmentConformance  # noqa: E402

from verl_env_openenv import server  # noqa: E402
from verl_env_openenv.env import OpenEnvConfig, OpenEnvEnvironment  # noqa: E402

EXAMPLE = "verl_env_openenv.examples.addition:app"
ECHO_SERVER = Path(__file__).with_name("echo_server.py")
ROW = {"prompt": [{"role": "user", "content": "25+60="}], "ground_truth": "85", "extra_info": {"index": 0}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
        return True
    except OSError:
        return False


def _reset(env, row=ROW):
    return env.reset(prompt=row["prompt"], extra_info={**row["extra_info"], "ground_truth": row["ground_truth"]})


@pytest.fixture(scope="module", autouse=True)
def _stop_launched_servers():
    yield
    server.close_servers()


@pytest.fixture(scope="module")
def echo_url():
    """The echo server, started by the test itself: what `environment.url` points at."""
    port = _free_port()
    # Its log is dropped: OpenEnv's server prints a traceback for every session a client closes abruptly.
    proc = subprocess.Popen([sys.executable, str(ECHO_SERVER), "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _answers(port):
            assert proc.poll() is None and time.monotonic() < deadline, "the echo server did not start"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class TestOpenEnvConformance(EnvironmentConformance):
    """The example server through the adapter, loaded as `verl run --env openenv` loads it."""

    default_responses = ("85", "84", *EnvironmentConformance.default_responses)

    @pytest.fixture
    def environment(self):
        cls = PluginRegistry().load("environment", "openenv")
        return lambda: cls(cls.Config(launch=EXAMPLE, reset_args={"attempts": 2}))

    @pytest.fixture
    def task_row(self):
        return ROW


def test_an_episode_is_reset_steps_and_state_of_the_server():
    env = OpenEnvEnvironment(OpenEnvConfig(launch=EXAMPLE, reset_args={"attempts": 2}))
    try:
        assert _reset(env) == ROW["prompt"]  # the server's observation: the row's question, passed as `prompt`
        wrong = env.step("84")
        assert (wrong.observation, wrong.reward, wrong.done) == ([{"role": "user", "content": "wrong, try again: 25+60="}],
                                                                 0.0, False)
        assert env.state()["step_count"] == 1 and env.state()["question"] == "25+60="
        right = env.step(" 85 ")
        assert (right.observation, right.reward, right.done) == (None, 1.0, True)
        assert env.step("85").done  # after the end: answered, never raised
    finally:
        env.close()
        env.close()


def test_a_rows_samples_share_one_episode_and_rows_differ():
    """The default reset_args_from_row passes seed = extra_info.index: GRPO's group sees one task."""
    row = {"prompt": [{"role": "system", "content": "Answer."}, {"role": "user", "content": "play"}],
           "ground_truth": None, "extra_info": {"index": 7}}
    questions = []
    for index in (7, 7, 8):
        env = OpenEnvEnvironment(OpenEnvConfig(launch=EXAMPLE))
        try:
            messages = _reset(env, {**row, "extra_info": {"index": index}})
            assert messages[0] == {"role": "system", "content": "Answer."}  # the row's system prompt is kept
            questions.append(messages[1]["content"])
        finally:
            env.close()
    assert questions[0] == questions[1] != questions[2]
    env = OpenEnvEnvironment(OpenEnvConfig(launch=EXAMPLE))
    with pytest.raises(ValueError, match=r"reset_args_from_row.*'index'"):
        _reset(env, {**row, "extra_info": {}})


def test_prompt_data_keeps_the_rows_prompt():
    env = OpenEnvEnvironment(OpenEnvConfig(launch=EXAMPLE, prompt="data", reset_args_from_row={"seed": "index"}))
    try:
        row = {**ROW, "prompt": [{"role": "user", "content": "what is it?"}]}
        assert _reset(env, row) == row["prompt"]
    finally:
        env.close()


def test_a_server_at_a_url_with_a_two_field_action(echo_url):
    # No action_field: the text goes into the action's one required string field (message; tone has a default).
    env = OpenEnvEnvironment(OpenEnvConfig(url=echo_url, observation_field="echoed", reset_args={"turns": 2}))
    try:
        assert _reset(env) == [{"role": "user", "content": "say something"}]
        first = env.step("hello")
        assert (first.observation, first.reward, first.done) == ([{"role": "user", "content": "hello"}], 0.5, False)
        assert env.step("bye").reward == pytest.approx(0.3) and env.state()["step_count"] == 2
    finally:
        env.close()


def test_json_actions_refused_actions_and_a_failing_step_are_tool_errors(echo_url):
    env = OpenEnvEnvironment(OpenEnvConfig(url=echo_url, action_format="json", observation_role="tool",
                                           reset_args={"turns": 3}))
    try:
        # Two string fields: no observation_field, so the model reads the observation as JSON.
        assert json.loads(_reset(env)[0]["content"]) == {"echoed": "say something", "tone": "plain"}
        garbage = env.step("not json")
        assert garbage.info == {"tool_error": True} and "JSON object" in garbage.observation[0]["content"]
        refused = env.step('{"tone": "loud"}')  # no message: the server's validation says so, to the model
        assert refused.info == {"tool_error": True} and not refused.done
        assert refused.observation[0]["role"] == "tool" and "message" in refused.observation[0]["content"]
        ok = env.step('```json\n{"message": "hi", "tone": "loud"}\n```')
        assert json.loads(ok.observation[0]["content"]) == {"echoed": "hi", "tone": "loud"} and ok.reward == 0.2
        crashed = env.step('{"message": "crash"}')  # the server's environment raised: this trajectory ends
        assert crashed.done and crashed.info["tool_error"] and "asked to crash" in crashed.info["error"]
    finally:
        env.close()


def test_a_launched_command_gets_its_port_and_is_stopped_at_close():
    port = _free_port()
    config = OpenEnvConfig(launch=f"{sys.executable} {ECHO_SERVER} --port {{port}}", port=port,
                           action_field="message")
    env = OpenEnvEnvironment(config)
    try:
        _reset(env)
        assert _answers(port)
    finally:
        env.close()
    server.close_servers()
    assert not _answers(port)


def test_a_launched_server_that_died_is_restarted_and_its_trajectory_ends():
    config = OpenEnvConfig(launch=EXAMPLE, reset_args={"attempts": 3}, max_restarts=1)
    env = OpenEnvEnvironment(config)
    try:
        _reset(env)
        launched = server._servers[(EXAMPLE, 0)]
        os.killpg(launched.proc.pid, signal.SIGKILL)  # the server and its guard, as a crash would
        launched.proc.wait()
        lost = env.step("1")
        assert lost.done and lost.info["tool_error"] and "session ended" in lost.info["error"]
        assert _reset(env) == ROW["prompt"] and env.step("85").reward == 1.0  # the next reset restarted it
        assert launched.restarts == 1
    finally:
        env.close()
    os.killpg(launched.proc.pid, signal.SIGKILL)
    launched.proc.wait()
    with pytest.raises(server.ServerError, match=r"died 2 times \(environment.max_restarts = 1\)"):
        _reset(OpenEnvEnvironment(config))


def test_a_launched_server_does_not_outlive_a_killed_run(tmp_path):
    port = _free_port()
    script = textwrap.dedent(f"""
        from verl_env_openenv import server
        from verl_env_openenv.env import OpenEnvConfig
        print(server.server_url(OpenEnvConfig(launch={EXAMPLE!r}, port={port})), flush=True)
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no close: only the guard is left to stop it
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == f"http://127.0.0.1:{port}", res.stderr[-2000:]
    deadline = time.monotonic() + 15
    while _answers(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _answers(port)


def test_errors_name_the_setting_and_the_fix():
    with pytest.raises(ValueError, match="set exactly one of environment.url and environment.launch"):
        OpenEnvConfig().validate()
    with pytest.raises(ValueError, match="set exactly one"):
        OpenEnvConfig(url="http://x", launch=EXAMPLE).validate()
    with pytest.raises(ValueError, match="action_format: 'yaml'"):
        OpenEnvConfig(url="http://x", action_format="yaml").validate()
    dead = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(server.ServerError, match=r"environment.url: no OpenEnv server answers at .*environment.launch"):
        _reset(OpenEnvEnvironment(OpenEnvConfig(url=dead, retries=0, connect_timeout_s=1)))
    exits = OpenEnvEnvironment(OpenEnvConfig(launch=f"{sys.executable} -c 'import sys; print(\"no\"); sys.exit(3)'"))
    with pytest.raises(server.ServerError, match=r"exited with code 3 .*its log .*\n.*no"):
        _reset(exits)


def _verl_run_on_the_example(tmp_path, port, *overrides):
    """`verl run --env openenv` on the launched example server through the CLI; its metrics, step by step."""
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "verl_cli", "run", "--env", "openenv", "--output-dir", str(out),
                          f"environment.launch={EXAMPLE}", f"environment.port={port}", "run.save_every=0", *overrides],
                         capture_output=True, text=True, timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "run completed at step" in res.stdout + res.stderr
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_verl_run_env_openenv_trains_two_steps_and_stops_its_server(tmp_path):
    port = _free_port()
    steps = _verl_run_on_the_example(tmp_path, port, "run.max_steps=2", "data.max_val_samples=50")
    trained = [m for m in steps if "env/reward_mean" in m]
    assert [m["step"] for m in trained] == [1, 2]
    for m in trained:  # the reward is the server's alone: the text's arithmetic reward has weight 0
        assert m["reward/mean"] == pytest.approx(m["env/reward_mean"]) and m["env/tool_errors"] == 0
    assert not _answers(port)  # the launched server ended with the run


@pytest.mark.heavy
@pytest.mark.long  # ~3.5 min; CI keeps the real-server tests, the 2-step run and the MCP learning test
def test_the_built_in_model_learns_from_the_example_server(tmp_path):
    """The README's figure: validation reward 0.234 -> 0.356 in 40 steps (~2.5 min on 2 CPU cores)."""
    port = _free_port()
    steps = _verl_run_on_the_example(tmp_path, port, "run.max_steps=40", "run.val_every=20")
    val = {m["step"]: m["val/reward_mean"] for m in steps if "val/reward_mean" in m}
    assert val[40] >= val[0] + 0.06, val
    assert sum(m.get("env/tool_errors", 0) for m in steps) == 0
    assert not _answers(port)
