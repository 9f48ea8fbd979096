"""Megatron sequence parallelism (``backend.sequence_parallel``) on CPU with gloo.

Real megatron-core at ``tensor_parallel_size=2`` in two spawned processes (marked heavy): the same
log-probs, values, losses, gradient norms and updated weights as without sequence parallelism, on a
batch whose micro-batches are laid out at odd widths (padded up to a multiple of the TP size). The
config errors are light.
"""

from __future__ import annotations

import pytest
import torch

from verl_backend_megatron.backend import MegatronBackend, MegatronConfig
from verl_core.config import ConfigError
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import make_batch, tiny_model_dir
from verl_core.testing._backend import run_ranks, sample_mean_policy_loss, simple_value_loss

pytestmark = pytest.mark.megatron

TP = 2


def test_sequence_parallel_without_tensor_parallelism_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"sequence_parallel: .*tensor_parallel_size=1; set tensor_parallel_size "
                                         r"to 2 or more, or sequence_parallel=false"):
        MegatronConfig(sequence_parallel=True).validate()
    MegatronConfig(sequence_parallel=True, tensor_parallel_size=2).validate()
    MegatronConfig(sequence_parallel=True, tensor_parallel_size=2, pipeline_parallel_size=2).validate()
    # An export or a single-process check of a TP=2 run's checkpoint drops it with the tensor parallelism.
    single = MegatronConfig(sequence_parallel=True, tensor_parallel_size=2).for_single_process()
    assert not single.sequence_parallel
    single.validate()


def test_sequence_parallel_without_tensor_parallelism_fails_in_config_resolution_before_any_model_loads() -> None:
    from verl_core.config import resolve_config
    from verl_core.registry import PluginRegistry

    with pytest.raises(ConfigError, match="backend.sequence_parallel") as info:
        resolve_config({"backend": {"name": "megatron", "sequence_parallel": True}}, PluginRegistry())
    assert "tensor_parallel_size to 2 or more" in str(info.value)


# ----------------------------------------------------------------------------- two tensor-parallel ranks
DEADLINE_S = 420


def _tied_qwen2(out: str) -> str:
    """A Qwen2 with tied embeddings (the embedding and the LM head one parameter), 4 heads, 2 key/value heads."""
    import transformers

    from verl_core.testing import build_byte_tokenizer

    tok = build_byte_tokenizer()
    config = transformers.Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = transformers.Qwen2ForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _batch():
    # Prompt 7 + response 8: the longest sample is 15 tokens, so a micro-batch holding it is laid out
    # 16 wide with sequence parallelism; random lengths give other odd widths too.
    return make_batch(batch_size=8, prompt_length=7, response_length=8, vocab_size=16, group_size=4,
                      advantages=True, seed=11)


