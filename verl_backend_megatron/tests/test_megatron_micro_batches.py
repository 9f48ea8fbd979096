"""Token-budget micro-batches (``backend.micro_batch_max_tokens``) in the Megatron backend (one process,
and two data-parallel ranks marked heavy), and the CPU layer spec's SDPA core attention.

Real megatron-core: the worker's own micro-batch split, Megatron's schedule, DDP grad buffers and optimizer.
"""

from __future__ import annotations

import pytest
import torch

from verl_backend_megatron.backend import MegatronBackend, MegatronConfig
from verl_core.config import ConfigError
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import make_batch, tiny_model_dir
from verl_core.testing._backend import run_ranks

pytestmark = pytest.mark.megatron

BUDGET = 40


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("qwen2_budget"))


def _worker(path: str, **settings):
    config = MegatronConfig(**{"lr": 1e-3, "grad_clip": 0.0, **settings})
    return MegatronBackend(config).create_worker(role=Role.ACTOR, model=ModelSpec(path=path), world=WorldInfo(),
                                                 seed=0)


def _batch():
    return make_batch(batch_size=12, prompt_length=7, response_length=9, vocab_size=16, group_size=4,
                      advantages=True, seed=3)


def _sequence_mean_loss(*, batch, log_probs, entropy=None, values=None):
    """Mean over samples of each sample's token mean: weighted by the micro-batches' sample shares
    (as both backends weight them), its sum does not depend on how the samples are split."""
    mask = batch.response_mask.to(log_probs.dtype)
    per_sample = (log_probs * batch.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    loss = -per_sample.mean()
    return loss, {"test/loss": float(loss.detach())}


def _grads(worker) -> dict[str, torch.Tensor]:
    """The gradients the last update stepped on (Megatron DDP's fp32 grad buffer)."""
    return {name: p.main_grad.detach().clone() for name, p in worker.module.named_parameters()}


def test_token_budget_changes_the_split_and_keeps_losses_and_gradients(qwen2: str) -> None:
    batch = _batch()
    fixed = _worker(qwen2, micro_batch_size=4, log_prob_micro_batch_size=4)
    packed = _worker(qwen2, micro_batch_size=4, log_prob_micro_batch_size=4, micro_batch_max_tokens=BUDGET)

    fixed_split = fixed._micro_batches(batch, 4)
    split = packed._micro_batches(batch, 4)
    assert [len(m.batch) for m in fixed_split] == [4, 4, 4]
    sizes = [len(m.batch) for m in split]
    assert sum(sizes) == len(batch) and sizes != [4, 4, 4], sizes
    for m in split:
        real = int(m.batch.attention_mask.sum())
        assert real <= BUDGET or len(m.batch) == 1, (real, len(m.batch))
        # Each micro-batch is laid out as wide as its own longest sample, not the batch's.
        assert m.tokens.shape == (len(m.batch), int(m.batch.attention_mask.sum(-1).max()))
    assert min(m.tokens.shape[1] for m in split) < batch.attention_mask.sum(-1).max()
    # Consecutive samples, in order, none lost or repeated.
    assert torch.equal(torch.cat([m.batch.input_ids for m in split]), batch.input_ids)

    real = batch.response_attention_mask.bool()
    a, b = fixed.compute_log_probs(batch, with_entropy=True), packed.compute_log_probs(batch, with_entropy=True)
    assert (a.log_probs[real] - b.log_probs[real]).abs().max() <= 1e-5
    assert (a.entropy[real] - b.entropy[real]).abs().max() <= 1e-5

    for _ in range(2):
        ma = fixed.update_policy(batch, loss_fn=_sequence_mean_loss, mini_batch_size=0, epochs=1)
        mb = packed.update_policy(batch, loss_fn=_sequence_mean_loss, mini_batch_size=0, epochs=1)
        assert abs(ma["test/loss"] - mb["test/loss"]) <= 1e-5
        assert abs(ma["actor/grad_norm"] - mb["actor/grad_norm"]) <= 1e-5
        ga, gb = _grads(fixed), _grads(packed)
        assert ga.keys() == gb.keys()
        assert any(g.abs().max() > 0 for g in ga.values())
        assert max((ga[k] - gb[k]).abs().max().item() for k in ga) <= 1e-5


def test_token_budget_with_a_pipeline_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="micro_batch_max_tokens: .*pipeline_parallel_size=2 .*fixed"):
        MegatronConfig(pipeline_parallel_size=2, micro_batch_max_tokens=256).validate()
    with pytest.raises(ValueError, match="micro_batch_max_tokens: must be >= 0"):
        MegatronConfig(micro_batch_max_tokens=-1).validate()
    MegatronConfig(pipeline_parallel_size=2).validate()  # a pipeline with fixed-size micro-batches is fine
    MegatronConfig(micro_batch_max_tokens=256).validate()  # and a token budget without one


