"""MCP servers' tools in the tools environment: a real server (tests/mcp_server.py) over stdio and HTTP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("mcp")

from verl_core.testing import EnvironmentConformance  # noqa: E402
from verl_env_tools.env import ToolsConfig, ToolsEnvironment  # noqa: E402
from verl_env_tools.mcp_tools import close_servers  # noqa: E402

SERVER = str(Path(__file__).with_name("mcp_server.py"))
STDIO = [{"command": sys.executable, "args": [SERVER]}]


def _call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _server_pids() -> list[int]:
    """Live (not zombie) processes running the test server."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if SERVER.encode() in cmdline and state != "Z":
            pids.append(int(entry))
    return pids


def _wait_gone(pids: list[int], within: float = 15.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and set(pids) & set(_server_pids()):
        time.sleep(0.1)
    return sorted(set(pids) & set(_server_pids()))


@pytest.fixture
def env():
    config = ToolsConfig(tools=["calculator"], mcp_servers=STDIO, wall_s=2.0, max_output=50)
    config.validate()
    e = ToolsEnvironment(config)
    e.reset(prompt=[{"role": "user", "content": "x"}], extra_info={})
    yield e
    e.close()
    close_servers()


def test_schemas_reach_the_chat_template(env: ToolsEnvironment) -> None:
    from verl_env_kit.episodes import render_tokens
    from verl_env_tools.task import build_tokenizer
    from verl_env_tools.templates import QWEN25_STYLE_TEMPLATE

    schemas = env.tools()
    by_name = {s["function"]["name"]: s["function"] for s in schemas}
    assert list(by_name)[0] == "calculator" and {"lookup", "add", "boom", "hang", "shout"} <= set(by_name)
    assert by_name["add"]["parameters"]["required"] == ["a", "b"]
    assert by_name["lookup"]["description"] == "Look a key up in a small table."
    tok = build_tokenizer()
    tok.chat_template = QWEN25_STYLE_TEMPLATE
    text = render_tokens(tok, [{"role": "user", "content": "What is the capital of France?"}], schemas,
                         generation_prompt=True)
    assert '"name": "lookup"' in text and '"name": "calculator"' in text and "Look a key up" in text


def test_a_well_formed_call_gets_the_servers_answer(env: ToolsEnvironment) -> None:
    result = env.step(_call("lookup", key="capital_of_france") + _call("add", a=20, b=22)
                      + _call("calculator", expression="6*7"))
    assert [m["content"] for m in result.observation] == ["Paris", "42", "42"]
    assert [m["name"] for m in result.observation] == ["lookup", "add", "calculator"]
    assert not result.info["tool_error"] and not result.done


@pytest.mark.parametrize("call, says", [
    (_call("add", a="x"), "validation error"),        # bad arguments: the server's validation refuses them
    (_call("boom"), "Error executing tool boom"),      # the server raises
    (_call("hang"), "timed out after 2 s"),            # past wall_s
    (_call("shout", n=10_000), "characters cut"),      # over max_output: cut, not an error
])
def test_failures_are_tool_errors(env: ToolsEnvironment, call: str, says: str) -> None:
    start = time.monotonic()
    result = env.step(call)
    content = result.observation[0]["content"]
    assert says in content and not result.done, content
    assert result.info["tool_error"] == content.startswith("error:")
    assert result.info["tool_error"] == (says != "characters cut")
    assert len(content) < 50 + 40
    assert time.monotonic() - start < 2.0 + 3.0
    # The session survives each failure: the next call is answered.
    assert env.step(_call("add", a=1, b=2)).observation[0]["content"] == "3"


def test_errors_are_counted_in_the_episode_metrics(tmp_path: Path) -> None:
    """Through the env kit's real loop: a scripted engine (real tokenizer, fixed turns) calls the tools."""
    from verl_core.contracts import RolloutOutput, SamplingParams
    from verl_env_tools.task import build_tokenizer
    from verl_env_kit.episodes import run_episodes

    tok = build_tokenizer()
    turns = iter([[_call("lookup", key="answer"), _call("boom"), _call("add", a=1), "no call"], ["42"] * 4])

    class Scripted:
        tokenizer = tok

        def generate(self, prompts, sampling):
            texts = next(turns)[:len(prompts)]
            ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
                   for t in texts]
            return RolloutOutput(response_ids=ids, log_probs=[[0.0] * len(i) for i in ids],
                                finish_reasons=["stop"] * len(ids))

    config = ToolsConfig(max_turns=2, mcp_servers=STDIO, wall_s=2.0, max_response_tokens=4000)
    metrics: dict[str, float] = {}
    try:
        batch = run_episodes(Scripted(), [{"prompt": [{"role": "user", "content": "q"}]}],
                             SamplingParams(n=4, max_new_tokens=1000), lambda: ToolsEnvironment(config), config,
                             pad_id=0, metrics=metrics)
    finally:
        pids = _server_pids()
        close_servers()
    assert metrics["env/tool_errors"] == 2.0  # boom, and add's missing argument
    transcripts = batch.meta["transcript"]
    assert transcripts[0][2]["content"] == "42" and transcripts[1][2]["content"].startswith("error:")
    assert len(pids) == 1  # one server for all four trajectories
    assert _wait_gone(pids) == []


