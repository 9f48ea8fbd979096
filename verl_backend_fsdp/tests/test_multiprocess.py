"""Two FSDP2 ranks (gloo, separate processes) train exactly like one process.

The processes are started here with torch's own multiprocessing, standing in for the executor
that places them in a real run; the backend itself contains no launcher. Each world size is
started once and runs every scenario in turn (a fresh worker each); the tests read what rank 0
and rank 1 wrote. A scenario that makes the ranks disagree on their collectives hangs, so the
processes run under a deadline.
"""

import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

from fsdp_test_utils import full_length_batch as _batch  # same tokens on every rank: one shared objective
from fsdp_test_utils import leave_process_group, nan_where_poisoned, poison_second_half
from fsdp_test_utils import token_mean_loss as _loss
from verl_core.contracts import ModelSpec, Role, WorldInfo


STEPS = 3
DEADLINE_S = 300
# 2 ranks hold samples 0-3 and 4-7. Interleaving them like this puts the same samples in each
# global mini-batch at one rank ({0, 1, 4, 5}, then {2, 3, 6, 7}).
MINI_ORDER = [0, 1, 4, 5, 2, 3, 6, 7]
BUDGET = 14  # tokens per micro-batch: the long samples (11 tokens) go alone, the short ones (7) in pairs


def _uneven_batch(step: int):
    """Samples 0-3: 5 prompt + 6 response tokens; samples 4-7: 5 + 2. Rank 1's half packs into half
    as many micro-batches as rank 0's under :data:`BUDGET`."""
    b = _batch(step)
    mask = b.response_mask.clone()
    mask[4:, 2:] = 0
    return b.replace(response_mask=mask, response_attention_mask=mask.clone())


def _sample_mean_loss(*, batch, log_probs, entropy=None, values=None):
    """Mean over samples of each sample's token-mean: micro-batches of any size compose exactly."""
    mask = batch.response_mask.to(log_probs.dtype)
    per_sample = -(log_probs * batch.advantages * mask).sum(-1) / mask.sum(-1)
    loss = per_sample.mean()
    return loss, {"loss": float(loss.detach())}


def _scenario(name: str, rank: int, world_size: int, model_dir: str) -> dict:
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig, TrainingDivergedError

    settings = {"whole": dict(micro_batch_size=2), "mini": dict(micro_batch_size=2),
                "budget": dict(micro_batch_size=8, micro_batch_max_tokens=BUDGET), "nan": dict(micro_batch_size=2)}
    # eps=1e-5, not AdamW's 1e-8: an element whose true gradient is ~0 gets rounding noise that
    # depends on the summation order, and Adam's first steps turn any gradient well above eps into
    # an lr-sized move. With the default eps two correct runs differed by 6e-5 on such elements.
    backend = FSDPBackend(FSDPConfig(lr=1e-2, eps=1e-5, grad_clip=1.0, **settings[name]))
    worker = backend.create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                   world=WorldInfo(rank=rank, world_size=world_size, threads=1), seed=0)
    out: dict = {"losses": []}
    try:
        for step in range(STEPS):
            if name == "mini":
                batch, loss_fn, mini = _batch(step), _loss, 4
                if world_size == 1:
                    batch = batch.select(MINI_ORDER)
            elif name == "budget":
                batch, loss_fn, mini = _uneven_batch(step), _sample_mean_loss, 0
            else:
                batch, loss_fn, mini = _batch(step), _loss, 0
            if name == "nan":
                batch = poison_second_half(batch)  # rank 1's half: its loss is NaN, rank 0's is not
                loss_fn = nan_where_poisoned(_loss)
            shard = batch.chunk(world_size)[rank]  # what a "split" dispatch hands each rank
            if name == "budget":
                out["micro_batches"] = len(worker._micro_batches(shard, 8))
            if name == "nan":
                before = {k: v.clone() for k, v in worker.iter_weights()}
                try:
                    worker.update_policy(shard, loss_fn=loss_fn, mini_batch_size=mini, epochs=1)
                except TrainingDivergedError as exc:
                    out["error"] = str(exc)
                after = dict(worker.iter_weights())
                out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
                break
            metrics = worker.update_policy(shard, loss_fn=loss_fn, mini_batch_size=mini, epochs=1)
            out["losses"].append(metrics["loss"])
        out["optimizer_steps"] = worker.optimizer_steps
        weights = {k: v.clone() for k, v in worker.iter_weights()}  # a collective: every rank takes part
        if rank == 0:
            out["weights"] = weights
    finally:
        worker.close()
    return out


