"""`verl run --executor ray` end to end: colocated and split GRPO, a killed worker, Ctrl-C.

Each run starts its own local Ray instance in the CLI process; every test checks that no process
the run started outlives it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from ray_test_utils import alive, cmdline, descendants, ray_cluster, wait_for

pytestmark = pytest.mark.slow

GRPO = ["run", "--backend", "fsdp", "--rollout", "hf", "--algo", "grpo", "--executor", "ray", "--resume", "never"]
SMALL = ["data.batch_size=8", "rollout.n=4", "data.max_val_samples=16", "run.val_every=0", "run.threads=1"]


def run_and_watch(start_verl, *args, timeout=600, env=None):
    """Run the CLI in the background, noting every process under it; returns (proc, log, {pid: command})."""
    proc = start_verl(*args, env=env)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        for pid in descendants(proc.pid):
            seen[pid] = cmdline(pid) or seen.get(pid, "")
        time.sleep(0.5)
    if proc.poll() is None:
        raise AssertionError(f"verl run did not finish in {timeout}s")
    proc.log.seek(0)
    return proc, proc.log.read(), seen


def train_steps(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "ppo/actor_loss" in r]


def test_colocated_grpo_on_two_processes(start_verl, tmp_path):
    out = tmp_path / "run"
    proc, log, seen = run_and_watch(start_verl, *GRPO, "--nnodes", "1", "--procs-per-node", "2", "--max-steps", "2",
                                    "--output-dir", str(out), *SMALL)
    assert proc.returncode == 0, log[-3000:]
    assert "step 2/2" in log
    assert train_steps(out) == [1, 2]
    config = (out / "config.toml").read_text()
    assert 'name = "ray"' in config and "world_size = 2" in config
    # Both ranks wrote their shard of the checkpoint.
    ckpt = out / "checkpoints" / "step_000002" / "actor"
    assert {p.name for p in ckpt.glob("extra_rank*.pt")} == {"extra_rank0.pt", "extra_rank1.pt"}
    hosts = [p for p, cmd in seen.items() if "WorkerHost" in cmd]
    assert len(hosts) == 2, seen
    assert wait_for(lambda: not alive(sorted(seen)), 15), [cmdline(p) for p in alive(sorted(seen))]


def test_split_placement_grpo(start_verl, tmp_path):
    out = tmp_path / "run"
    proc, log, seen = run_and_watch(start_verl, *GRPO, "executor.world_size=2", "executor.pools={gen=1}",
                                    'executor.placement={rollout="gen"}', "--max-steps", "2",
                                    "--output-dir", str(out), *SMALL)
    assert proc.returncode == 0, log[-3000:]
    assert train_steps(out) == [1, 2]
    hosts = [p for p, cmd in seen.items() if "WorkerHost" in cmd]
    assert len(hosts) == 3, seen  # two training ranks and the rollout's own process
    assert wait_for(lambda: not alive(sorted(seen)), 15), [cmdline(p) for p in alive(sorted(seen))]


def start_long_run(start_verl, tmp_path):
    out = tmp_path / "run"
    proc = start_verl(*GRPO, "executor.world_size=2", "--max-steps", "500", "--output-dir", str(out), *SMALL)

    def progressed():
        proc.log.seek(0)
        return "step 2/" in proc.log.read() or proc.poll() is not None

    assert wait_for(progressed, 300), "the run did not reach step 2"
    assert proc.poll() is None, "the run ended early"
    return proc, set(descendants(proc.pid))


def test_killing_a_worker_stops_the_run_with_role_rank_and_cause(start_verl, tmp_path):
    proc, seen = start_long_run(start_verl, tmp_path)
    hosts = sorted(p for p in seen if "WorkerHost" in cmdline(p))
    assert len(hosts) == 2, [cmdline(p) for p in seen]
    os.kill(hosts[1], signal.SIGKILL)
    # A deadline against a hang (the run has 498 steps left), not a measurement.
    assert wait_for(lambda: proc.poll() is not None, 120), "the run kept going after a worker was killed"
    proc.log.seek(0)
    log = proc.log.read()
    assert proc.returncode == 1, log[-3000:]
    match = re.search(r"error: the (actor|rollout) worker, rank (\d) of 2 on pool 'default' \(pid (\d+).*\), died during "
                      r"(\w+): its process exited without a Python error", log)
    assert match, log[-3000:]
    assert int(match.group(3)) == hosts[1]
    assert "Traceback" not in log.split("verl: run failed")[-1]
    assert wait_for(lambda: not alive(sorted(seen)), 15), [cmdline(p) for p in alive(sorted(seen))]


def test_ctrl_c_shuts_ray_and_every_worker_down(start_verl, tmp_path):
    proc, seen = start_long_run(start_verl, tmp_path)
    proc.send_signal(signal.SIGINT)
    assert wait_for(lambda: proc.poll() is not None, 60), "Ctrl-C did not stop the run"
    proc.log.seek(0)
    log = proc.log.read()
    # A first Ctrl-C finishes the step and saves it (run.save_on_signal), then exits 75 (re-run to resume).
    assert proc.returncode == 75, log[-3000:]
    assert "stopped by SIGINT after step" in log
    assert wait_for(lambda: not alive(sorted(seen)), 15), [cmdline(p) for p in alive(sorted(seen))]


def test_joins_a_running_cluster_and_leaves_it_running(start_verl, tmp_path):
    """`executor.address` joins a cluster started with `ray start`; the run kills its workers, not the cluster."""
    with ray_cluster(head_cpus=2) as (address, head):
        out = tmp_path / "run"
        proc, log, seen = run_and_watch(start_verl, *GRPO, "executor.world_size=2", f"executor.address='{address}'",
                                        "--max-steps", "1", "--output-dir", str(out), *SMALL,
                                        env={"RAY_AUTH_MODE": "disabled"})
        assert proc.returncode == 0, log[-3000:]
        assert train_steps(out) == [1]
        assert head.poll() is None, "the run stopped a cluster it did not start"
        # The workers ran under the cluster's raylet, not under the run, and are gone with the run.
        assert not [p for p, cmd in seen.items() if "WorkerHost" in cmd]
        assert wait_for(lambda: not [p for p in descendants(head.pid) if "WorkerHost" in cmdline(p)], 15)
