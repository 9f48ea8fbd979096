"""FSDP checkpoints: resharding to another world size, and refusing what does not fit."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from fsdp_test_utils import leave_process_group
from verl_core.contracts import CheckpointError
from verl_run_store import CheckpointManager
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import make_batch, tiny_model_dir


def _loss(*, batch, log_probs, entropy=None, values=None):
    loss = -(log_probs * batch.advantages * batch.response_mask).sum() / batch.response_mask.sum().clamp(min=1)
    return loss, {}


def _worker(model_dir, rank=0, world_size=1, lr=1e-2, shard_single_rank=False, eps=1e-8):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    return FSDPBackend(FSDPConfig(lr=lr, shard_single_rank=shard_single_rank, eps=eps)).create_worker(
        role=Role.ACTOR, model=ModelSpec(path=model_dir), world=WorldInfo(rank=rank, world_size=world_size), seed=0)


def _save_two_ranks(rank, model_dir, port, ckpt_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    worker = _worker(model_dir, rank, 2)
    batch = make_batch(batch_size=8, prompt_length=4, response_length=5, vocab_size=16, advantages=True, seed=1)
    worker.update_policy(batch.chunk(2)[rank], loss_fn=_loss, mini_batch_size=0, epochs=1)
    weights = {k: v.clone() for k, v in worker.iter_weights()}
    worker.save_state(ckpt_dir)
    if rank == 0:
        torch.save(weights, os.path.join(ckpt_dir, "..", "expected.pt"))
    leave_process_group(worker)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_rank_checkpoint_loads_into_one_rank(tmp_path):
    model_dir = str(tiny_model_dir(tmp_path))
    ckpt = tmp_path / "ckpt" / "actor"
    ckpt.parent.mkdir()
    mp.start_processes(_save_two_ranks, args=(model_dir, _free_port(), str(ckpt)), nprocs=2, join=True,
                       start_method="spawn")
    expected = torch.load(tmp_path / "ckpt" / "expected.pt")
    worker = _worker(model_dir)
    worker.load_state(str(ckpt))
    got = dict(worker.iter_weights())
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    # The optimizer state came along: the next update works and is finite.
    batch = make_batch(batch_size=4, prompt_length=4, response_length=5, vocab_size=16, advantages=True, seed=2)
    metrics = worker.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)
    assert torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
    assert worker.optimizer_steps == 2


def _resume_at_two_ranks(rank, model_dir, port, ckpt_dir, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    worker = _worker(model_dir, rank, 2, eps=1e-5)
    worker.load_state(ckpt_dir)
    batch = make_batch(batch_size=8, prompt_length=4, response_length=5, vocab_size=16, advantages=True, seed=2)
    worker.update_policy(batch.chunk(2)[rank], loss_fn=_loss, mini_batch_size=0, epochs=1)
    weights = {k: v.clone() for k, v in worker.iter_weights()}
    if rank == 0:
        torch.save({"weights": weights, "optimizer_steps": worker.optimizer_steps}, out)
    leave_process_group(worker)


@pytest.mark.slow
def test_one_rank_checkpoint_resumes_at_two_ranks_like_at_one(tmp_path):
    # eps=1e-5: see test_multiprocess.py (AdamW turns rounding noise on ~zero gradients into lr-sized moves).
    model_dir = str(tiny_model_dir(tmp_path))
    first, second = (make_batch(batch_size=8, prompt_length=4, response_length=5, vocab_size=16, advantages=True,
                                seed=s) for s in (1, 2))
    one = _worker(model_dir, eps=1e-5)
    one.update_policy(first, loss_fn=_loss, mini_batch_size=0, epochs=1)
    one.save_state(str(tmp_path / "ckpt"))
    # The loss is a token-mean over the batch, and both halves hold the same number of response tokens here.
    halves = [int(h.response_mask.sum()) for h in second.chunk(2)]
    assert halves[0] == halves[1], halves
    one.update_policy(second, loss_fn=_loss, mini_batch_size=0, epochs=1)
    expected = dict(one.iter_weights())
    mp.start_processes(_resume_at_two_ranks, args=(model_dir, _free_port(), str(tmp_path / "ckpt"),
                                                    str(tmp_path / "two.pt")), nprocs=2, join=True,
                       start_method="spawn")
    two = torch.load(tmp_path / "two.pt")
    assert two["optimizer_steps"] == 2
    assert max((two["weights"][k] - expected[k]).abs().max().item() for k in expected) < 1e-5


def test_unwrapped_and_wrapped_one_rank_checkpoints_are_interchangeable(tmp_path):
    """A one-rank run trains the plain module; its checkpoint must load into an FSDP-wrapped worker
    (and so at any world size) and carry on exactly as the unwrapped worker does."""
    from torch.distributed.fsdp import FSDPModule

    model_dir = str(tiny_model_dir(tmp_path))
    batches = [make_batch(batch_size=4, prompt_length=4, response_length=5, vocab_size=16, advantages=True, seed=s)
               for s in (1, 2)]
    plain = _worker(model_dir)
    assert not isinstance(plain.module, FSDPModule)
    plain.update_policy(batches[0], loss_fn=_loss, mini_batch_size=0, epochs=1)
    plain.save_state(str(tmp_path / "ckpt"))
    wrapped = _worker(model_dir, shard_single_rank=True)
    assert isinstance(wrapped.module, FSDPModule)
    wrapped.load_state(str(tmp_path / "ckpt"))
    for worker in (plain, wrapped):  # the second step needs the optimizer's moments to agree too
        worker.update_policy(batches[1], loss_fn=_loss, mini_batch_size=0, epochs=1)
    got, expected = dict(wrapped.iter_weights()), dict(plain.iter_weights())
    assert set(got) == set(expected)
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) < 1e-6
    assert wrapped.optimizer_steps == plain.optimizer_steps == 2


def test_checkpoint_of_another_model_is_refused(tmp_path):
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForCausalLM

    small_dir = str(tiny_model_dir(tmp_path))
    worker = _worker(small_dir)
    worker.save_state(str(tmp_path / "small"))
    config = AutoConfig.from_pretrained(small_dir)
    config.intermediate_size *= 2  # same names, other shapes
    bigger_dir = tmp_path / "other"
    Qwen2ForCausalLM(config).save_pretrained(bigger_dir)
    AutoTokenizer.from_pretrained(small_dir).save_pretrained(bigger_dir)
    with pytest.raises(ValueError, match="different model"):
        _worker(str(bigger_dir)).load_state(str(tmp_path / "small"))


def test_checkpoint_in_another_dtype_is_refused(tmp_path):
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    model_dir = str(tiny_model_dir(tmp_path))
    _worker(model_dir).save_state(str(tmp_path / "fp32"))
    bf16 = FSDPBackend(FSDPConfig()).create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir, dtype="bfloat16"),
                                                   world=WorldInfo(threads=1), seed=0)
    with pytest.raises(ValueError, match="holds float32 weights .* loaded in bfloat16; set model.dtype=float32"):
        bf16.load_state(str(tmp_path / "fp32"))


def test_corrupt_or_half_written_checkpoints_are_never_taken(tmp_path):
    manager = CheckpointManager(tmp_path)

    def write(d):
        (d / "weights.bin").write_bytes(b"x" * 100)

    good = manager.save(1, write, info={})

    def crash(d):
        (d / "weights.bin").write_bytes(b"partial")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        manager.save(2, crash, info={})
    assert manager.latest() == good  # the half-written step 2 is invisible
    assert [p.name for p in manager.complete()] == ["step_000001"]

    (good / "weights.bin").write_bytes(b"y" * 100)  # same size, different bytes
    with pytest.raises(CheckpointError, match="corrupt"):
        CheckpointManager.verify(good)
    (good / "weights.bin").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        CheckpointManager.verify(good)


def test_keep_prunes_old_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        manager.save(step, lambda d: (d / "f").write_text("x"), info={})
    assert [p.name for p in manager.complete()] == ["step_000002", "step_000003"]
    assert CheckpointManager.resolve(tmp_path).name == "step_000003"


def test_resumed_worker_follows_its_own_learning_rate(tmp_path):
    model_dir = str(tiny_model_dir(tmp_path))
    batch = make_batch(batch_size=4, prompt_length=4, response_length=5, vocab_size=16, advantages=True, seed=1)
    saved = _worker(model_dir, lr=1e-2)
    saved.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)
    saved.save_state(str(tmp_path / "ckpt"))
    resumed = _worker(model_dir, lr=1e-3)  # the user lowered backend.lr before resuming
    resumed.load_state(str(tmp_path / "ckpt"))
    rates = [resumed.update_policy(batch, loss_fn=_loss, mini_batch_size=0, epochs=1)["actor/lr"] for _ in range(2)]
    assert rates == [1e-3, 1e-3]
