"""Gradient accumulation over micro-batches at world size 1 trains exactly like plain PyTorch.

At one rank the module trains unwrapped by default; with ``shard_single_rank`` it is wrapped and the
update keeps parameters gathered and gradients local between micro-batches (FSDP's per-micro-batch
gather and reduce are whole-model copies there). These tests pin what neither may change: the
weights after several steps, the log-probs the next forward computes (no stale gathered copy
survives an optimizer step), and the weights a rollout engine receives.
"""

import pytest
import torch

from verl_core.contracts import ModelSpec, Role, WorldInfo
from fsdp_test_utils import full_length_batch as _batch
from fsdp_test_utils import plain_pytorch_steps, response_log_probs
from fsdp_test_utils import token_mean_loss as _loss
from verl_core.testing import tiny_model_dir

STEPS = 3
MICRO = 2
LR = 1e-2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("m")))


@pytest.mark.parametrize("shard_single_rank", [False, True], ids=["unwrapped", "fsdp-wrapped"])
def test_micro_batched_updates_match_plain_pytorch(model_dir, shard_single_rank):
    from torch.distributed.fsdp import FSDPModule

    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    torch.set_num_threads(1)
    worker = FSDPBackend(FSDPConfig(lr=LR, micro_batch_size=MICRO, grad_clip=1.0,
                                    shard_single_rank=shard_single_rank)).create_worker(
        role=Role.ACTOR, model=ModelSpec(path=model_dir), world=WorldInfo(threads=1), seed=0)
    assert isinstance(worker.module, FSDPModule) is shard_single_rank
    for step in range(STEPS):
        worker.update_policy(_batch(step), loss_fn=_loss, mini_batch_size=0, epochs=1)
    reference = plain_pytorch_steps(model_dir, steps=STEPS, micro=MICRO, lr=LR)

    expected = reference.state_dict()
    synced = dict(worker.iter_weights())  # what a rollout engine receives
    assert set(synced) == set(expected)
    assert max((synced[k] - expected[k]).abs().max().item() for k in expected) < 1e-5

    # The forward after the last optimizer step must see the new weights, not a gathered copy of the old ones.
    probe = _batch(STEPS)
    ours = worker.compute_log_probs(probe).log_probs
    with torch.no_grad():
        theirs = response_log_probs(reference, probe)
    assert (ours - theirs).abs().max() < 1e-4

    # And so must generation through the actor's own module (the HF rollout's path).
    with worker.generation_module() as module, torch.no_grad():
        gathered = response_log_probs(module, probe)
    assert (gathered - theirs).abs().max() < 1e-4