def test_token_budget_with_a_pipeline_fails_in_config_resolution_before_any_model_loads() -> None:
    from verl_core.config import resolve_config
    from verl_core.registry import PluginRegistry

    with pytest.raises(ConfigError, match="backend.micro_batch_max_tokens") as info:
        resolve_config({"backend": {"name": "megatron", "pipeline_parallel_size": 2, "micro_batch_max_tokens": 512}},
                       PluginRegistry())
    assert "pipeline_parallel_size=1" in str(info.value)


# ----------------------------------------------------------------------------- two data-parallel ranks
DP_BUDGET = 24
DEADLINE_S = 300


def _uneven_batch():
    """12 samples; the second half's responses cut to 2 tokens: under :data:`DP_BUDGET` rank 1's six
    samples pack into fewer micro-batches than rank 0's."""
    batch = make_batch(batch_size=12, prompt_length=5, response_length=8, vocab_size=16, group_size=4,
                       advantages=True, seed=5)
    mask = batch.response_attention_mask.clone()
    mask[6:, 2:] = 0
    return batch.replace(response_attention_mask=mask, response_mask=batch.response_mask * mask)


def _dp_rank(rank: int, world_size: int, model_dir: str) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    shard = _uneven_batch().chunk(world_size)[rank]
    out = {}
    for name, extra in (("fixed", {}), ("budget", {"micro_batch_max_tokens": DP_BUDGET})):
        config = MegatronConfig(lr=1e-3, grad_clip=0.0, micro_batch_size=6, log_prob_micro_batch_size=6, **extra)
        worker = MegatronBackend(config).create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                                       world=WorldInfo(rank=rank, world_size=world_size), seed=0)
        metrics = worker.update_policy(shard, loss_fn=_sequence_mean_loss, mini_batch_size=0, epochs=1)
        out[name] = {"micro_batches": len(worker._micro_batches(shard, 6)), "loss": metrics["test/loss"],
                     "grad_norm": metrics["actor/grad_norm"], "grads": _grads(worker),
                     "log_probs": worker.compute_log_probs(shard).log_probs}
        worker.close()
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


@pytest.mark.heavy
def test_token_budget_at_two_data_parallel_ranks_with_different_micro_batch_counts(qwen2: str, tmp_path) -> None:
    """Megatron's DDP reduces gradients once after the last micro-batch, so data-parallel ranks may cut
    their shards into different numbers of micro-batches; the update equals the fixed-size split's."""
    ranks = run_ranks(_dp_rank, 2, qwen2, out_dir=str(tmp_path), deadline_s=DEADLINE_S)
    assert [r["fixed"]["micro_batches"] for r in ranks] == [1, 1]
    counts = [r["budget"]["micro_batches"] for r in ranks]
    assert counts[0] > counts[1] > 1, counts
    for r in ranks:
        fixed, budget = r["fixed"], r["budget"]
        assert abs(fixed["loss"] - budget["loss"]) <= 1e-5
        assert abs(fixed["grad_norm"] - budget["grad_norm"]) <= 1e-5
        assert max((fixed["grads"][k] - budget["grads"][k]).abs().max().item() for k in fixed["grads"]) <= 1e-5
        assert (fixed["log_probs"] - budget["log_probs"]).abs().max() <= 1e-5
    # The gradients are the data-parallel average: the same on both ranks.
    assert max((ranks[0]["budget"]["grads"][k] - ranks[1]["budget"]["grads"][k]).abs().max().item()
               for k in ranks[0]["budget"]["grads"]) == 0.0


def test_sdpa_core_attention_equals_megatrons_dot_product_attention(qwen2: str) -> None:
    """The CPU layer spec's attention (torch SDPA, grouped key/value heads) against Megatron's own
    ``DotProductAttention`` on the same inputs: outputs and input gradients within fp32 rounding."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    worker = _worker(qwen2)
    core = worker.module.decoder.layers[0].self_attention.core_attention
    assert isinstance(core, DotProductAttention) and type(core) is not DotProductAttention and core.sdpa
    heads, groups = core.num_attention_heads_per_partition, core.num_query_groups_per_partition
    assert heads > groups  # the tiny model has grouped key/value heads
    s, b = 11, 3
    torch.manual_seed(0)
    q = torch.randn(s, b, heads, core.hidden_size_per_attention_head, requires_grad=True)
    k = torch.randn(s, b, groups, core.hidden_size_per_attention_head, requires_grad=True)
    v = torch.randn(s, b, groups, core.hidden_size_per_attention_head, requires_grad=True)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)
    core.train()
    outputs, grads = [], []
    with worker._shims():
        for forward in (core.forward, lambda *a: DotProductAttention.forward(core, *a)):
            out = forward(q, k, v, mask)
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outputs.append(out.detach())
            grads.append([t.grad.clone() for t in (q, k, v)])
            for t in (q, k, v):
                t.grad = None
    assert outputs[0].shape == (s, b, heads * core.hidden_size_per_attention_head)
    assert (outputs[0] - outputs[1]).abs().max() <= 1e-5
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(*grads))