def test_one_server_per_process_and_gone_after_close() -> None:
    config = ToolsConfig(mcp_servers=STDIO)
    envs = [ToolsEnvironment(config) for _ in range(3)]
    for e in envs:
        assert "lookup" in {s["function"]["name"] for s in e.tools()}
        e.close()  # a trajectory's close leaves the shared server running
    pids = _server_pids()
    assert len(pids) == 1 and envs[0].step(_call("lookup", key="answer")).observation[0]["content"] == "42"
    close_servers()
    assert _wait_gone(pids) == []
    # Used again after, it starts anew.
    assert ToolsEnvironment(config).step(_call("add", a=2, b=3)).observation[0]["content"] == "5"
    close_servers()


def test_servers_do_not_outlive_a_process_that_exits_without_closing(tmp_path: Path) -> None:
    # atexit closes them on a normal exit; os._exit skips it, and the closed pipe must stop the server.
    for ending in ("sys.exit(0)", "os._exit(0)"):
        script = textwrap.dedent(f"""
            import os, sys
            from verl_env_tools.env import ToolsConfig, ToolsEnvironment
            env = ToolsEnvironment(ToolsConfig(mcp_servers=[{{"command": sys.executable, "args": [{SERVER!r}]}}]))
            print(env.step('<tool_call>{{"name": "lookup", "arguments": {{"key": "answer"}}}}</tool_call>')
                  .observation[0]["content"], flush=True)
            {ending}
        """)
        before = set(_server_pids())
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert out.returncode == 0 and out.stdout.strip() == "42", out.stderr[-2000:]
        assert _wait_gone(list(set(_server_pids()) - before)) == [], ending


def test_config_errors() -> None:
    for bad, says in [([{"args": ["x"]}], "either command"), ([{"command": "x", "url": "http://h"}], "either"),
                      ([{"command": "x", "argv": []}], "unknown key 'argv'"), ([{"url": "http://h", "args": []}],
                                                                               "unknown key 'args'"),
                      ([{"command": "x", "args": [1]}], "args: must be strings")]:
        with pytest.raises(ValueError, match=says):
            ToolsConfig(mcp_servers=bad).validate()
    broken = ToolsEnvironment(ToolsConfig(mcp_servers=[{"command": sys.executable, "args": ["-c", "pass"]}]))
    try:
        with pytest.raises(RuntimeError, match="MCP server"):  # a server that cannot start stops the step
            broken.tools()
    finally:
        close_servers()
    clash = ToolsEnvironment(ToolsConfig(mcp_servers=STDIO + [{"command": sys.executable, "args": [SERVER, "x"]}]))
    try:
        with pytest.raises(RuntimeError, match="'lookup', a name another tool already has"):
            clash.tools()
    finally:
        close_servers()


def test_streamable_http_server() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        env = ToolsEnvironment(ToolsConfig(tools=[], mcp_servers=[{"url": f"http://127.0.0.1:{port}/mcp"}],
                                           wall_s=2.0))
        assert "lookup" in {s["function"]["name"] for s in env.tools()}
        assert env.step(_call("lookup", key="capital_of_france")).observation[0]["content"] == "Paris"
        assert env.step(_call("hang")).info["tool_error"]
        with_headers = ToolsEnvironment(ToolsConfig(tools=[], mcp_servers=[
            {"url": f"http://127.0.0.1:{port}/mcp", "headers": {"X-Verl-Test": "1"}}]))
        assert with_headers.step(_call("add", a=2, b=2)).observation[0]["content"] == "4"
    finally:
        close_servers()
        server.terminate()
        server.wait(timeout=30)


class TestToolsEnvironmentWithMcpConformance(EnvironmentConformance):
    default_responses = (_call("lookup", key="answer"), _call("add", a="x"),
                         *EnvironmentConformance.default_responses)

    @pytest.fixture
    def environment(self):
        yield lambda: ToolsEnvironment(ToolsConfig(max_turns=2, mcp_servers=STDIO, wall_s=2.0))
        close_servers()

    @pytest.fixture
    def task_row(self):
        return {"prompt": [{"role": "user", "content": "What is the answer?"}], "ground_truth": "42",
                "extra_info": {}}
