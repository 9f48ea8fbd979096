"""Two Ray nodes on this machine: a head and a worker raylet started with `ray start`, as on two hosts.

A pool with ``nnodes=2`` must put its ranks on distinct nodes (not two slots that fit on one), and
an FSDP group spanning them must train exactly like one process. The run happens in a child
interpreter that joins the cluster through ``executor.address``, as a user's driver would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from ray_test_utils import RAY_ENV, ray_cluster

pytestmark = pytest.mark.slow

DRIVER = textwrap.dedent('''
    import functools, json, sys
    from verl_core.contracts import ExecutorConfig, ModelSpec, Role
    from verl_executor_local import LocalExecutor
    from verl_core.testing import make_batch
    from verl_task_arithmetic.addition import build_model, build_tokenizer
    from verl_core.trainer import _create_worker
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_executor_ray.config import RayExecutorConfig
    from verl_executor_ray.executor import RayExecutor

    # The built-in task's model (16 tokens), on which the 1e-5 tolerances below were measured.
    model_dir = sys.argv[2] + "/model"
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    batch = make_batch(batch_size=8, prompt_length=5, response_length=6, vocab_size=16, advantages=True, seed=0)

    def loss(*, batch, log_probs, entropy=None, values=None):
        per_seq = (log_probs * batch.advantages * batch.response_mask).sum(-1) / batch.response_mask.sum(-1).clamp(min=1)
        value = -per_seq.mean()
        return value, {"loss": float(value.detach())}

    def train(executor):
        backend = FSDPBackend(FSDPConfig(lr=1e-2, micro_batch_size=4))
        group = executor.create_group(role=Role.ACTOR, factory=functools.partial(
            _create_worker, backend, Role.ACTOR, ModelSpec(path=model_dir), 0))
        losses = [group.update_policy(batch, loss_fn=loss, mini_batch_size=0, epochs=1)["loss"] for _ in range(3)]
        return losses, group.compute_log_probs(batch).log_probs

    one_losses, one_lp = train(LocalExecutor(ExecutorConfig(threads_per_worker=1)))
    config = RayExecutorConfig(address=sys.argv[1], nnodes=2, procs_per_node=1)
    config.validate()
    executor = RayExecutor(config)
    try:
        two_losses, two_lp = train(executor)
        infos = executor._pools["default"].info
    finally:
        executor.shutdown()
    mask = batch.response_mask.bool()
    print(json.dumps({"nodes": [i["node_id"] for i in infos], "ranks": [i["rank"] for i in infos],
                      "one": one_losses, "two": two_losses,
                      "lp_diff": float((one_lp - two_lp)[mask].abs().max())}))
''')


def test_two_nodes_hold_one_rank_each_and_train_like_one_process(tmp_path):
    # The second raylet joins the head as another machine would; one CPU each, so a placement that
    # does not spread its bundles over both nodes cannot be satisfied at all.
    with ray_cluster(head_cpus=1, worker_nodes=1) as (address, _):
        env = {**os.environ, **RAY_ENV, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, "-c", DRIVER, address, str(tmp_path / "model")], env=env,
                              capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ranks"] == [0, 1]
    assert len(set(result["nodes"])) == 2, result["nodes"]
    assert max(abs(a - b) for a, b in zip(result["one"], result["two"])) < 1e-5, result
    assert result["lp_diff"] < 1e-5
    assert result["one"][0] != result["one"][2]  # the updates moved the policy
