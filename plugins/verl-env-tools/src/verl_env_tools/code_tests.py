"""``code_tests`` (``verl.rewards``): the model's program run against the row's test cases in the sandbox.

The reward is the fraction of the row's test cases the program passes, in ``[0, 1]``. Each test case
runs in its own :func:`~verl_env_tools.sandbox.run_python` process (no network, CPU, memory and
wall-clock limits, output kept to ``max_output`` characters), so a program that loops, crashes, eats
memory or prints without end fails that test case and nothing else.

**The program** is the last fenced ```` ```python ```` (or ```` ```py ````) block of the response (an
unclosed one, cut by the token budget, runs to the end), or else the whole response.

**The test cases** are the row's ``reward_model.ground_truth``: a dict, or its JSON string (verl's own
code datasets store a JSON string), in one of four shapes:

* stdin/stdout (APPS, CodeContests, TACO): ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``. Each
  input is the program's standard input; it passes when it exits with code 0 and its standard output
  (standard error is dropped) equals the expected output, compared line by line with trailing
  whitespace and trailing blank lines ignored. Output cut at ``max_output`` characters fails.
* call-based (APPS, TACO): the same with ``"fn_name": "f"``, each input a list of arguments and each output
  the return value, as JSON: ``{"fn_name": "f", "inputs": [[1, 2], ...], "outputs": [3, ...]}``. As in
  APPS/TACO, the function is the method ``f`` of the program's ``class Solution`` (an instance of it) when
  it has one, else the program's function ``f``; the test case passes when ``f(*input)`` returns the
  output, or the output's only element when the output is a list (APPS writes ``[[3], ...]`` as often
  as ``[3, ...]``). The return value is compared after a JSON round trip (tuples are lists, as APPS
  treats them), so only JSON data can pass: an object whose ``__eq__`` says yes to everything cannot.
* MBPP asserts: ``{"test_list": ["assert f(1) == 2", ...], "test_setup_code": "...", "test_imports": [...]}``
  (the last two optional). Each assert is one test case, run after the program (and the imports and
  setup code) in the same namespace.
* HumanEval: ``{"test": "def check(candidate): ...", "entry_point": "f"}``: one test case,
  ``check(f)`` after the program.

In the assert styles the program's own output is discarded, and a test case passes only when the
harness reaches its end: a program that calls ``exit()`` or ``os._exit(0)`` before the asserts run
fails. (The sandbox protects the host; a program that reads the harness back from ``/proc`` could still
forge a pass, which the harness does not try to prevent.)

A row without test cases is an error naming the row's ``data_source`` and ``extra_info.index``, never a
silent 0. Rows of the ``data_sources`` below are
routed here by ``reward.name = "auto"``; ``verl data prepare mbpp`` writes such rows.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from verl_env_tools.sandbox import SandboxLimits, network_isolation_available, run_python

__all__ = ["CodeTestsReward", "CodeTestsConfig", "TestCase", "extract_program", "parse_test_cases",
           "GROUND_TRUTH_SHAPES"]

GROUND_TRUTH_SHAPES = ('{"inputs": [...], "outputs": [...]} (stdin/stdout), the same with "fn_name": "f" '
                       '(call-based: each input a list of arguments), {"test_list": ["assert ...", ...]} (MBPP) or '
                       '{"test": "def check(candidate): ...", "entry_point": "f"} (HumanEval), as a dict or its '
                       'JSON string')

# The last fenced python block wins; an unclosed one (the response ran out of tokens) runs to the end.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\r?\n(.*?)(?:```|\Z)", re.S | re.I)


@dataclass
class CodeTestsConfig:
    """Options of the ``code_tests`` reward (``reward.options.code_tests``).

    Attributes:
        cpu_s: CPU seconds per test case.
        wall_s: wall-clock seconds per test case (its process group is killed after).
        memory_mb: address space per test case, MiB.
        max_output: characters of a test case's output kept; a stdin/stdout test printing more fails.
        total_s: seconds for all test cases of one response; those not started by then fail. Keep it
            under ``reward.timeout`` (60 s by default), which would otherwise fail the whole row.
        allow_network: run even where the sandbox cannot cut the network (no network namespace).
    """

    cpu_s: int = 2
    wall_s: float = 4.0
    memory_mb: int = 1024
    max_output: int = 20_000
    total_s: float = 30.0
    allow_network: bool = False

    def validate(self) -> None:
        if self.cpu_s < 1:
            raise ValueError("cpu_s: must be at least 1 second")
        if self.wall_s <= 0 or self.total_s <= 0:
            raise ValueError("wall_s and total_s: must be positive seconds")
        if self.memory_mb < 64:
            raise ValueError("memory_mb: must be at least 64 MiB (a Python interpreter needs about 30)")
        if self.max_output < 1:
            raise ValueError("max_output: must be at least 1 character")


@dataclass(frozen=True)
class TestCase:
    """One test case: a stdin/stdout pair (``stdin``, ``expected``) or a script run after the program."""

    __test__ = False  # not a pytest class

    stdin: str = ""
    expected: str | None = None
    script: str = ""


def extract_program(response: str) -> str:
    """The program in ``response``: its last ```` ```python ```` block, or else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_test_cases(ground_truth: Any) -> list[TestCase]:
    """The test cases of one row's ground truth (the shapes in :data:`GROUND_TRUTH_SHAPES`).

    Raises:
        ValueError: no test cases, or a shape this reward does not read (the message says which part).
    """
    truth = ground_truth
    if isinstance(truth, (bytes, bytearray)):
        truth = truth.decode("utf-8", "replace")
    if isinstance(truth, str):
        try:
            truth = json.loads(truth) if truth.strip() else None
        except ValueError:
            raise ValueError(f"the ground truth is a string that is not JSON: {_short(truth)}") from None
    if not isinstance(truth, dict):
        raise ValueError(f"the ground truth is {_short(ground_truth)}, not test cases")
    if "inputs" in truth or "outputs" in truth:
        inputs, outputs = truth.get("inputs"), truth.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("'inputs' and 'outputs' must be lists of the same length")
        if truth.get("fn_name") is not None:
            return _call_cases(truth["fn_name"], inputs, outputs)
        for key, values in (("inputs", inputs), ("outputs", outputs)):
            bad = [i for i, v in enumerate(values) if not isinstance(v, str)]
            if bad:
                raise ValueError(f"{key}[{bad[0]}] is a {type(values[bad[0]]).__name__}, not a string")
        cases = [TestCase(stdin=i, expected=o) for i, o in zip(inputs, outputs)]
    elif "test_list" in truth:
        tests, setup, imports = truth["test_list"], truth.get("test_setup_code") or "", truth.get("test_imports") or []
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            raise ValueError("'test_list' must be a list of assert statements (strings)")
        if not isinstance(setup, str) or not isinstance(imports, list):
            raise ValueError("'test_setup_code' must be a string and 'test_imports' a list of strings")
        prefix = "".join(f"{line}\n" for line in [*imports, setup] if line)
        cases = [TestCase(script=prefix + t) for t in tests if t.strip()]
    elif "test" in truth:
        test, entry = truth.get("test"), truth.get("entry_point")
        if not isinstance(test, str) or not isinstance(entry, str) or not entry.isidentifier():
            raise ValueError("a HumanEval ground truth needs 'test' (code defining check) and 'entry_point' "
                             "(the function's name)")
        cases = [TestCase(script=f"{test}\ncheck({entry})\n")] if test.strip() else []
    else:
        raise ValueError(f"the ground truth has none of the keys inputs/outputs, test_list, test: {sorted(truth)}")
    if not cases:
        raise ValueError("the ground truth holds no test cases")
    return cases


def _call_cases(name: Any, inputs: list, outputs: list) -> list[TestCase]:
    """Call-based test cases: each a script that calls ``name`` with one input's arguments."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"'fn_name' must be the name of the function to call, not {_short(name)}")
    bad = [i for i, args in enumerate(inputs) if not isinstance(args, list)]
    if bad:
        raise ValueError(f"inputs[{bad[0]}] is {_short(inputs[bad[0]])}; a call-based (fn_name) test's input is "
                         f"the list of the function's arguments")
    try:
        pairs = [(json.dumps(args), json.dumps(want)) for args, want in zip(inputs, outputs)]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"call-based test cases must be JSON data: {exc}") from None
    # APPS/TACO: the method of an instance of class Solution when the program has one, else the function.
    return [TestCase(script=(
        "import json as _json\n"
        "_cls = globals().get('Solution')\n"
        f"_fn = getattr(_cls(), {name!r}) if isinstance(_cls, type) and hasattr(_cls, {name!r}) else {name}\n"
        f"_got = _json.loads(_json.dumps(_fn(*_json.loads({args!r}))))\n"
        f"_want = _json.loads({want!r})\n"
        "if not (_got == _want or (isinstance(_want, list) and len(_want) > 0 and _got == _want[0])):\n"
        "    raise AssertionError('wrong return value')\n"))
        for args, want in pairs]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _same_output(actual: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return lines(actual) == lines(expected)


def _stdio_harness(program: str) -> str:
    # Standard error goes nowhere: only standard output is compared. exec keeps the program's own
    # `from __future__` imports legal and its line numbers its own.
    return ("import os as _os\n_os.dup2(_os.open(_os.devnull, _os.O_WRONLY), 2)\n"
            f"exec(compile({program!r}, '<program>', 'exec'), {{'__name__': '__main__'}})\n")


def _assert_harness(program: str, script: str, token: str) -> str:
    # The program's output goes nowhere; the harness writes the token to the real stdout only after
    # the test script ran to its end, so exit() or os._exit(0) before the asserts is no pass.
    return ("import os as _os, sys as _sys\n_out = _os.dup(1)\n_null = _os.open(_os.devnull, _os.O_WRONLY)\n"
            "_os.dup2(_null, 1)\n_os.dup2(_null, 2)\n_ns = {'__name__': '__main__'}\n"
            f"exec(compile({program!r}, '<program>', 'exec'), _ns)\n"
            f"exec(compile({script!r}, '<test>', 'exec'), _ns)\n"
            f"_sys.stdout.flush()\n_os.write(_out, b{token!r})\n")


class CodeTestsReward:
    """The fraction of the row's test cases the response's program passes, run in the sandbox."""

    Config = CodeTestsConfig
    # reward.name = "auto" routes these data_sources here (MBPP and HumanEval as on the Hub, and the
    # names verl's own preprocessing gives APPS, CodeContests and TACO rows, and builtin:code-sums).
    data_sources = ("google-research-datasets/mbpp", "mbpp", "Muennighoff/mbpp", "openai/openai_humaneval",
                    "openai_humaneval", "humaneval", "apps", "codecontests", "taco", "code_sums")

    def __init__(self, config: CodeTestsConfig | None = None) -> None:
        self.config = config or CodeTestsConfig()
        if not self.config.allow_network and not network_isolation_available():
            raise ValueError("code_tests: this machine does not let the sandbox cut the network "
                             "(unshare(CLONE_NEWNET) failed); run as root or with user namespaces, or set "
                             "reward.options.code_tests.allow_network = true to run programs with network access")
        c = self.config
        self.limits = SandboxLimits(cpu_s=c.cpu_s, wall_s=c.wall_s, memory_mb=c.memory_mb, max_output=c.max_output,
                                    allow_network=c.allow_network)

    def __call__(self, response: str, ground_truth: Any, data_source: str = "", extra_info: Any = None) -> float:
        try:
            cases = parse_test_cases(ground_truth)
        except ValueError as exc:
            index = extra_info.get("index", "?") if isinstance(extra_info, dict) else "?"
            raise ValueError(f"code_tests: row data_source={data_source!r} index={index}: {exc}. "
                             f"reward_model.ground_truth must be {GROUND_TRUTH_SHAPES}") from None
        program = extract_program(str(response))
        deadline = time.monotonic() + self.config.total_s
        passed = 0
        for case in cases:
            if time.monotonic() >= deadline:
                break  # the rest fail: the response's time is spent
            passed += self._passes(program, case)
        return passed / len(cases)

    def _passes(self, program: str, case: TestCase) -> bool:
        if case.expected is not None:
            result = run_python(_stdio_harness(program), self.limits, stdin=case.stdin)
            return result.ok and not result.truncated and _same_output(result.output, case.expected)
        token = f"verl-code-tests-passed-{secrets.token_hex(8)}"
        result = run_python(_assert_harness(program, case.script, token), self.limits)
        return result.ok and result.output == token