def _train(rank: int, world_size: int, model_dir: str, port: int, out_dir: str, scenarios: list) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    results = {}
    for name in scenarios:
        results[name] = _scenario(name, rank, world_size, model_dir)
        dist.barrier()
    torch.save(results, os.path.join(out_dir, f"ws{world_size}_rank{rank}.pt"))

    class _Closed:
        def close(self):
            pass

    leave_process_group(_Closed())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world_size: int, model_dir: str, out_dir: str, scenarios: list) -> None:
    ctx = mp.start_processes(_train, args=(world_size, model_dir, _free_port(), out_dir, scenarios),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{world_size} ranks still running after {DEADLINE_S} s: ranks disagree on a collective")


def _addition_model_dir(path) -> str:
    """The built-in task's tiny Qwen2 (16-token vocabulary), freshly initialised.

    1 and 2 ranks differ by summation-order rounding that Adam amplifies in elements with ~0 true
    gradient; the 1e-5 tolerances below were measured on this model. The byte-level model of
    ``verl_core.testing.tiny_model_dir`` has a 260-token LM head, most of whose rows get no gradient,
    and two correct runs of it differ by 1.6e-5.
    """
    from verl_task_arithmetic.addition import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiprocess")
    model_dir = _addition_model_dir(tmp / "model")
    _spawn(1, model_dir, str(tmp), ["whole", "mini", "budget"])
    _spawn(2, model_dir, str(tmp), ["whole", "mini", "budget", "nan"])
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    return {f"ws{ws}_rank{r}": torch.load(tmp / f"ws{ws}_rank{r}.pt") for ws, r in ((1, 0), (2, 0), (2, 1))}, initial


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _check_matches_one_rank(runs, scenario: str) -> None:
    results, initial = runs
    one, two = results["ws1_rank0"][scenario], results["ws2_rank0"][scenario]
    other = results["ws2_rank1"][scenario]
    assert _max_diff(one["weights"], two["weights"]) < 1e-5
    assert _max_diff(one["weights"], initial) > 1e-3  # the runs really trained
    # Each rank reports the loss of its half; with equal halves their mean is the whole batch's loss.
    assert len(one["losses"]) == STEPS
    mean = [(a + b) / 2 for a, b in zip(two["losses"], other["losses"])]
    assert mean == pytest.approx(one["losses"], abs=1e-5)
    assert two["optimizer_steps"] == other["optimizer_steps"] == one["optimizer_steps"]


@pytest.mark.slow
def test_two_ranks_match_one(runs):
    _check_matches_one_rank(runs, "whole")


@pytest.mark.slow
def test_mini_batch_size_counts_samples_over_all_ranks(runs):
    # 8 samples, mini_batch_size=4: two optimizer steps per update at one rank and at two.
    _check_matches_one_rank(runs, "mini")
    assert runs[0]["ws1_rank0"]["mini"]["optimizer_steps"] == 2 * STEPS


@pytest.mark.slow
def test_token_budget_at_two_ranks_agrees_on_micro_batches(runs):
    # Rank 0's four long samples need four micro-batches, rank 1's short ones would fit in two:
    # rank 1 splits further so that both run four rounds of collectives (else both would hang).
    results, _ = runs
    assert results["ws2_rank0"]["budget"]["micro_batches"] == results["ws2_rank1"]["budget"]["micro_batches"] == 4
    _check_matches_one_rank(runs, "budget")


@pytest.mark.slow
def test_nan_loss_on_one_rank_stops_both_without_applying_the_update(runs):
    results, _ = runs
    zero, one = results["ws2_rank0"]["nan"], results["ws2_rank1"]["nan"]
    assert "loss is nan" in one["error"] and "optimizer step 1" in one["error"]
    assert "not finite on another rank" in zero["error"]
    assert zero["unchanged"] and one["unchanged"]
