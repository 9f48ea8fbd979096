"""Sharding arguments over ranks and joining results: padding, order, metrics (no Ray needed)."""

import pytest
import torch

from verl_core.batch import Batch
from verl_core.interfaces import RolloutOutput, TrainingWorker, dispatch, dispatch_mode
from verl_core.testing import make_batch
from verl_executor_ray._dispatch import balance_batch, gather_split, pad_and_shard, split_call


def test_batch_is_padded_to_divide_evenly_and_padding_is_removed():
    batch = make_batch(batch_size=7, group_size=1)
    shards, real, padded = pad_and_shard(batch, 2)
    assert (real, padded) == (7, 8)
    assert [len(s) for s in shards] == [4, 4]
    # The padded row repeats the last sample but takes no part in losses.
    assert torch.equal(shards[1].response_ids[-1], batch.response_ids[-1])
    assert shards[1].response_mask[-1].sum() == 0
    assert torch.equal(shards[0].response_mask, batch.response_mask[:4])
    # Each rank returns per-sample outputs; the join keeps the 7 real ones, in order.
    outs = [s.response_ids.float() * 2 for s in shards]
    joined = gather_split(outs, real=real, padded=padded)
    assert torch.equal(joined, batch.response_ids.float() * 2)
    back = gather_split(shards, real=real, padded=padded)
    assert isinstance(back, Batch) and len(back) == 7
    assert torch.equal(back.response_mask, batch.response_mask)


def _tokens(batch):
    return (batch.prompt_mask.sum(-1) + batch.response_attention_mask.sum(-1)).tolist()


def test_batches_are_balanced_by_tokens_and_results_come_back_in_order():
    # Lengths rising along the batch: contiguous halves would give one rank most of the tokens.
    batch = make_batch(batch_size=9, group_size=1, prompt_length=4, response_length=12, seed=0)
    lengths = torch.arange(1, 10)
    mask = (torch.arange(12) < lengths[:, None]).long()
    batch = batch.replace(response_attention_mask=mask, response_mask=mask)
    shards, real, padded, order = balance_batch(batch, 2)
    assert (real, padded) == (9, 10) and [len(s) for s in shards] == [5, 5]
    per_rank = [sum(_tokens(s)) for s in shards]
    contiguous = [sum(_tokens(s)) for s in pad_and_shard(batch, 2)[0]]
    assert abs(per_rank[0] - per_rank[1]) <= 1 < abs(contiguous[0] - contiguous[1])
    assert sorted(order) == list(range(10))
    # Per-sample outputs, one or several per sample, and whole batches come back in the caller's order.
    joined = gather_split([s.response_mask.sum(-1) for s in shards], real=real, padded=padded, order=order)
    assert joined.tolist() == lengths.tolist()
    pairs = gather_split([[(int(n), e) for n in s.response_mask.sum(-1) for e in range(2)] for s in shards],
                         real=real, padded=padded, order=order)
    assert pairs == [(n, e) for n in range(1, 10) for e in range(2)]
    back = split_call((), {"batch": batch}, 2, method="actor.compute_log_probs")
    assert back.order == order
    rejoined = gather_split([c[1]["batch"] for c in back.calls], real=9, padded=10, order=back.order)
    assert torch.equal(rejoined.response_mask, batch.response_mask)


def test_prompts_split_and_rollout_outputs_join_in_order():
    prompts = [[1], [2], [3]]
    calls = split_call((prompts,), {"sampling": "s"}, 2, method="generate")
    assert [c[0][0] for c in calls.calls] == [[[1], [2]], [[3], [3]]]
    assert all(c[1] == {"sampling": "s"} for c in calls.calls)
    n = 2  # two samples per prompt, grouped by prompt
    outs = [RolloutOutput([p + [k] for p in shard[0][0] for k in range(n)], None, ["stop"] * len(shard[0][0]) * n)
            for shard in calls.calls]
    joined = gather_split(outs, real=calls.real, padded=calls.padded)
    assert joined.response_ids == [[1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [3, 1]]
    assert joined.log_probs is None and len(joined.finish_reasons) == 6


def test_metrics_are_averaged_over_ranks():
    joined = gather_split([{"loss": 1.0, "n": 2}, {"loss": 3.0, "n": 4}], real=4, padded=4)
    assert joined == {"loss": 2.0, "n": 3.0}


def test_split_needs_the_batch():
    with pytest.raises(TypeError, match="without the batch"):
        split_call((), {"loss_fn": None}, 2, method="actor.update_policy")
    with pytest.raises(TypeError, match="cannot split a dict"):
        pad_and_shard({"a": 1}, 2)


def test_dispatch_mode_is_inherited_through_the_mro():
    class Worker(TrainingWorker):
        def compute_log_probs(self, batch, *, with_entropy=False):  # no mark of its own
            return None

        @dispatch("all")
        def save_state(self, path):
            return None

        def helper(self):
            return None

    assert dispatch_mode(Worker, "compute_log_probs") == "split"
    assert dispatch_mode(Worker(), "update_policy") == "split"
    assert dispatch_mode(Worker, "iter_weights") == "broadcast"
    assert dispatch_mode(Worker, "save_state") == "all"
    assert dispatch_mode(Worker, "helper") == "broadcast"
    assert dispatch_mode(Worker.compute_log_probs) == "broadcast"  # the one-function form reads only that function


def test_fsdp_worker_methods_dispatch_as_declared_on_the_base():
    from verl_backend_fsdp.backend import FSDPWorker

    assert dispatch_mode(FSDPWorker, "compute_log_probs") == "split"
    assert dispatch_mode(FSDPWorker, "compute_values") == "split"
    assert dispatch_mode(FSDPWorker, "load_state") == "all"
