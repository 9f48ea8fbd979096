"""``verl_kit.progress.Progress``: a bar with ETA and key figures on a terminal, clean plain lines in a CI log.

The step bar and lines of a real run are the ``console`` logger's: plugins/verl-loggers/tests/test_console.py.
"""

import io
import re

import pytest

from verl_kit.progress import Progress

ESCAPES = re.compile(r"\x1b\[|\r")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_progress_writes_lines_with_eta_and_figures_and_no_escapes():
    out = io.StringIO()
    with Progress("warm start", total=4, unit="steps", stream=out, every=0.0) as bar:
        for step in range(1, 5):
            bar.update(step, loss=1.0 / step, accuracy=None)
    lines = out.getvalue().splitlines()
    assert lines[0] == "warm start: started (4 steps)"
    assert re.fullmatch(r"warm start: 2/4 steps, eta \d+s \| loss 0\.5", lines[2])
    assert re.fullmatch(r"warm start: done after 4/4 steps in [\d.]+s \| loss 0\.25", lines[-1])
    assert not ESCAPES.search(out.getvalue())


def test_plain_progress_says_when_it_stopped_early():
    out = io.StringIO()
    with pytest.raises(KeyError):
        with Progress("data preparation", total=2, stream=out) as bar:
            bar.update(1)
            raise KeyError("x")
    assert "data preparation: stopped after 1/2" in out.getvalue()


def test_a_terminal_gets_a_bar_with_the_figures():
    out = _Terminal()
    with Progress("warm start", total=10, unit="steps", stream=out) as bar:
        bar.update(5, loss=0.123456)
    text = out.getvalue()
    assert "━" in text and "5/10" in text and "loss 0.1235" in text
