"""A run directory is never silently mixed, overwritten or unusable (issue 31).

Real `verl run` processes on the tiny built-in task: two runs into one directory, a kill -9 and its resume,
a resume with another algorithm or settings, and the checkpoint write order (file -> fsync -> rename ->
fsync of the directory) recorded from a real save.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verl_run_store import CheckpointManager

FAST = ["data.batch_size=16", "rollout.n=4", "data.max_val_samples=40", "run.val_every=0", "run.threads=1",
        "reward.isolation=\"none\""]


def train_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "ppo/actor_loss" in r]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file of the directory and its bytes (the lock file left out: it is the lock)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != "run.lock"}


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "verl_cli", "run", *FAST, f"run.output_dir='{run_dir}'",
                             *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended first: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def latest_step(run_dir: Path) -> int:
    found = CheckpointManager(run_dir).latest()
    return int(found.name.split("_")[1]) if found is not None else 0


# ----------------------------------------------------------------------------- one run per directory
@pytest.mark.slow
def test_a_second_run_into_a_held_directory_exits_2_naming_the_first_which_logs_each_step_once(tmp_path, run_verl):
    run_dir = tmp_path / "run"
    steps = 300
    first = start(run_dir, f"run.max_steps={steps}", "run.save_every=50", "run.loggers=['jsonl']")
    try:
        wait_for(lambda: (run_dir / "run.lock").is_file() and (run_dir / "run.lock").stat().st_size > 0, first)
        began = time.monotonic()
        second = run_verl("run", *FAST, f"run.output_dir='{run_dir}'", f"run.max_steps={steps}")
        took = time.monotonic() - began
        assert first.poll() is None, "the first run finished before the second tried; give it more steps"
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"{run_dir} is in use by another run: pid {first.pid} on host" in second.stderr
        assert "another --output-dir" in second.stderr and "Traceback" not in second.stderr
        assert took < 60  # at once: before any model or data loads
        out, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, out[-3000:]
    assert train_steps(run_dir) == list(range(1, steps + 1))
    assert (run_dir / "run.lock").read_bytes() == b""  # released: no holder named


@pytest.mark.slow
def test_kill_9_then_resume_takes_the_dead_runs_lock_and_logs_each_step_once(tmp_path, run_verl):
    """No handler runs on SIGKILL: the lock file still names the dead run, and metrics.jsonl and samples/train.jsonl
    hold the steps after its last checkpoint, which the resumed run trains again."""
    run_dir = tmp_path / "run"
    common = ["run.save_every=5", "run.loggers=['jsonl']", "run.train_samples=2"]
    proc = start(run_dir, "run.max_steps=5000", *common)
    try:
        wait_for(lambda: latest_step(run_dir) >= 10 and train_steps(run_dir)[-1] % 5 >= 2, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    saved = latest_step(run_dir)
    assert train_steps(run_dir)[-1] > saved, "nothing was logged past the checkpoint; the test shows nothing"
    assert json.loads((run_dir / "run.lock").read_text())["pid"] == proc.pid

    final = saved + 4
    again = run_verl("run", *FAST, f"run.output_dir='{run_dir}'", f"run.max_steps={final}", *common)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "taking over the lock" in again.stderr and f"pid {proc.pid}" in again.stderr
    assert train_steps(run_dir) == list(range(1, final + 1))
    samples = [json.loads(line) for line in (run_dir / "samples" / "train.jsonl").read_text().splitlines()]
    per_step = collections.Counter(s["step"] for s in samples)
    assert sorted(per_step) == list(range(1, final + 1)) and set(per_step.values()) == {2}, per_step
    resumes = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert [r["checkpoint"] for r in resumes] == [f"step_{saved:06d}"]
    assert resumes[0]["changed"] == {"run.max_steps": [5000, final]}


# ----------------------------------------------------------------------------- resume only what matches
@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> Path:
    """A finished 2-step GRPO run (copied by each test that tries to resume it)."""
    from typer.testing import CliRunner

    from verl_cli.cli import app

    run_dir = tmp_path_factory.mktemp("grpo") / "run"
    result = CliRunner().invoke(app, ["run", *FAST, "run.max_steps=2", f"run.output_dir='{run_dir}'"])
    assert result.exit_code == 0, result.output[-3000:]
    return run_dir


def _copy(src: Path, tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_resuming_a_grpo_directory_as_ppo_or_with_another_model_exits_2_and_changes_nothing(
        tmp_path, run_verl, grpo_run):
    from verl_core.trainer import resolve_model_path

    run_dir = _copy(grpo_run, tmp_path)
    before = snapshot(run_dir)
    ppo = run_verl("run", *FAST, "--algo", "ppo", f"run.output_dir='{run_dir}'", "run.max_steps=3")
    assert ppo.returncode == 2, ppo.stderr[-3000:]
    assert 'algorithm.name: "grpo" -> "ppo"' in ppo.stderr and "Traceback" not in ppo.stderr
    for way_out in ("--output-dir", "--resume never", 'run.resume="force"'):
        assert way_out in ppo.stderr
    assert "algorithm.kl_coef" not in ppo.stderr  # another algorithm's settings are not listed one by one
    assert snapshot(run_dir) == before  # config.toml byte-identical, nothing else written either

    # The same model files under another path, and another seed: still another run.
    other = tmp_path / "model"
    import shutil

    shutil.copytree(resolve_model_path("builtin:tiny-qwen2-addition"), other)
    moved = run_verl("run", *FAST, "--model", str(other), "run.seed=7", f"run.output_dir='{run_dir}'",
                     "run.max_steps=3", "data.max_prompt_length=16", "rollout.max_new_tokens=4")
    assert moved.returncode == 2, moved.stderr[-3000:]
    assert '  model.path: "builtin:tiny-qwen2-addition" -> ' in moved.stderr
    assert "  run.seed: 1 -> 7" in moved.stderr and "Traceback" not in moved.stderr
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("change, listed", [
    ("rollout.n=2", "rollout.n: 4 -> 2"),  # GRPO's group: another baseline for every advantage
    ("rollout.temperature=0.7", "rollout.temperature: 1.0 -> 0.7"),  # samples from another distribution
])
def test_resuming_with_another_training_sampling_exits_2(tmp_path, run_verl, grpo_run, change, listed):
    # Before, the rollout section was all "safe": the resume trained on other samples and said so only in
    # resumes.jsonl. The engine (rollout.name) and the validation sampling still may change.
    run_dir = _copy(grpo_run, tmp_path)
    before = snapshot(run_dir)
    res = run_verl("run", *[a for a in FAST if not a.startswith(change.split("=")[0] + "=")], change,
                   f"run.output_dir='{run_dir}'", "run.max_steps=3")
    assert res.returncode == 2, res.stderr[-3000:]
    assert listed in res.stderr and "Traceback" not in res.stderr
    assert snapshot(run_dir) == before


def test_safe_changes_resume_and_are_recorded_while_config_toml_stays_the_first_runs(tmp_path, grpo_run, caplog):
    from typer.testing import CliRunner

    from verl_cli.cli import app

    run_dir = _copy(grpo_run, tmp_path)
    config = (run_dir / "config.toml").read_bytes()
    result = CliRunner().invoke(app, ["run", *FAST, "run.max_steps=3", "run.save_every=1", "data.max_val_samples=8",
                                      "rollout.val_temperature=0.5", f"run.output_dir='{run_dir}'"])
    assert result.exit_code == 0, result.output[-3000:]
    assert (run_dir / "config.toml").read_bytes() == config
    [entry] = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert entry["checkpoint"] == "step_000002" and entry["forced"] == []
    assert entry["changed"] == {"run.max_steps": [2, 3], "run.save_every": [50, 1], "data.max_val_samples": [40, 8],
                                "rollout.val_temperature": [0.0, 0.5]}
    # ... and said on the console, which the first run's config.toml no longer describes.
    assert (f"resuming {run_dir} with other settings that do not change what is trained (recorded in resumes.jsonl; "
            f"the earlier ones are in {run_dir / 'config.toml'}): run.max_steps: 2 -> 3; run.save_every: 50 -> 1; "
            f"data.max_val_samples: 40 -> 8; rollout.val_temperature: 0.0 -> 0.5") in caplog.messages
    assert train_steps(run_dir) == [1, 2, 3]


def test_force_resumes_what_differs_and_never_starts_over_setting_the_earlier_run_aside(tmp_path, grpo_run):
    from typer.testing import CliRunner

    from verl_cli.cli import app

    run_dir = _copy(grpo_run, tmp_path)
    config = (run_dir / "config.toml").read_bytes()
    forced = CliRunner().invoke(app, ["run", *FAST, "run.max_steps=3", "run.seed=7", "run.resume=force",
                                      f"run.output_dir='{run_dir}'"])
    assert forced.exit_code == 0, forced.output[-3000:]
    assert (run_dir / "config.toml").read_bytes() == config
    [entry] = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert entry["forced"] == ["run.seed"] and entry["changed"]["run.seed"] == [1, 7]
    assert train_steps(run_dir) == [1, 2, 3]

    again = CliRunner().invoke(app, ["run", *FAST, "run.max_steps=1", "--algo", "ppo", "--resume", "never",
                                     f"run.output_dir='{run_dir}'"])
    assert again.exit_code == 0, again.output[-3000:]
    [aside] = [p for p in run_dir.iterdir() if p.name.startswith("superseded-")]
    assert (aside / "config.toml").read_bytes() == config
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000003"]
    assert 'name = "ppo"' in (run_dir / "config.toml").read_text()
    assert train_steps(run_dir) == [1] and not (run_dir / "resumes.jsonl").exists()


# ----------------------------------------------------------------------------- checkpoint write order
def test_checkpoint_files_and_directories_are_fsynced_before_the_rename_and_latest(tmp_path, monkeypatch):
    """Every file, then its directories, reach the disk before the checkpoint's rename; the rename before
    ``latest`` names it; ``latest``'s own file before its rename."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", f"{src} -> {dst}"))
        real_replace(src, dst)

    def write(d: Path) -> None:
        (d / "actor").mkdir()
        (d / "actor" / "weights.bin").write_bytes(os.urandom(4096))
        (d / "trainer_state.json").write_text("{}")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    manager = CheckpointManager(tmp_path)
    final = manager.save(1, write, info={})
    root = str(tmp_path / "checkpoints")
    tmp = f"{root}/.tmp-step_000001-{os.getpid()}"
    order = [f"{k} {v}" for k, v in events]

    def at(entry: str) -> int:
        assert entry in order, f"{entry!r} not in {order}"
        return order.index(entry)

    publish = at(f"replace {tmp} -> {final}")
    for rel in ("actor/weights.bin", "trainer_state.json", "manifest.json"):
        assert at(f"fsync {tmp}/{rel}") < at(f"fsync {tmp}/actor") < publish
    assert at(f"fsync {tmp}/actor") < at(f"fsync {tmp}") < publish
    pointer = at(f"replace {root}/.latest-{os.getpid()} -> {root}/latest")
    assert publish < order.index(f"fsync {root}", publish) < at(f"fsync {root}/.latest-{os.getpid()}") < pointer
    assert order.index(f"fsync {root}", pointer) > pointer  # the pointer's rename, synced
    assert (Path(root) / "latest").read_text().strip() == "step_000001"
