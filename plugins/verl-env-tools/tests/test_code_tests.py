"""``code_tests``: programs run against test cases in the real sandbox (real subprocesses, no network)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_core.registry import PluginRegistry
from verl_env_tools.code_tests import CodeTestsConfig, CodeTestsReward, extract_program, parse_test_cases
from verl_env_tools.sandbox import SandboxLimits, network_isolation_available, run_python

pytestmark = pytest.mark.skipif(not network_isolation_available(), reason="no network namespace on this machine")

MBPP = {"test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 5) == 5",
                      "assert add(-1, 1) == 0"]}
STDIO = {"inputs": ["1 2\n", "3 4\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "7", "0\n"]}
SUM_PROGRAM = "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n"


@pytest.fixture(scope="module")
def reward() -> CodeTestsReward:
    return CodeTestsReward(CodeTestsConfig(cpu_s=1, wall_s=3.0))


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nIt adds the numbers."


def test_correct_and_half_correct_programs_assert_style(reward: CodeTestsReward) -> None:
    assert reward(fenced("def add(a, b):\n    return a + b"), MBPP) == 1.0
    # Right when a is 1 or 2 and wrong otherwise: two of the four asserts pass.
    assert reward(fenced("def add(a, b):\n    return a + b if a in (1, 2) else 99"), MBPP) == 0.5
    assert reward(fenced("def add(a, b):\n    return a - b"), MBPP) == 0.0
    assert reward("this is not python", MBPP) == 0.0
    # The ground truth as verl's code datasets store it: a JSON string, with setup code and imports.
    truth = json.dumps({"test_list": ["assert area(Rect(2, 3)) == 6", "assert math.isclose(area(Rect(1, .5)), .5)"],
                        "test_setup_code": "from collections import namedtuple\nRect = namedtuple('Rect', 'w h')",
                        "test_imports": ["import math"]})
    assert reward(fenced("def area(r):\n    return r.w * r.h"), truth) == 1.0


def test_correct_and_half_correct_programs_stdin_stdout_style(reward: CodeTestsReward) -> None:
    assert reward(fenced(SUM_PROGRAM), STDIO) == 1.0
    assert reward(fenced("a, b = map(int, input().split())\nprint(a + b if a < 3 else a - b)"), STDIO) == 0.5
    # Standard error is not compared; trailing whitespace is ignored; a crash after the answer fails.
    noisy = "import sys\nprint('debug', file=sys.stderr)\n" + SUM_PROGRAM.replace("print(a + b)", "print(a + b, ' ')")
    assert reward(noisy, STDIO) == 1.0
    assert reward(SUM_PROGRAM + "raise SystemExit(1)", STDIO) == 0.0
    assert reward(SUM_PROGRAM + "import sys; sys.exit(0)", json.dumps(STDIO)) == 1.0


def test_humaneval_style(reward: CodeTestsReward) -> None:
    truth = {"test": "def check(candidate):\n    assert candidate([3, 1, 2]) == [1, 2, 3]\n", "entry_point": "sort_it"}
    assert reward(fenced("def sort_it(xs):\n    return sorted(xs)"), truth) == 1.0
    assert reward(fenced("def sort_it(xs):\n    return xs"), truth) == 0.0


def test_call_based_style_as_apps_and_taco_write_it(reward: CodeTestsReward) -> None:
    # APPS' input_output: a JSON string; outputs wrapped in a list ([[7]]) or not (3), as APPS rows have both.
    truth = json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4], [0, 0], [-1, 1]], "outputs": [3, [7], 0, [0]]})
    assert reward(fenced("def add(a, b):\n    return a + b"), truth) == 1.0
    # A LeetCode-style row (TACO): the method of class Solution.
    assert reward(fenced("class Solution:\n    def add(self, a, b):\n        return a + b"), truth) == 1.0
    assert reward(fenced("def add(a, b):\n    return a + b if a < 2 else 0"), truth) == 0.75
    assert reward(fenced("def plus(a, b):\n    return a + b"), truth) == 0.0  # not the named function
    # Tuples are lists, as APPS compares them; lists and dicts of the return value are compared whole.
    pairs = {"fn_name": "pair", "inputs": [[1, "x"]], "outputs": [[[1, "x"]]]}
    assert reward(fenced("def pair(a, b):\n    return (a, b)"), pairs) == 1.0
    counts = {"fn_name": "count", "inputs": [["abca"]], "outputs": [{"a": 2, "b": 1, "c": 1}]}
    assert reward(fenced("from collections import Counter\ndef count(s):\n    return dict(Counter(s))"), counts) == 1.0
    # Only JSON data passes: an object equal to everything, or a print of the answer, does not.
    anything = "class Yes:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Yes()"
    assert reward(fenced(anything), truth) == 0.0
    assert reward(fenced("def add(a, b):\n    print(a + b)"), truth) == 0.0
    # Leaving before the comparison is no pass; a function that loops fails that test case only.
    assert reward(fenced("import os\ndef add(a, b):\n    os._exit(0)"), truth) == 0.0
    loops = "def add(a, b):\n    while a == 3:\n        pass\n    return a + b"
    assert reward(fenced(loops), truth) == 0.75


def test_leaving_before_the_asserts_is_no_pass(reward: CodeTestsReward) -> None:
    for cheat in ("exit()", "import sys; sys.exit(0)", "import os; os._exit(0)", "print('ok')\nraise SystemExit"):
        assert reward(fenced(cheat + "\ndef add(a, b):\n    return 0"), MBPP) == 0.0, cheat


def test_an_infinite_loop_times_out_within_the_limit(reward: CodeTestsReward) -> None:
    start = time.monotonic()
    assert reward(fenced("while True:\n    pass"), {"inputs": ["1\n"], "outputs": ["1\n"]}) == 0.0
    assert reward(fenced("import time\ntime.sleep(60)"), {"test_list": ["assert True"]}) == 0.0
    # One CPU-bound test killed at cpu_s=1, one sleeping test killed at wall_s=3 (plus start-up).
    assert time.monotonic() - start < 8


def test_a_response_gets_total_s_for_all_its_tests() -> None:
    quick = CodeTestsReward(CodeTestsConfig(cpu_s=1, wall_s=1.0, total_s=1.5))
    sleeper = "import time\ntime.sleep(60)"
    start = time.monotonic()
    assert quick(sleeper, {"test_list": ["assert True"] * 20}) == 0.0
    assert time.monotonic() - start < 5  # two tests started, the other eighteen failed unrun


def test_ten_megabytes_of_output_is_capped_and_fails(reward: CodeTestsReward) -> None:
    # The expected answer comes first, then 10 MB more: the output is cut and the test fails.
    program = "print(3)\nimport sys\nsys.stdout.write('x' * (10 * 1024 * 1024))"
    assert reward(program, {"inputs": ["1 2\n"], "outputs": ["3\n"]}) == 0.0
    result = run_python(program, SandboxLimits(max_output=1000))
    assert result.ok and result.truncated and len(result.output) < 1100
    assert f"[{10 * 1024 * 1024 + 2 - 1000} characters cut]" in result.output
    # Output without end is read and dropped until the time limit, never held whole.
    result = run_python("while True:\n    print('y' * 10000)", SandboxLimits(cpu_s=1, wall_s=3.0))
    assert not result.ok and result.truncated and len(result.output) < 2100


def test_programs_have_no_network(reward: CodeTestsReward) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        assert reward(program, {"inputs": [""], "outputs": ["connected\n"]}) == 0.0
        result = run_python(program, SandboxLimits())
        assert not result.ok and ("unreachable" in result.output or "refused" in result.output)
    finally:
        server.close()


def test_the_program_is_the_last_python_block() -> None:
    assert extract_program("```python\nx = 1\n```\ntext\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_program("Sure:\n```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off
    assert extract_program("def f():\n    return 1") == "def f():\n    return 1"
    assert extract_program("```\nplain fence\n```") == "```\nplain fence\n```"


def test_a_row_without_test_cases_names_the_row_and_the_shape(reward: CodeTestsReward) -> None:
    for truth in ("", "42", {}, {"test_list": []}, {"inputs": ["1"], "outputs": []}, None):
        with pytest.raises(ValueError) as info:
            reward("print(1)", truth, data_source="my/code-set", extra_info={"index": 7})
        message = str(info.value)
        assert "data_source='my/code-set' index=7" in message and '"test_list"' in message and '"inputs"' in message
    for truth, message in (({"fn_name": "solve", "inputs": ["1 2"], "outputs": [3]}, r"inputs\[0\] is '1 2'; a "
                                                                                    r"call-based .* list of the"),
                           ({"fn_name": "no such", "inputs": [[1]], "outputs": [1]}, "'fn_name' must be the name"),
                           ({"fn_name": "f", "inputs": [[1]], "outputs": []}, "lists of the same length")):
        with pytest.raises(ValueError, match=message):
            parse_test_cases(truth)


def test_rows_are_scored_through_the_reward_manager_in_worker_processes() -> None:
    from verl_rewards import RewardConfig, RewardError
    from verl_rewards.functions import resolve_data_source
    from verl_rewards.manager import RewardManager

    registry = PluginRegistry()
    assert resolve_data_source("google-research-datasets/mbpp", registry=registry) == "code_tests"
    manager = RewardManager(registry=registry, tokenizer=None, data_sources=["google-research-datasets/mbpp"],
                            config=RewardConfig(options={"code_tests": {"cpu_s": 1, "wall_s": 3.0}}))
    meta = {"ground_truth": [json.dumps(MBPP), json.dumps(STDIO), json.dumps(MBPP)],
            "data_source": ["google-research-datasets/mbpp", "apps", "google-research-datasets/mbpp"],
            "extra_info": [{"index": 0}, {"index": 1}, {"index": 2}], "prompt_text": ["q"] * 3}
    try:
        scores, metrics = manager.score_texts(
            [fenced("def add(a, b):\n    return a + b"), fenced(SUM_PROGRAM), "while True: pass"], meta)
        assert scores.tolist() == [1.0, 1.0, 0.0] and metrics["reward/errors"] == 0
        meta["ground_truth"][1] = ""
        with pytest.raises(RewardError, match="data_source='apps' index=1"):
            manager.score_texts(["print(1)"] * 3, meta)
    finally:
        manager.close()


def test_the_prepared_mbpp_sample_scores_its_own_solutions_one(reward: CodeTestsReward, tmp_path: Path) -> None:
    import pyarrow.parquet as pq
    from verl_data_prepare.prepare import prepare, sample_path

    prepare("mbpp", [sample_path("mbpp")], tmp_path)
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 8
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert reward(fenced(row["extra_info"]["answer"]), truth) == 1.0, row["extra_info"]["task_id"]
        assert reward(fenced("pass"), truth) == 0.0


@pytest.mark.slow
def test_verl_run_two_steps_with_code_tests_on_the_prepared_sample(tmp_path: Path) -> None:
    import os

    from verl_core.testing import tiny_text_model_dir

    cli = [sys.executable, "-m", "verl_cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    src = Path(__import__("verl_data_prepare.prepare", fromlist=["sample_path"]).sample_path("mbpp"))
    res = subprocess.run([*cli, "data", "prepare", "mbpp", "-i", str(src), "-o", str(tmp_path / "mbpp")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "mbpp train: 8 rows" in res.stdout, res.stderr
    model = tiny_text_model_dir(tmp_path / "model")
    out = tmp_path / "run"
    res = subprocess.run([*cli, "run", "--model", model, "--data", str(tmp_path / "mbpp" / "train.parquet"),
                          "--output-dir", str(out), "--max-steps", "2", "reward.name=code_tests",
                          "data.batch_size=4", "rollout.n=2", "rollout.max_new_tokens=8", "run.threads=1",
                          "run.val_every=0", "run.save_every=0"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward/mean" in r and "step" in r]
    assert [r["step"] for r in train][-2:] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["reward/errors"] == 0 for r in train)


def test_the_built_in_code_task_is_graded_by_code_tests(reward: CodeTestsReward) -> None:
    from verl_env_tools.code_task import DATA_SOURCE, make_dataset
    from verl_rewards.functions import resolve_data_source

    train, test = make_dataset()
    assert (len(train), len(test)) == (7600, 500) and resolve_data_source(DATA_SOURCE, registry=PluginRegistry()) == "code_tests"
    for row in test[:3]:
        truth, program = row["reward_model"]["ground_truth"], row["extra_info"]["program"]
        a, b = map(int, row["prompt"][0]["content"].split("+"))
        assert program == f"print({a + b})" and reward(program, truth) == 1.0
        assert reward(f"print({a}+{b})", truth) == 1.0  # any program that prints the sum passes
        for wrong in (f"print({a + b + 1})", f"print({a + b}", f"{a + b}", f"print({a + b})x"):
            assert reward(wrong, truth) == 0.0, wrong


@pytest.mark.heavy
@pytest.mark.long  # 3-4 min; CI keeps the real sandbox tests of every test style and the tools task's learning
def test_the_built_in_code_model_learns_under_code_tests(tmp_path: Path) -> None:
    """The README's figure: greedy pass fraction 0.185 -> 0.25 -> 0.295 at steps 0/20/40 (about 5 minutes on
    2 cores with the model's warm start; each rollout's program runs in its own sandbox process)."""
    import os

    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "verl_cli", "run", "--model", "builtin:tiny-qwen2-code", "--data",
                          "builtin:code-sums", "run.max_steps=40", "run.val_every=20", "run.threads=1",
                          "--output-dir", str(out)],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = {m["step"]: round(m["val/reward_mean"], 3) for m in steps if "val/reward_mean" in m}
    print("val/reward_mean by step:", val)
    assert val[40] >= val[0] + 0.05, val
    assert all(m.get("reward/errors", 0) == 0 and m.get("val/reward_errors", 0) == 0 for m in steps)
