"""The sandbox contains what untrusted code tries; every failure reaches the model as a tool error."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from verl_env_tools.env import ToolsConfig, ToolsEnvironment
from verl_env_tools.parsing import ToolCallError, parse_hermes
from verl_env_tools.sandbox import SandboxLimits, network_isolation_available, run_python

pytestmark = pytest.mark.skipif(not network_isolation_available(), reason="no network namespace on this machine")


def _python_call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


@pytest.fixture
def env() -> ToolsEnvironment:
    e = ToolsEnvironment(ToolsConfig(tools=["calculator", "python"], wall_s=3.0, cpu_s=1, memory_mb=256))
    e.reset(prompt=[{"role": "user", "content": "x"}], extra_info={})
    return e


def _listening_port() -> tuple[socket.socket, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server, server.getsockname()[1]


def test_network_is_unreachable(env: ToolsEnvironment) -> None:
    server, port = _listening_port()  # reachable from the host, not from the sandbox's namespace
    try:
        result = env.step(_python_call(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"))
    finally:
        server.close()
    assert result.info["tool_error"] and not result.done
    assert "error:" in result.observation[0]["content"] and ("unreachable" in result.observation[0]["content"]
                                                           or "refused" in result.observation[0]["content"])


def test_writes_outside_its_directory_do_not_reach_the_host(env: ToolsEnvironment, tmp_path: Path) -> None:
    target = Path("/tmp") / f"verl-sandbox-escape-{os.getpid()}"
    home = tmp_path / "escape"
    result = env.step(_python_call(f"open({str(target)!r}, 'w').write('x'); open({str(home)!r}, 'w').write('x'); "
                                   f"print('done')"))
    assert not target.exists() and not home.exists()
    assert result.info["tool_error"]  # the second write is refused outright
    ok = env.step(_python_call("open('mine.txt', 'w').write('x'); print(open('mine.txt').read())"))
    assert ok.observation[0]["content"].strip() == "x" and not ok.info["tool_error"]


def test_fork_bomb_is_contained(env: ToolsEnvironment) -> None:
    before = len(os.listdir("/proc"))
    result = env.step(_python_call("import os\nwhile True:\n    os.fork()"))
    assert result.info["tool_error"]
    assert len(os.listdir("/proc")) < before + 20  # nothing left running


def test_infinite_loop_hits_the_cpu_limit(env: ToolsEnvironment) -> None:
    result = env.step(_python_call("while True: pass"))
    assert result.info["tool_error"] and "CPU limit" in result.observation[0]["content"]


def test_ten_gigabytes_is_refused(env: ToolsEnvironment) -> None:
    result = env.step(_python_call("x = bytearray(10 * 1024 ** 3)"))
    assert result.info["tool_error"] and "memory" in result.observation[0]["content"]


def test_sleeping_code_hits_the_wall_clock_limit() -> None:
    result = run_python("import time; time.sleep(30)", SandboxLimits(wall_s=1.0))
    assert not result.ok and "timed out" in result.error and result.seconds < 5


def test_output_is_truncated() -> None:
    result = run_python("print('a' * 10000)", SandboxLimits(max_output=100))
    assert result.ok and len(result.output) < 200 and "characters cut" in result.output


def test_many_calls_at_once_leave_the_host_responsive(env: ToolsEnvironment) -> None:
    results = []
    threads = [threading.Thread(target=lambda: results.append(env.step(_python_call("while True: pass"))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 4 and all(r.info["tool_error"] for r in results)


def test_calculator_and_malformed_calls(env: ToolsEnvironment) -> None:
    ok = env.step('<tool_call>{"name":"calculator","arguments":{"expression":"37*48"}}</tool_call>')
    assert ok.observation == [{"role": "tool", "name": "calculator", "content": "1776"}] and not ok.info["tool_error"]
    for bad in ['<tool_call>{"name": "calculator"', '<tool_call>not json</tool_call>',
                '<tool_call>{"name":"nope","arguments":{}}</tool_call>',
                '<tool_call>{"name":"calculator","arguments":{"expression":"__import__(1)"}}</tool_call>']:
        result = env.step(bad)
        assert result.info["tool_error"] and result.observation[0]["content"].startswith("error:") and not result.done
    final = env.step("1776")
    assert final.done and final.observation is None


def test_hermes_parser() -> None:
    calls = parse_hermes('a <tool_call>{"name":"f","arguments":"{\\"x\\": 1}"}</tool_call> b '
                         '<tool_call>{"name":"g","arguments":{}}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("f", {"x": 1}), ("g", {})]
    with pytest.raises(ToolCallError):
        parse_hermes('<tool_call>{"arguments": {}}</tool_call>')


def test_unknown_tool_and_parser_are_config_errors() -> None:
    with pytest.raises(ValueError, match="tools: unknown"):
        ToolsConfig(tools=["browser"]).validate()
    with pytest.raises(ValueError, match="parser"):
        ToolsConfig(parser="nonsense").validate()
