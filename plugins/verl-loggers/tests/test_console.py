"""The ``console`` logger: one short line per step, a bar with the key figures on a terminal."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

from verl_loggers import ConsoleLogger

FAST = ["run.max_steps=3", "data.batch_size=8", "rollout.n=4", "data.max_val_samples=16", "run.val_every=0",
        "run.threads=1"]
ESCAPES = re.compile(r"\x1b\[|\r")


def test_the_console_kl_column_shows_the_kl_ppo_computes() -> None:
    def line(metrics: dict[str, float]) -> str:
        logger, out = ConsoleLogger(), io.StringIO()
        logger._max_steps = 2
        with redirect_stdout(out):
            logger.verl_step_end(step=1, metrics=metrics)
        return out.getvalue()

    # What PPO's step logs: the KL to the reference in the reward; its clip-loss drift is 0 on one mini-batch.
    ppo = {"reward/mean": 0.5, "ppo/kl_in_reward": 0.0123, "ppo/approx_kl": 0.0, "ppo/kl_divergence": 0.0,
           "actor/ref_kl": 0.011}
    assert "kl 0.0123" in line(ppo)
    assert "kl 0.02" in line({"ppo/kl_loss": 0.02, "ppo/kl_divergence": 0.0})  # GRPO with kl_coef: the KL loss
    assert "kl 0.003" in line({"ppo/kl_divergence": 0.003})  # no reference: the policy's drift, as before


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
    # A terminal that rich draws on, whatever this machine's environment says (TERM=dumb, NO_COLOR, ...).
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE",
                                                            "TTY_INTERACTIVE")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200", TERM="xterm-256color")
    code, text = _in_a_terminal([sys.executable, "-m", "verl_cli", "run", "--output-dir", str(tmp_path / "tty"),
                                 *FAST], env)
    assert code == 0, text[-3000:]
    assert "━" in text and "\x1b[" in text
    # Only what the logger draws itself, not what the bar's refresh thread (10 per second) happens to draw
    # in between, which a fast machine may skip: a validation's start redraws the bar, with what runs, the
    # progress, the ETA column and the last step's key figures.
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)  # colours and cursor moves aside
    assert "validating 16 samples @ step 0" in shown  # the bar says what runs while validation generates
    assert re.search(r"validating 16 samples @ step 3 ━+ 3/3 \S+ reward [\d.]+ \| loss", shown)
    assert re.search(r"step 2/3 \| reward [\d.]+ .*\| loss", shown)  # each step's line, above the bar

    res = run_verl("run", "--output-dir", str(tmp_path / "log"), *FAST)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not ESCAPES.search(res.stdout)
    assert re.search(r"^step 2/3 \| reward [\d.]+ .* eta \d+s$", res.stdout, re.M)
    assert re.search(r"^data preparation: done after 2/2 splits in [\d.]+s \| train_prompts 7600 \| val_prompts 16$",
                     res.stderr, re.M)