def _sp_rank(rank: int, world_size: int, models: dict[str, str]) -> dict:
    import torch.distributed as dist

    batch = _batch()  # tensor-parallel peers hold the same samples (DP = 1)
    out: dict = {}
    for name, path, role in (("untied", models["untied"], Role.ACTOR), ("tied", models["tied"], Role.ACTOR),
                             ("critic", models["untied"], Role.CRITIC)):
        for sp in (False, True):
            config = MegatronConfig(lr=1e-3, critic_lr=1e-3, grad_clip=1.0, micro_batch_size=3,
                                    log_prob_micro_batch_size=3, tensor_parallel_size=TP, sequence_parallel=sp)
            worker = MegatronBackend(config).create_worker(role=role, model=ModelSpec(path=path),
                                                           world=WorldInfo(rank=rank, world_size=world_size,
                                                                           threads=1), seed=0)
            seen: list[int] = []  # sequence lengths the final norm ran over, on this rank
            hook = worker.module.decoder.final_layernorm.register_forward_hook(
                lambda module, args, output: seen.append(args[0].shape[0]))
            r: dict = {"widths": [m.tokens.shape[1] for m in worker._micro_batches(batch, 3)]}
            if role is Role.CRITIC:
                r["before"] = worker.compute_values(batch)
                # A new value head starts at 0: the first update reaches only the head, the second the
                # whole model (norms included) through it.
                for _ in range(2):
                    metrics = worker.update_values(batch, loss_fn=simple_value_loss, mini_batch_size=0, epochs=1)
                r["loss"], r["grad_norm"] = metrics["test/value_loss"], metrics["critic/grad_norm"]
                r["after"] = worker.compute_values(batch)
            else:
                lp = worker.compute_log_probs(batch, with_entropy=True)
                r["before"], r["entropy"] = lp.log_probs, lp.entropy
                metrics = worker.update_policy(batch, loss_fn=sample_mean_policy_loss, mini_batch_size=0, epochs=1)
                r["loss"], r["grad_norm"] = metrics["test/loss"], metrics["actor/grad_norm"]
                r["after"] = worker.compute_log_probs(batch).log_probs
            hook.remove()
            r["norm_lengths"] = seen
            r["norm_weight_marked"] = bool(getattr(worker.module.decoder.final_layernorm.weight,
                                                   "sequence_parallel", False))
            r["weights"] = {k: t.detach().cpu().clone() for k, t in worker.iter_weights()}  # collective
            dist.barrier()
            worker.close()
            out[(name, sp)] = r
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.heavy
def test_sequence_parallel_matches_tensor_parallel_alone_at_two_ranks(tmp_path) -> None:
    """TP=2 with and without sequence parallelism: actor log-probs and entropy, one update's loss,
    gradient norm and weights (untied and tied embeddings), and a critic's values and two updates."""
    models = {"untied": tiny_model_dir(tmp_path / "untied"), "tied": _tied_qwen2(str(tmp_path / "tied"))}
    ranks = run_ranks(_sp_rank, TP, models, out_dir=str(tmp_path), deadline_s=DEADLINE_S)
    real = _batch().response_attention_mask.bool()
    for rank, result in enumerate(ranks):
        for name in ("untied", "tied", "critic"):
            off, on = result[(name, False)], result[(name, True)]
            # The layout: each micro-batch as wide as its longest sample, rounded up to a multiple of TP.
            assert any(w % TP for w in off["widths"]), off["widths"]
            assert on["widths"] == [-(-w // TP) * TP for w in off["widths"]]
            # Sequence parallelism really ran: the final norm saw half of each (padded) sequence.
            assert on["norm_weight_marked"] and not off["norm_weight_marked"]
            assert on["norm_lengths"] and all(2 * n in on["widths"] for n in on["norm_lengths"])
            assert off["norm_lengths"] and all(n in off["widths"] for n in off["norm_lengths"])
            for key in ("before", "after") + (("entropy",) if name != "critic" else ()):
                diff = (off[key][real] - on[key][real]).abs().max().item()
                assert diff <= 1e-5, (rank, name, key, diff)
            assert not torch.equal(off["before"][real], off["after"][real])  # the update moved them
            assert abs(off["loss"] - on["loss"]) <= 1e-5, (name, off["loss"], on["loss"])
            assert abs(off["grad_norm"] - on["grad_norm"]) <= 1e-5 * max(1.0, off["grad_norm"])
            assert off["weights"].keys() == on["weights"].keys()
            diff = max((off["weights"][k] - on["weights"][k]).abs().max().item() for k in off["weights"])
            assert diff <= 1e-4, (rank, name, diff)
    # Tensor-parallel peers report the same results.
    for name in ("untied", "tied", "critic"):
        a, b = ranks[0][(name, True)], ranks[1][(name, True)]
        assert (a["after"] - b["after"]).abs().max() <= 1e-6


def _pipelined_rank(rank: int, world_size: int, path: str) -> dict:
    import torch.distributed as dist

    batch = _batch()
    out: dict = {}
    for sp in (False, True):
        config = MegatronConfig(lr=1e-3, grad_clip=1.0, micro_batch_size=3, log_prob_micro_batch_size=3,
                                tensor_parallel_size=TP, pipeline_parallel_size=2, sequence_parallel=sp)
        worker = MegatronBackend(config).create_worker(role=Role.ACTOR, model=ModelSpec(path=path),
                                                       world=WorldInfo(rank=rank, world_size=world_size, threads=1),
                                                       seed=0)
        r: dict = {"widths": [m.tokens.shape[1] for m in worker._micro_batches(batch, 3)],
                   "last_stage": worker.last_stage, "before": worker.compute_log_probs(batch).log_probs}
        metrics = worker.update_policy(batch, loss_fn=sample_mean_policy_loss, mini_batch_size=0, epochs=1)
        r["loss"], r["grad_norm"] = metrics.get("test/loss"), metrics["actor/grad_norm"]
        r["after"] = worker.compute_log_probs(batch).log_probs
        r["weights"] = {k: t.detach().cpu().clone() for k, t in worker.iter_weights()}  # collective
        dist.barrier()
        worker.close()
        out[sp] = r
    dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.mark.heavy
@pytest.mark.long  # four processes; the two-rank test above makes the same claim without a pipeline
def test_sequence_parallel_with_a_pipeline_matches_at_tp2_pp2(tmp_path) -> None:
    """TP=2 x PP=2 (4 processes, 1F1B): the pipeline sends each stage's ``[width / TP, rows, hidden]``
    part; log-probs, the update's loss, gradient norm and weights equal those without sequence parallelism."""
    ranks = run_ranks(_pipelined_rank, 2 * TP, tiny_model_dir(tmp_path / "model"), out_dir=str(tmp_path),
                      deadline_s=DEADLINE_S)
    real = _batch().response_attention_mask.bool()
    assert [r[True]["last_stage"] for r in ranks] == [False, False, True, True]
    for r in ranks:
        off, on = r[False], r[True]
        # With a pipeline every micro-batch has the batch's width (15), padded to 16.
        assert set(off["widths"]) == {15} and set(on["widths"]) == {16}
        assert abs(off["grad_norm"] - on["grad_norm"]) <= 1e-5 * max(1.0, off["grad_norm"])
        diff = max((off["weights"][k] - on["weights"][k]).abs().max().item() for k in off["weights"])
        assert diff <= 1e-4, diff
        if r[True]["last_stage"]:  # results live on the last stage
            assert abs(off["loss"] - on["loss"]) <= 1e-5
            for key in ("before", "after"):
                assert (off[key][real] - on[key][real]).abs().max() <= 1e-5
