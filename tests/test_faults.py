"""The fault catalogue (issue 22): what a run does when something goes wrong, one case per fault.

Each case does one thing wrong (a bad setting, a signal, a full disk, a flipped bit, a dead server,
bad rows, a killed worker) through the real `verl run` command (in this process, through typer's
test runner, or as a subprocess where the fault is a signal from outside) and states the outcome:
the exit status, a fragment of the message, and what is on disk afterwards. Every case also checks
that no traceback reaches the user.

Exit statuses (README, "Exit status"): 0 completed; 1 the run failed (diverged, a dead worker past
``run.max_restarts``, a checkpoint that cannot be written, a server that stopped answering); 2 a user
error (config, plugin, paths, data, a checkpoint that cannot be used, a reward that fails); 75
stopped by a signal after saving a checkpoint (re-run to resume); 128 + N stopped at once by a
second signal N, without saving.

Fast: the tiny built-in task, 2-3 steps, rewards in process. The Ray cases are marked slow.
"""

from __future__ import annotations

import errno
import http.server
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from verl_run_store import CheckpointManager

OUT = "run"
# Small but real: the default task, model, backend, rollout and algorithm.
FAST = ["data.batch_size=16", "rollout.n=4", "run.val_every=0", "data.max_val_samples=8", "run.threads=1",
        "run.val_before_train=false", "reward.isolation=\"none\""]


@dataclass
class Outcome:
    code: int
    output: str


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def cli(*args: str) -> Outcome:
    """`verl ...` in this process: its stdout and stderr together, then its warnings (which a terminal
    gets on stderr; under pytest the logging capture would keep them)."""
    from typer.testing import CliRunner

    from verl_cli.cli import app

    warnings = _Lines()
    logging.getLogger().addHandler(warnings)
    try:
        result = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        logging.getLogger().removeHandler(warnings)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Outcome(result.exit_code, result.output + "".join(f"\nwarning: {line}" for line in warnings.lines))


def verl_run(tmp: Path, *overrides: str, steps: int = 2) -> Outcome:
    return cli("run", *FAST, f"run.max_steps={steps}", f"run.output_dir='{tmp / OUT}'", *overrides)


# ----------------------------------------------------------------------------- what is on disk
def ckpts(tmp: Path) -> Path:
    return tmp / OUT / "checkpoints"


def latest(tmp: Path) -> str:
    return (ckpts(tmp) / "latest").read_text().strip()


def _last_saved(output: str) -> str:
    """The checkpoint the log last reported saved (``checkpoint saved: .../step_NNNNNN``)."""
    saved = re.findall(r"checkpoint saved: \S*?(step_\d{6})", output)
    return saved[-1] if saved else ""


def entries(tmp: Path) -> list[str]:
    return sorted(p.name for p in ckpts(tmp).iterdir()) if ckpts(tmp).is_dir() else []


