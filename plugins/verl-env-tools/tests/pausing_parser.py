"""A tool-call parser for test_tools_resume.py: the Hermes parser, except that it can stop a run at an exact
point of a step, so the test kills the run there on any machine, fast or slow.

Once the file ``VERL_TEST_PAUSE_AFTER`` names exists (a checkpoint's manifest), the ``VERL_TEST_PAUSE_AT``-th
call from then on creates the file ``VERL_TEST_PAUSED`` and never returns. Without these variables it is
``parse_hermes``.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

from verl_env_tools.parsing import ToolCall, parse_hermes

_calls = itertools.count(1)  # next() on a count is atomic: safe if turns are parsed on several threads


def parse(text: str) -> list[ToolCall]:
    after = os.environ.get("VERL_TEST_PAUSE_AFTER")
    if after and Path(after).exists() and next(_calls) == int(os.environ["VERL_TEST_PAUSE_AT"]):
        Path(os.environ["VERL_TEST_PAUSED"]).touch()
        threading.Event().wait()  # until the test kills the run
    return parse_hermes(text)
