"""Console progress: a bar with ETA and key figures on a terminal, clean plain lines in a CI log."""

import io
import os
import pty
import re
import subprocess
import sys

import pytest

from verl_core.progress import Progress

FAST = ["run.max_steps=3", "data.batch_size=8", "rollout.n=4", "data.max_val_samples=16", "run.val_every=0",
        "run.threads=1"]
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


def _in_a_terminal(args, env):
    """Run ``args`` with a pseudo-terminal as stdout and stderr; its return code and everything it printed."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return proc.wait(timeout=600), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_a_real_run_shows_a_bar_on_a_terminal_and_plain_lines_otherwise(tmp_path, run_verl):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    code, text = _in_a_terminal([sys.executable, "-m", "verl_core.cli", "run", "--output-dir", str(tmp_path / "tty"),
                                 *FAST], env)
    assert code == 0, text[-3000:]
    assert "━" in text and "\x1b[" in text
    assert "validating 16 samples @ step 0" in text  # the bar says what runs while validation generates
    assert re.search(r"RL steps .*2/3 .*reward [\d.]+ \| loss", text)  # progress, ETA column, key figures

    res = run_verl("run", "--output-dir", str(tmp_path / "log"), *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not ESCAPES.search(res.stdout)
    assert re.search(r"^step 2/3 \| reward [\d.]+ .* eta \d+s$", res.stdout, re.M)
    assert re.search(r"^data preparation: done after 2/2 splits in [\d.]+s \| train_prompts 7600 \| val_prompts 16$",
                     res.stderr, re.M)
