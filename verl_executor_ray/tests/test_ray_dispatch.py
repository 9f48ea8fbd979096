"""Sharding arguments over ranks and joining results: padding, order, metrics (no Ray needed)."""

import pytest
import torch

from verl_core.batch import Batch
from verl_core.contracts import RolloutOutput, TrainingWorker, dispatch, dispatch_mode
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


def _tp2_dp2() -> list:
    from verl_core.contracts import WorldInfo

    # Megatron's order at TP=2, DP=2: ranks 0,1 are data-parallel group 0, ranks 2,3 group 1.
    return [WorldInfo(rank=r, world_size=4, dp_rank=r // 2, dp_size=2, tp_rank=r % 2, tp_size=2) for r in range(4)]


def test_mesh_defaults_to_one_data_parallel_group_per_rank():
    from verl_core.contracts import WorldInfo
    from verl_executor_ray._dispatch import Mesh

    mesh = Mesh.of([WorldInfo(rank=r, world_size=3) for r in range(3)])
    assert mesh.is_data_parallel and mesh.dp_size == 3 and mesh.readers == (0, 1, 2)


def test_split_over_a_model_parallel_mesh_reads_one_result_per_data_parallel_group():
    """TP=2 x DP=2: both tensor ranks of a group get the group's shard, and the joined result has each
    sample once (read from tensor rank 0), not once per tensor rank."""
    from verl_executor_ray._dispatch import Mesh

    mesh = Mesh.of(_tp2_dp2())
    assert mesh.dp_size == 2 and mesh.shard_of == (0, 0, 1, 1) and mesh.readers == (0, 2)
    values = torch.arange(6.0)
    shards = split_call((values,), {}, mesh.dp_size, method="m", balance=False)
    calls = mesh.per_rank(shards)
    assert [c[0][0].tolist() for c in calls] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    # Each rank returns what it was given; tensor rank 1 returns garbage that must not be read.
    results = [c[0][0] * (1 if r % 2 == 0 else -100) for r, c in enumerate(calls)]
    joined = gather_split(mesh.read(results), real=shards.real, padded=shards.padded)
    assert torch.equal(joined, values)


def test_pipeline_mesh_reads_the_last_stage_and_refuses_a_mesh_without_one_output_rank():
    from verl_core.contracts import WorldInfo
    from verl_executor_ray._dispatch import Mesh

    pp2 = [WorldInfo(rank=r, world_size=2, dp_rank=0, dp_size=1, pp_rank=r, pp_size=2) for r in range(2)]
    assert Mesh.of(pp2).readers == (1,)
    # Two ranks both claiming to be tensor rank 0 of the last stage of group 0.
    bad = [WorldInfo(rank=r, world_size=2, dp_rank=0, dp_size=1) for r in range(2)]
    with pytest.raises(ValueError, match="output ranks"):
        Mesh.of(bad)
