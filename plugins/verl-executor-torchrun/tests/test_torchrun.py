"""The torchrun executor: real ``torchrun`` (``python -m torch.distributed.run``) with 2 processes on the CPU.

A facade script (``train_grpo.py``) trains 2 GRPO steps in one process and under torchrun over two;
the losses must agree to float precision. ``spmd_calls.py`` drives every kind of call (split, all,
broadcast, a stream, a context manager, errors on one rank) on a worker whose methods run
collectives, so a rank left out of a call would hang the test, not pass it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_core.config import ConfigError

HERE = Path(__file__).parent
# Small and exact: contiguous shards (balance_batches=false) whose micro-batches (4) divide each
# rank's 16 samples keep the micro-batches of one process, so the two runs optimise the same objective.
SMALL = ["data.batch_size=8", "rollout.n=4", "data.max_val_samples=16", "run.val_every=0", "run.threads=1",
         "run.val_before_train=false", "backend.micro_batch_size=4", "backend.log_prob_micro_batch_size=4"]
DEADLINE_S = 420  # against a hang of the ranks, not a measurement


def torchrun(*args: str, timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *args], capture_output=True, text=True, env=env, timeout=timeout)


def train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "ppo/actor_loss" in r]


@pytest.mark.slow
def test_two_torchrun_processes_train_like_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    single = subprocess.run([sys.executable, str(HERE / "train_grpo.py"), str(one), *SMALL], capture_output=True,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=DEADLINE_S)
    assert single.returncode == 0, single.stderr[-3000:]
    spmd = torchrun(str(HERE / "train_grpo.py"), str(two), *SMALL, "executor.balance_batches=false")
    assert spmd.returncode == 0, (spmd.stdout + spmd.stderr)[-4000:]

    result = json.loads((two / "result.json").read_text())
    assert result["executor"] == "torchrun" and result["rank"] == "0"  # only rank 0's train() returned
    assert 'name = "torchrun"' in (two / "config.toml").read_text()
    a, b = train_rows(one), train_rows(two)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    for key in ("ppo/actor_loss", "actor/grad_norm", "reward/mean", "response_length/mean"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5, abs=1e-7), key
    assert a[1]["ppo/actor_loss"] != 0.0 and a[0]["actor/grad_norm"] > 0  # the run trained something
    # Both ranks wrote their shard of the checkpoint; one process wrote one.
    shards = {p.name for p in (two / "checkpoints" / "step_000002" / "actor").glob("extra_rank*.pt")}
    assert shards == {"extra_rank0.pt", "extra_rank1.pt"}


@pytest.mark.slow
def test_every_kind_of_call_reaches_both_ranks(tmp_path):
    out = tmp_path / "seen.json"
    proc = torchrun(str(HERE / "spmd_calls.py"), str(out), timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    seen = json.loads(out.read_text())
    for run in ("first", "second"):  # a second executor in the same processes, as a second train()
        s = seen[run]
        # split: 3 values over 2 ranks (one padded), each rank's share doubled, results in order.
        assert s["double"] == [[2, 0, 4], [4, 0, 4], [6, 1, 4]]
        assert [w["rank"] for w in s["where"]] == [0, 1] and {w["tag"] for w in s["where"]} == {run}
        assert len({w["pid"] for w in s["where"]}) == 2
        assert s["rank_sum"] == 1.0  # broadcast: rank 0's answer of a collective over both
        assert s["weights"] == [["w0", 1.0], ["w1", 3.0], ["w2", 5.0]]
        assert s["context"] == [0, 1] and s["inside"] == 1.0
        message, notes = s["error_1"]
        assert message == "bad value on rank 1" and notes == ["raised in actor.fail_on on rank 1 of 2 (a torchrun worker)"]
        assert s["error_0"][0] == "bad value on rank 0"
        assert s["after_errors"] == [[10, 0, 2], [12, 1, 2]]  # the ranks are still in step
        assert s["first_weight"] == ["w0", 1.0] and s["after_stream"] == 1.0  # a stream left early


def test_outside_torchrun_it_says_how_to_start(monkeypatch):
    from verl_executor_torchrun import executor as module

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(module, "_SESSION", None)
    with pytest.raises(ConfigError, match=r"torchrun --nproc_per_node=N train.py"):
        module.TorchrunExecutor(module.TorchrunExecutorConfig())


def test_the_local_executor_refuses_to_run_copies_under_torchrun(monkeypatch):
    from verl_executor_local import LocalExecutor
    from verl_core.contracts import ExecutorConfig

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"executor.name='torchrun'"):
        LocalExecutor(ExecutorConfig())
    monkeypatch.setenv("WORLD_SIZE", "1")
    LocalExecutor(ExecutorConfig())  # one process under torchrun is one run


def test_the_facade_picks_torchrun_under_torchrun(monkeypatch):
    trainers = pytest.importorskip("verl.trainers")
    assert trainers.GRPOTrainer().config.executor.name == "local"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert trainers.GRPOTrainer().config.executor.name == "torchrun"
    chosen = trainers.GRPOTrainer(overrides=["executor.name='local'"])._build({}).config.executor.name
    assert chosen == "local"  # a config that names an executor keeps it


def test_registered_and_validated():
    from verl_core.registry import PluginRegistry
    from verl_executor_torchrun.executor import TorchrunExecutor, TorchrunExecutorConfig

    assert PluginRegistry().load("executor", "torchrun") is TorchrunExecutor
    for field, value in (("device", "tpu"), ("world_size", -1), ("idle_timeout_s", 0)):
        with pytest.raises(ConfigError, match=field):
            TorchrunExecutorConfig(**{field: value}).validate()