def train_steps(tmp: Path) -> list[int]:
    rows = [json.loads(line) for line in (tmp / OUT / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "ppo/actor_loss" in r]


def metric(tmp: Path, key: str) -> list[float]:
    rows = [json.loads(line) for line in (tmp / OUT / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def only(*names: str) -> Callable[[Path, Outcome], None]:
    """The checkpoints directory holds exactly ``names`` (and ``latest`` names the last), nothing half-written."""
    def check(tmp: Path, _: Outcome) -> None:
        assert entries(tmp) == sorted([*names, "latest"] if names else []), entries(tmp)
        if names:
            assert latest(tmp) == names[-1]
            CheckpointManager.verify(ckpts(tmp) / names[-1])
    return check


def nothing_written(tmp: Path, _: Outcome) -> None:
    assert not (tmp / OUT).exists(), "a run directory was created before the error"


# ----------------------------------------------------------------------------- faults
def run_with(*overrides: str, steps: int = 2, flags: tuple[str, ...] = ()) -> Callable[..., Outcome]:
    def act(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
        return cli("run", *flags, *FAST, f"run.max_steps={steps}", f"run.output_dir='{tmp / OUT}'", *overrides)
    return act


def broken_toml(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    (tmp / "bad.toml").write_text("[run\nmax_steps = 2\n")
    return cli("run", "-c", tmp / "bad.toml", f"run.output_dir='{tmp / OUT}'")


def without_megatron(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    """``--backend megatron`` where verl-backend-megatron is not installed (hidden from package metadata:
    every first-party distribution is installed here)."""
    import importlib.metadata

    real = importlib.metadata.distributions
    mp.setattr(importlib.metadata, "distributions", lambda **kw: [
        d for d in real(**kw) if d.metadata["Name"] != "verl-backend-megatron"])
    return run_with(flags=("--backend", "megatron"))(tmp, mp)


def plugin_that_fails_to_import(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    site = tmp / "site"
    info = site / "verl_faults_broken-1.0.dist-info"
    info.mkdir(parents=True)
    (site / "_verl_faults_broken.py").write_text("raise ImportError('needs the package frobnicate')\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: verl-faults-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[verl.algorithms]\nfaults_broken = _verl_faults_broken:Algo\n\n"
                                           "[verl.plugin_api]\nv3 = _verl_faults_broken\n")
    mp.syspath_prepend(str(site))
    return verl_run(tmp, "algorithm.name='faults_broken'")


# ----- the output directory (issue 31)
def output_dir_is_a_file(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    (tmp / OUT).write_text("notes\n")
    return verl_run(tmp)


def _mounted(tmp: Path, options: str) -> Path:
    disk = tmp / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    return disk


def output_dir_not_writable(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    disk = _mounted(tmp, "ro,size=1m")  # read-only even for root, which file modes do not stop
    try:
        return cli("run", *FAST, "run.max_steps=2", f"run.output_dir='{disk / OUT}'")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def output_dir_on_a_full_disk(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    disk = _mounted(tmp, "size=2m")
    try:
        with open(disk / "filler", "wb") as f:
            try:
                f.write(b"\0" * (4 << 20))
            except OSError:
                pass
        return cli("run", *FAST, "run.max_steps=2", f"run.output_dir='{disk / OUT}'")
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def reward_file(tmp: Path, body: str) -> str:
    (tmp / "rewards.py").write_text(body)
    return f"reward.name='file:{tmp / 'rewards.py'}:score'"


def reward_raises(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    spec = reward_file(tmp, "def score(response, ground_truth):\n    raise ValueError('cannot parse ' + response)\n")
    return verl_run(tmp, spec)


def reward_raises_scored_zero(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    spec = reward_file(tmp, "def score(response, ground_truth):\n    raise ValueError('cannot parse')\n")
    return verl_run(tmp, spec, "reward.on_error='zero'")


def reward_hangs(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    # A reward that waits on a server that never answers: the worker process is killed at the limit.
    spec = reward_file(tmp, "import time\ndef score(response, ground_truth):\n    time.sleep(3600)\n")
    return verl_run(tmp, spec, "reward.isolation='process'", "reward.timeout=1")


# ----- signals
def signal_during_step(step: int, *signums: int) -> Callable[[pytest.MonkeyPatch], None]:
    """Deliver ``signums`` to this process while RL step ``step`` runs (as a scheduler would)."""
    def install(mp: pytest.MonkeyPatch) -> None:
        from verl_core.trainer import Trainer

        real = Trainer.run_step

        def run_step(self: Trainer) -> dict[str, float]:
            if self.step == step:
                for signum in signums:
                    os.kill(os.getpid(), signum)
            return real(self)

        mp.setattr(Trainer, "run_step", run_step)
    return install


def signalled(step: int, *signums: int, overrides: tuple[str, ...] = ()) -> Callable[..., Outcome]:
    def act(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
        signal_during_step(step, *signums)(mp)
        # A fresh `verl` process starts with Python's Ctrl-C handler; in the full suite an earlier test left
        # SIGINT ignored in this process once (the run then finished all steps), so give it that handler.
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return verl_run(tmp, *overrides, steps=3)
        finally:
            signal.signal(signal.SIGINT, previous)
    return act


BIT_IDENTICAL = ["backend.lr_schedule='cosine'", "backend.min_lr_ratio=0.1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The actor's weights after 3 uninterrupted steps (what every resumed run must end with)."""
    from verl_core.trainer import Trainer

    out = tmp_path_factory.mktemp("uninterrupted")
    trainer = Trainer.from_config(overrides=[*FAST, *BIT_IDENTICAL, "run.max_steps=3", f"run.output_dir='{out}'"])
    trainer.train()
    return {k: v.clone() for k, v in trainer.actor.iter_weights()}


def resume_matches(uninterrupted: dict[str, torch.Tensor], tmp: Path, *, resumed_at: str) -> None:
    """Run the same command again to step 3: it resumes from ``resumed_at`` and ends bit-identical."""
    from verl_core.trainer import Trainer

    trainer = Trainer.from_config(overrides=[*FAST, *BIT_IDENTICAL, "run.max_steps=3",
                                             f"run.output_dir='{tmp / OUT}'"])
    trainer.train()
    assert trainer.resumed_from.name == resumed_at
    got = dict(trainer.actor.iter_weights())
    assert got.keys() == uninterrupted.keys()
    for k in uninterrupted:
        assert torch.equal(got[k], uninterrupted[k]), k
    assert train_steps(tmp) == [1, 2, 3]


def sigterm_from_outside(tmp: Path, mp: pytest.MonkeyPatch, *, twice: bool = False) -> Outcome:
    """The real command in a process of its own, sent SIGTERM by another (a scheduler)."""
    log = open(tmp / "verl.log", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Twice: longer steps (64 prompts x 8), so that the second signal surely comes before the step ends.
    longer = ["data.batch_size=64", "rollout.n=8"] if twice else []
    proc = subprocess.Popen([sys.executable, "-m", "verl_cli", "run", *FAST, *longer, "run.max_steps=500",
                             f"run.output_dir='{tmp / OUT}'"], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            log.seek(0)
            if "step 2/" in log.read():
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        if twice:  # once the first one was seen (two pending SIGTERMs would be delivered as one)
            deadline = time.monotonic() + 30
            while proc.poll() is None and time.monotonic() < deadline:
                log.seek(0)
                if "SIGTERM received" in log.read():
                    break
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log.seek(0)
    return Outcome(proc.returncode, log.read())


def stopped_after_a_step_with_its_checkpoint(tmp: Path, outcome: Outcome) -> None:
    names = [n for n in entries(tmp) if n.startswith("step_")]
    assert names and latest(tmp) == names[-1] and not [n for n in entries(tmp) if n.startswith(".")], entries(tmp)
    step = int(names[-1].split("_")[1])
    assert step >= 2 and f"after step {step}" in outcome.output
    CheckpointManager.verify(ckpts(tmp) / names[-1])
    assert train_steps(tmp) == list(range(1, step + 1))


def stopped_at_once(tmp: Path, outcome: Outcome) -> None:
    # No checkpoint of the step it was in; whatever is there is complete (nothing half-written).
    assert not [n for n in entries(tmp) if n.startswith((".", "corrupt"))], entries(tmp)
    if (ckpts(tmp) / "latest").exists():
        CheckpointManager.verify(ckpts(tmp) / latest(tmp))


# ----- checkpoint writes
def failing_checkpoint_save(mp: pytest.MonkeyPatch, fail_on: set[int], err: int = errno.EIO) -> None:
    """The n-th checkpoint's write (n in ``fail_on``) writes part of a file, then fails as the disk would."""
    import verl_backend_fsdp.backend as fsdp

    real = torch.save
    calls = {"n": 0}

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if "extra_rank" in str(f):
            calls["n"] += 1
            if calls["n"] in fail_on:
                Path(f).write_bytes(b"\0" * 1000)
                raise OSError(err, os.strerror(err), str(f))
        return real(obj, f, *args, **kwargs)

    mp.setattr(fsdp.torch, "save", save)


def write_error(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    failing_checkpoint_save(mp, {2})
    return verl_run(tmp, "run.save_every=1", steps=3)


def write_error_carried_on(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    failing_checkpoint_save(mp, {2})
    return verl_run(tmp, "run.save_every=1", "run.on_checkpoint_error='continue'", steps=3)


def final_write_error_carried_on(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    failing_checkpoint_save(mp, {3})
    return verl_run(tmp, "run.save_every=1", "run.on_checkpoint_error='continue'", steps=3)


def disk_full(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    """A real 10 MiB filesystem: one checkpoint (6 MiB) fits, the next one does not."""
    disk = tmp / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a size-limited tmpfs here (needs root); write_error injects the error instead")
    try:
        outcome = cli("run", *FAST, "run.max_steps=3", "run.save_every=1", "run.keep_checkpoints=1",
                      f"run.output_dir='{disk / OUT}'")
        only("step_000001")(disk, outcome)
        outcome.output += f"\n[on disk: {entries(disk)}]"
        return outcome
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ----- corrupt checkpoints
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with complete checkpoints of steps 1 and 2 (copied by each case that spoils one)."""
    tmp = tmp_path_factory.mktemp("two-checkpoints")
    outcome = cli("run", *FAST, *BIT_IDENTICAL, "run.max_steps=2", "run.save_every=1", f"run.output_dir='{tmp / OUT}'")
    assert outcome.code == 0, outcome.output[-3000:]
    return tmp / OUT


def spoiled(how: str, *overrides: str, which: tuple[str, ...] = ("step_000002",),
            resume: str = "") -> Callable[..., Outcome]:
    def act(tmp: Path, mp: pytest.MonkeyPatch, two_checkpoints: Path) -> Outcome:
        shutil.copytree(two_checkpoints, tmp / OUT)
        for name in which:
            f = ckpts(tmp) / name / "actor" / "dcp" / "__0_0.distcp"
            data = bytearray(f.read_bytes())
            if how == "bitflip":
                data[len(data) // 2] ^= 0x10
            else:
                data = data[: len(data) // 2]
            f.write_bytes(bytes(data))
        extra = (f"run.resume='{ckpts(tmp) / resume}'",) if resume else ()
        return cli("run", *FAST, *BIT_IDENTICAL, "run.max_steps=3", f"run.output_dir='{tmp / OUT}'", *overrides, *extra)
    act.needs_checkpoints = True  # type: ignore[attr-defined]
    return act


def fell_back_to_step_1(tmp: Path, outcome: Outcome) -> None:
    assert "corrupt-step_000002" in entries(tmp) and latest(tmp) == "step_000003", entries(tmp)
    assert "actor/dcp/__0_0.distcp" in outcome.output
    state = json.loads((ckpts(tmp) / "step_000003" / "trainer_state.json").read_text())
    assert state["step"] == 3
    # The resumed run trained steps 2 and 3 again, from step 1's checkpoint; step 2's first rows were cut.
    assert train_steps(tmp) == [1, 2, 3]


def left_as_it_was(tmp: Path, outcome: Outcome) -> None:
    assert entries(tmp) == ["latest", "step_000001", "step_000002"], entries(tmp)
    assert latest(tmp) == "step_000002"


def stale_temporary(tmp: Path, mp: pytest.MonkeyPatch, two_checkpoints: Path) -> Outcome:
    """A save killed mid-write (kill -9) left a temporary directory: never taken, removed by the next save."""
    shutil.copytree(two_checkpoints, tmp / OUT)
    shutil.copytree(ckpts(tmp) / "step_000002", ckpts(tmp) / ".tmp-step_000003-999999999")
    (ckpts(tmp) / ".tmp-step_000003-999999999" / "manifest.json").unlink()
    return cli("run", *FAST, *BIT_IDENTICAL, "run.max_steps=3", f"run.output_dir='{tmp / OUT}'")


stale_temporary.needs_checkpoints = True  # type: ignore[attr-defined]


# ----- bad data rows
def rows_file(tmp: Path, *, overlong: bool = False) -> Path:
    from verl_task_arithmetic.addition import make_dataset

    good = make_dataset()[0][:48]
    lines = [json.dumps(r).encode() for r in good]
    lines[10] = b'{"prompt": "1+1=", "answer": '            # cut short: not JSON
    lines[20] = b'{"prompt": "\xff\xfe", "answer": "2"}'    # not UTF-8
    lines[30] = json.dumps({"question": "2+2=", "answer": "4"}).encode()  # no prompt column
    lines[40] = b"[1, 2]"                                  # not an object
    if overlong:
        lines.append(json.dumps({**good[0], "prompt": [{"role": "user", "content": "1+" * 10 + "1="}]}).encode())
    (tmp / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return tmp / "train.jsonl"


def bad_rows(*overrides: str, overlong: bool = False) -> Callable[..., Outcome]:
    def act(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
        return verl_run(tmp, f"data.train='{rows_file(tmp, overlong=overlong)}'", *overrides)
    return act


def bad_rows_counted(n: int) -> Callable[[Path, Outcome], None]:
    def check(tmp: Path, outcome: Outcome) -> None:
        assert metric(tmp, "data/train_bad_rows") == [float(n)]
        assert train_steps(tmp) == [1, 2]
    return check


# ----- remote services
class FakeOpenAIServer(http.server.ThreadingHTTPServer):
    """An OpenAI-compatible completions server that answers ``good`` completion requests, then fails
    (``"503"``: busy; ``"hang"``: accepts and never answers)."""

    daemon_threads = True

    def __init__(self, good: int, failure: str) -> None:
        self.good, self.failure, self.completions = good, failure, 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.shutdown()
        self.server_close()


class _FakeHandler(http.server.BaseHTTPRequestHandler):
    server: FakeOpenAIServer

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json(200, {"data": [{"id": "fake"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        with self.server.lock:
            self.server.completions += 1
            ok = self.server.completions <= self.server.good
        if not ok:
            if self.server.failure == "hang":
                self.server.stop.wait(60)
                return
            self._json(503, {"error": "overloaded"})
            return
        prompts = body["prompt"] if body["prompt"] and isinstance(body["prompt"][0], list) else [body["prompt"]]
        rng = random.Random(body.get("seed"))
        choices = []
        for k in range(len(prompts) * body["n"]):
            ids = [rng.randrange(3, 16) for _ in range(body["max_tokens"])]  # the tiny model's 16 tokens
            choices.append({"index": k, "token_ids": ids, "finish_reason": "length",
                            "logprobs": {"token_logprobs": [-1.0] * len(ids)}})
        self._json(200, {"choices": choices})


def openai_server(good: int, failure: str) -> Callable[..., Outcome]:
    def act(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
        server = FakeOpenAIServer(good, failure)
        try:
            # 16 prompts a step, one request each: `good` requests cover good // 16 steps.
            outcome = verl_run(tmp, "rollout.name='openai'", f"rollout.base_url='{server.url}'",
                               "rollout.weight_sync='ignore'", "rollout.max_retries=2", "rollout.backoff_s=0.05",
                               "rollout.timeout_s=2", "rollout.deadline_s=5", "run.save_every=1", steps=3)
        finally:
            server.close()
        outcome.output = outcome.output.replace(server.url, "<URL>")
        return outcome
    return act


def server_down(tmp: Path, mp: pytest.MonkeyPatch) -> Outcome:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outcome = verl_run(tmp, "rollout.name='openai'", f"rollout.base_url='http://127.0.0.1:{port}'",
                       "rollout.weight_sync='ignore'", "rollout.max_retries=1", "rollout.backoff_s=0.05")
    outcome.output = outcome.output.replace(f"http://127.0.0.1:{port}", "<URL>")
    return outcome


def stopped_at_step_1(tmp: Path, outcome: Outcome) -> None:
    # Step 2 never trained on the part of its batch that came back: its checkpoint and metrics do not exist.
    only("step_000001")(tmp, outcome)
    assert train_steps(tmp) == [1]


# ----- a dying worker (Ray)
RAY = ["executor.name='ray'", "executor.world_size=2", "data.batch_size=8", "run.save_every=2"]


def kill_a_worker(tmp: Path, *overrides: str, kills: int = 1, steps: int = 6) -> Outcome:
    """`verl run` on 2 Ray ranks; SIGKILL rank 1's process after step 2's save (and again after each restart)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "verl_executor_ray" / "tests"))
    from ray_test_utils import alive, cmdline, descendants

    log = open(tmp / "verl.log", "w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "verl_cli", "run", *FAST, *RAY, f"run.max_steps={steps}",
                             f"run.output_dir='{tmp / OUT}'", *overrides], stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    seen: set[int] = set()
    before: set[int] = set()  # the worker hosts of the groups already killed into
    try:
        for n in range(kills):
            deadline = time.monotonic() + 300
            while proc.poll() is None and time.monotonic() < deadline:
                log.seek(0)
                since = log.read().split("back at step")
                hosts = sorted(p for p in descendants(proc.pid) if "WorkerHost" in cmdline(p))
                seen.update(descendants(proc.pid))
                # The first kill comes as soon as step 2's checkpoint is saved: inside step 3 or 4, before the
                # next save (steps take ~0.1 s on a fast machine, so waiting for a later line could miss it).
                # Each later kill comes as soon as the groups are back (2 new hosts, the restore done).
                due = "step_000002" in since[-1] if n == 0 else not before & set(hosts)
                if len(since) == n + 1 and len(hosts) == 2 and due:
                    before.update(hosts)
                    os.kill(hosts[1], signal.SIGKILL)
                    break
                time.sleep(0.02)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 15
    while alive(sorted(seen)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(sorted(seen)), "worker processes outlived the run"
    log.seek(0)
    return Outcome(proc.returncode, log.read())


@pytest.fixture(scope="module")
def ray_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("ray-uninterrupted")
    res = subprocess.run([sys.executable, "-m", "verl_cli", "run", *FAST, *RAY, "run.max_steps=6",
                          f"run.output_dir='{tmp / OUT}'"], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return tmp


def worker_killed_restarted(tmp: Path, mp: pytest.MonkeyPatch, ray_uninterrupted: Path) -> Outcome:
    outcome = kill_a_worker(tmp, "run.max_restarts=1")
    # Every step once in the metrics, as if uninterrupted, and the same final model.
    assert train_steps(tmp) == [1, 2, 3, 4, 5, 6]
    assert metric(tmp, "run/restarts")[-1] == 1.0
    same_policy(ckpts(tmp) / "step_000006", ckpts(ray_uninterrupted) / "step_000006", tmp)
    return outcome


worker_killed_restarted.needs_ray_reference = True  # type: ignore[attr-defined]


def same_policy(a: Path, b: Path, tmp: Path) -> None:
    from safetensors.torch import load_file

    from verl_cli.export import export_checkpoint

    weights = []
    for i, ckpt in enumerate((a, b)):
        export_checkpoint(ckpt, tmp / f"hf{i}")
        weights.append({k: v for f in sorted((tmp / f"hf{i}").glob("*.safetensors")) for k, v in load_file(f).items()})
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k


# ----------------------------------------------------------------------------- the catalogue
@dataclass
class Case:
    id: str
    action: Callable[..., Outcome]
    code: int
    message: str
    on_disk: str
    check: Callable[[Path, Outcome], None] | None = None
    slow: bool = False


CASES = [
    # --- configuration and paths: refused before any model loads, nothing written
    Case("unknown_key", run_with("algorithm.kl=0.1"), 2,
         "algorithm.kl: unknown key (did you mean one of 'kl_coef', 'kl_estimator', 'kl_in_reward'?)", "nothing",
         nothing_written),
    Case("unknown_section", run_with("optimizer.lr=1"), 2, "optimizer: unknown section", "nothing", nothing_written),
    Case("wrong_type", run_with("algorithm.kl_coef=abc"), 2, "algorithm.kl_coef: expected a number", "nothing",
         nothing_written),
    Case("value_out_of_range", run_with("data.batch_size=0"), 2, "data.batch_size: must be at least 1", "nothing",
         nothing_written),
    Case("bad_on_checkpoint_error", run_with("run.on_checkpoint_error='retry'"), 2,
         "run.on_checkpoint_error: must be 'stop' or 'continue'", "nothing", nothing_written),
    Case("bad_on_corrupt_checkpoint", run_with("run.on_corrupt_checkpoint='ignore'"), 2,
         "run.on_corrupt_checkpoint: must be 'fallback' or 'error'", "nothing", nothing_written),
    Case("negative_max_restarts", run_with("run.max_restarts=-1"), 2, "run.max_restarts: must be >= 0", "nothing",
         nothing_written),
    Case("bad_save_on_signal", run_with("run.save_on_signal=1"), 2, "run.save_on_signal: expected true or false",
         "nothing", nothing_written),
    Case("negative_max_bad_rows", run_with("data.max_bad_rows=-2"), 2, "data.max_bad_rows: must be >= 0", "nothing",
         nothing_written),
    Case("negative_rollout_deadline", run_with("rollout.name='openai'", "rollout.deadline_s=-1"), 2,
         "rollout.deadline_s: must be >= 0 seconds", "nothing", nothing_written),
    Case("unknown_plugin", run_with(flags=("--algo", "grop")), 2, "Did you mean 'grpo'", "nothing", nothing_written),
    Case("plugin_not_installed", without_megatron, 2, "pip install verl-backend-megatron",
         "nothing", nothing_written),
    Case("plugin_fails_to_import", plugin_that_fails_to_import, 2, "ImportError: needs the package frobnicate",
         "nothing", nothing_written),
    Case("missing_model_path", run_with(flags=("--model", "/nonexistent/model")), 2,
         "model.path: '/nonexistent/model' does not exist", "nothing", nothing_written),
    Case("missing_data_path", run_with(flags=("--data", "/nonexistent/train.jsonl")), 2,
         "data.train: data file '/nonexistent/train.jsonl' does not exist", "nothing", nothing_written),
    Case("broken_toml", broken_toml, 2, "is not valid TOML", "nothing", nothing_written),
    Case("negative_lr", run_with("backend.lr=-1"), 2, "backend.lr: must be > 0, got -1.0", "nothing",
         nothing_written),
    Case("zero_critic_lr", run_with("backend.critic_lr=0", flags=("--algo", "ppo")), 2,
         "backend.critic_lr: must be > 0, got 0.0", "nothing", nothing_written),
    Case("output_dir_is_a_file", output_dir_is_a_file, 2, "is a file; give --output-dir a directory",
         "the file as it was", lambda tmp, o: (tmp / OUT).read_text() == "notes\n" or pytest.fail("file changed")),
    Case("output_dir_not_writable", output_dir_not_writable, 2, "is not writable by this user", "nothing"),
    Case("output_dir_on_a_full_disk", output_dir_on_a_full_disk, 2, "MiB free and the disk is full", "nothing",
         lambda tmp, o: not (tmp / "disk" / OUT).exists() or pytest.fail("a run directory was created")),
    Case("ray_address_without_cluster", run_with("executor.address='127.0.0.1:1'", flags=("--executor", "ray")), 2,
         "no Ray cluster answers at '127.0.0.1:1'", "no checkpoint",
         lambda tmp, o: ("ray start --head" in o.output and "drop executor.address" in o.output
                         and not (ckpts(tmp)).exists()) or pytest.fail(o.output[-2000:])),
    Case("missing_config_file", run_with(flags=("-c", "/nonexistent/run.toml")), 2,
         "config file '/nonexistent/run.toml' does not exist", "nothing", nothing_written),
    # --- rewards and divergence
    Case("reward_raises", reward_raises, 2, "ValueError: cannot parse", "no checkpoint", only()),
    Case("reward_raises_scored_zero", reward_raises_scored_zero, 0, "final val/reward_mean",
         "step_000002; reward/errors counted",
         lambda tmp, o: (only("step_000002")(tmp, o), metric(tmp, "reward/errors")[0] > 0)),
    Case("reward_hangs", reward_hangs, 2, "exceeded reward.timeout=1s; the reward worker process was killed",
         "no checkpoint", only()),
    Case("nan_loss", run_with("backend.lr=1e30", "run.save_every=1", steps=3), 1,
         "training diverged: at RL step 2:", "step_000001 only", only("step_000001")),
    # --- preemption
    Case("sigterm", signalled(2, signal.SIGTERM), 75, "stopped by SIGTERM after step 2; checkpoint",
         "step_000002 (the step it was in, complete)", only("step_000002")),
    Case("first_ctrl_c", signalled(2, signal.SIGINT), 75, "stopped by SIGINT after step 2", "step_000002",
         only("step_000002")),
    Case("sigterm_resumes_bit_identical", signalled(2, signal.SIGTERM, overrides=tuple(BIT_IDENTICAL)), 75,
         "run the same command again to resume", "step_000002; the re-run ends bit-identical to an uninterrupted run",
         only("step_000002")),
    Case("second_signal", signalled(2, signal.SIGTERM, signal.SIGTERM, overrides=("run.save_every=1",)), 143,
         "interrupted (SIGTERM); the last complete checkpoint is kept", "step_000001 only (no save of step 2)",
         only("step_000001")),
    Case("signal_without_save_on_signal", signalled(2, signal.SIGINT, overrides=("run.save_every=1",
                                                                                "run.save_on_signal=false")), 130,
         "interrupted (SIGINT)", "step_000001 only", only("step_000001")),
    Case("sigterm_from_another_process", sigterm_from_outside, 75, "stopped by SIGTERM after step",
         "the step it was in, complete", stopped_after_a_step_with_its_checkpoint),
    Case("two_sigterms_from_another_process", lambda tmp, mp: sigterm_from_outside(tmp, mp, twice=True), 143,
         "interrupted (SIGTERM)", "only complete checkpoints, nothing half-written", stopped_at_once),
    # --- checkpoint writes
    Case("checkpoint_write_error", write_error, 1,
         "cannot write checkpoint", "step_000001; no step_000002, no temporary directory", only("step_000001")),
    Case("disk_full", disk_full, 1, "the partial checkpoint was removed and latest still names step_000001",
         "step_000001 (10 MiB tmpfs)"),
    Case("checkpoint_write_error_carried_on", write_error_carried_on, 0, "going on without it",
         "step_000001, step_000003; checkpoint/failed_saves=1",
         lambda tmp, o: (only("step_000001", "step_000003")(tmp, o),
                         metric(tmp, "checkpoint/failed_saves") == [1.0] or pytest.fail("no failed_saves metric"))),
    Case("final_checkpoint_write_error", final_write_error_carried_on, 1, "cannot write checkpoint",
         "step_000001, step_000002 (the final one cannot be skipped)", only("step_000001", "step_000002")),
    # --- corrupt checkpoints on resume
    Case("corrupt_bit_flip_falls_back", spoiled("bitflip"), 0, "does not match its checksum",
         "corrupt-step_000002 set aside; resumed from step_000001 to step_000003", fell_back_to_step_1),
    Case("truncated_file_falls_back", spoiled("truncate"), 0, "bytes, the manifest says",
         "corrupt-step_000002 set aside; resumed from step_000001", fell_back_to_step_1),
    Case("corrupt_refused", spoiled("bitflip", "run.on_corrupt_checkpoint='error'"), 2,
         "actor/dcp/__0_0.distcp does not match its checksum; set run.on_corrupt_checkpoint=\"fallback\"",
         "unchanged", left_as_it_was),
    Case("every_checkpoint_corrupt", spoiled("bitflip", which=("step_000001", "step_000002")), 2,
         "is corrupt", "both set aside as corrupt-step_*",
         lambda tmp, o: entries(tmp) == ["corrupt-step_000001", "corrupt-step_000002", "latest"] or pytest.fail(
             str(entries(tmp)))),
    Case("named_checkpoint_corrupt", spoiled("bitflip", resume="step_000002"), 2, "does not match its checksum",
         "unchanged (the named checkpoint is never replaced by another)", left_as_it_was),
    Case("half_written_checkpoint_left_by_kill_9", stale_temporary, 0, "final val/reward_mean",
         "the temporary directory removed; resumed from step_000002",
         lambda tmp, o: only("step_000002", "step_000003")(tmp, o)),
    # --- bad data rows
    Case("bad_rows_stop_by_default", bad_rows(), 2, "line 11 is not valid JSON",
         "nothing", lambda tmp, o: "data.max_bad_rows" in o.output or pytest.fail("no hint")),
    Case("bad_rows_skipped_and_counted", bad_rows("data.max_bad_rows=4"), 0, "skipped 4 bad training rows of 48",
         "step_000002; data/train_bad_rows=4", bad_rows_counted(4)),
    Case("bad_rows_over_the_cap", bad_rows("data.max_bad_rows=3"), 2, "more than data.max_bad_rows=3 bad rows",
         "nothing", None),
    Case("overlong_prompt_counted_as_bad", bad_rows("data.max_bad_rows=5", "data.overlong='error'", overlong=True), 0,
         "skipped 5 bad training rows of 49", "data/train_bad_rows=5", bad_rows_counted(5)),
    # --- remote services
    Case("rollout_server_down", server_down, 1, "no OpenAI-compatible server answered at <URL>", "no checkpoint",
         only()),
    Case("rollout_server_busy_mid_run", openai_server(good=16 + 8, failure="503"), 1,
         "POST <URL>/v1/completions failed after 3 attempts: HTTP 503", "step_000001; metrics of step 1 only",
         stopped_at_step_1),
    Case("rollout_server_stops_answering", openai_server(good=16 + 8, failure="hang"), 1,
         "POST <URL>/v1/completions failed", "step_000001; metrics of step 1 only", stopped_at_step_1),
    # --- a dying worker (Ray)
    # The kill comes after step 2's save; on a fast machine step 3's or 4's save can land first: the latest
    # checkpoint is the last one the log says was saved, and not the end of the run.
    Case("worker_killed_no_restarts", lambda tmp, mp: kill_a_worker(tmp), 1,
         "died during", "the last save (step_000002 or a later one before the kill)",
         lambda tmp, o: ("set run.max_restarts" in o.output
                         and latest(tmp) == _last_saved(o.output) and latest(tmp) < "step_000006")
         or pytest.fail(o.output[-2000:]), slow=True),
    Case("worker_killed_restarted", worker_killed_restarted, 0, "restarting the worker groups (restart 1 of 1)",
         "step_000006, same weights as an uninterrupted run; each step once in metrics.jsonl", slow=True),
    Case("worker_killed_past_max_restarts", lambda tmp, mp: kill_a_worker(tmp, "run.max_restarts=1", kills=2), 1,
         "(after 1 restart(s) of the worker groups; run.max_restarts=1)", "the last checkpoint", slow=True),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow, pytest.mark.heavy] if c.slow else [])
                                  for c in CASES])
def test_fault(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    extra = []
    if getattr(case.action, "needs_checkpoints", False):
        extra.append(request.getfixturevalue("two_checkpoints"))
    if getattr(case.action, "needs_ray_reference", False):
        extra.append(request.getfixturevalue("ray_uninterrupted"))
    outcome = case.action(tmp_path, monkeypatch, *extra)
    assert outcome.code == case.code, outcome.output[-3000:]
    assert case.message in outcome.output, outcome.output[-3000:]
    assert "Traceback" not in outcome.output, outcome.output[-3000:]
    if case.check is not None:
        case.check(tmp_path, outcome)
    if case.id == "sigterm_resumes_bit_identical":
        monkeypatch.undo()
        resume_matches(request.getfixturevalue("uninterrupted"), tmp_path, resumed_at="step_000002")


def test_the_catalogue_has_every_fault_the_issue_names() -> None:
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)


def test_checksums_are_checked_in_parallel_and_old_sha256_manifests_still_verify(tmp_path: Path) -> None:
    import hashlib

    manager = CheckpointManager(tmp_path)
    path = manager.save(1, lambda d: [(d / f"f{i}").write_bytes(os.urandom(1 << 16)) for i in range(4)], info={})
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["checksum"] in ("xxh3_128", "sha256")
    # A manifest written before xxh3 (sha256 per file) verifies as it did.
    for rel, meta in manifest["files"].items():
        manifest["files"][rel] = {"bytes": meta["bytes"], "sha256": hashlib.sha256((path / rel).read_bytes()).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    CheckpointManager.verify(path)
    (path / "f2").write_bytes(os.urandom(1 << 16))
    with pytest.raises(Exception, match="f2 does not match its checksum"):
        CheckpointManager.verify(path)
