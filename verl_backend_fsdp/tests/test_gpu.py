"""The FSDP backend on a CUDA device: fp32 exactness, CPU offload (all roles or the reference), bf16, packing.

Marked ``gpu`` and skipped without CUDA (CI and the development machines have none). On a GPU
machine with PyTorch, transformers and peft, no installation is needed::

    PYTHONPATH=verl_core/src:verl_backend_fsdp/src python3 -m pytest -m gpu verl_backend_fsdp/tests/test_gpu.py

Every worker here is on CUDA, so the process's one-rank process group is NCCL; the reference
numbers come from the same steps written in plain PyTorch on the same device (TF32 off).
"""

import pytest
import torch

from verl_core.contracts import ModelSpec, Role, WorldInfo
from fsdp_test_utils import full_length_batch as _batch
from fsdp_test_utils import plain_pytorch_steps
from fsdp_test_utils import token_mean_loss as _loss
from verl_core.testing import make_batch, tiny_model_dir

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS, MICRO, LR = 3, 2, 1e-2


@pytest.fixture(scope="module", autouse=True)
def exact_fp32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_model_dir(tmp_path_factory.mktemp("m")))


def _worker(model_dir, **cfg):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    return FSDPBackend(FSDPConfig(lr=LR, micro_batch_size=MICRO, grad_clip=1.0, **cfg)).create_worker(
        role=Role.ACTOR, model=ModelSpec(path=model_dir), world=WorldInfo(device="cuda", threads=1), seed=0)


def _train(worker):
    for step in range(STEPS):
        worker.update_policy(_batch(step), loss_fn=_loss, mini_batch_size=0, epochs=1)
    return {k: v.float().cpu() for k, v in worker.iter_weights()}


@pytest.fixture(scope="module")
def plain(model_dir):
    model = plain_pytorch_steps(model_dir, steps=STEPS, micro=MICRO, lr=LR, device="cuda")
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def _max_diff(a, b):
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("shard_single_rank", [True, False], ids=["fsdp-wrapped", "unwrapped"])
def test_cuda_updates_match_plain_pytorch(model_dir, plain, shard_single_rank):
    assert _max_diff(_train(_worker(model_dir, shard_single_rank=shard_single_rank)), plain) < 1e-5


def test_cpu_offload_keeps_state_on_the_host_and_trains_the_same(model_dir, plain):
    worker = _worker(model_dir, cpu_offload=True)
    weights = _train(worker)
    assert all(p.to_local().device.type == "cpu" for p in worker.module.parameters())
    state = [t for s in worker.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    assert state and all((t.to_local() if hasattr(t, "to_local") else t).device.type == "cpu" for t in state)
    assert _max_diff(weights, plain) < 1e-5


def test_reference_cpu_offload_offloads_only_the_reference(model_dir):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    backend = FSDPBackend(FSDPConfig(reference_cpu_offload=True))
    world = WorldInfo(device="cuda", threads=1)
    reference = backend.create_worker(role=Role.REFERENCE, model=ModelSpec(path=model_dir), world=world, seed=0)
    actor = backend.create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir), world=world, seed=0)
    assert all(p.to_local().device.type == "cpu" for p in reference.module.parameters())
    assert all(p.device.type == "cuda" for p in actor.module.parameters())
    batch = make_batch(batch_size=8, prompt_length=7, response_length=9, vocab_size=16, seed=6)
    mask = batch.response_attention_mask.bool()
    a = reference.compute_log_probs(batch).log_probs
    b = actor.compute_log_probs(batch).log_probs
    assert (a[mask] - b[mask]).abs().max() < 1e-5


def test_bf16_compute_with_fp32_master_weights(model_dir, plain):
    worker = _worker(model_dir, param_dtype="bfloat16")
    weights = _train(worker)
    assert all(p.dtype == torch.float32 for p in worker.module.parameters())
    assert 0 < _max_diff(weights, plain) < 0.1  # bf16 rounding, same training


def test_packed_sequences_match_padded_rows(model_dir):
    batch = make_batch(batch_size=8, prompt_length=7, response_length=9, vocab_size=16, advantages=True, seed=5)
    mask = batch.response_attention_mask.bool()
    padded = _worker(model_dir, remove_padding="false").compute_log_probs(batch).log_probs
    packed = _worker(model_dir, remove_padding="true").compute_log_probs(batch).log_probs
    assert (padded[mask] - packed[mask]).abs().max() < 1e-4
