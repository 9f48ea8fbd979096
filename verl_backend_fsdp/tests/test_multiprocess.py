"""Two FSDP2 ranks (gloo, separate processes) train exactly like one process.

The processes are started here with torch's own multiprocessing, standing in for the executor
that places them in a real run; the backend itself contains no launcher.
"""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from fsdp_test_utils import full_length_batch as _batch  # same tokens on every rank: one shared objective
from fsdp_test_utils import leave_process_group
from fsdp_test_utils import token_mean_loss as _loss
from verl_core.interfaces import ModelSpec, Role, WorldInfo
from verl_core.testing import tiny_model_dir

STEPS = 3


def _train(rank: int, world_size: int, model_dir: str, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    backend = FSDPBackend(FSDPConfig(lr=1e-2, micro_batch_size=2, grad_clip=1.0))
    worker = backend.create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                   world=WorldInfo(rank=rank, world_size=world_size, threads=1), seed=0)
    losses = []
    for step in range(STEPS):
        shard = _batch(step).chunk(world_size)[rank]  # what a "split" dispatch hands each rank
        metrics = worker.update_policy(shard, loss_fn=_loss, mini_batch_size=0, epochs=1)
        losses.append(metrics["loss"])
    weights = {k: v.clone() for k, v in worker.iter_weights()}
    if rank == 0:
        torch.save({"weights": weights, "losses": losses}, os.path.join(out_dir, f"ws{world_size}.pt"))
    leave_process_group(worker)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_match_one(tmp_path):
    model_dir = str(tiny_model_dir(tmp_path))
    for ws in (1, 2):
        mp.start_processes(_train, args=(ws, model_dir, _free_port(), str(tmp_path)), nprocs=ws, join=True,
                           start_method="spawn")
    one = torch.load(tmp_path / "ws1.pt")
    two = torch.load(tmp_path / "ws2.pt")
    # Rank 0 of the 2-rank run reports the loss of its half; compare the weights, which see both.
    assert one["weights"].keys() == two["weights"].keys()
    max_diff = max((one["weights"][k] - two["weights"][k]).abs().max().item() for k in one["weights"])
    assert max_diff < 1e-5, max_diff
    # And the runs really trained: the weights moved away from the initial model.
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    moved = max((one["weights"][k] - initial[k]).abs().max().item() for k in one["weights"])
    assert moved > 1e-3, moved
