"""The Megatron backend at one rank, in this process: parity with the FSDP backend and Hugging Face,
conversion of Qwen2 and Llama variants, export, critic, checkpoints, validation, and the CPU shims.

Real megatron-core throughout (GPT model, DDP, optimizer, schedule, dist_checkpointing).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from verl_backend_megatron import _cpu
from verl_backend_megatron.backend import MegatronBackend, MegatronConfig
from verl_core.contracts import CheckpointError
from verl_core.config import ConfigError
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import BackendConformance, make_batch, tiny_model_dir
from verl_core.testing._backend import simple_policy_loss, simple_value_loss


pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Llama with tied embeddings, GQA (4 heads, 1 key/value head), no biases and a non-default RoPE theta."""
    import transformers

    from verl_core.testing import build_byte_tokenizer

    out = tmp_path_factory.mktemp("llama") / "model"
    tok = build_byte_tokenizer()
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                      tie_word_embeddings=True, rope_theta=500000.0, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _hf(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _batch(model: torch.nn.Module, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make_batch(batch_size=6, prompt_length=7, response_length=6, vocab_size=model.config.vocab_size,
                          group_size=3, pad_id=model.config.pad_token_id or 0, advantages=True, values=True)


def _megatron(path: str, role: Role = Role.ACTOR, **settings):
    config = MegatronConfig(**{"lr": 1e-3, "micro_batch_size": 4, "log_prob_micro_batch_size": 4, **settings})
    return MegatronBackend(config).create_worker(role=role, model=ModelSpec(path=path), world=WorldInfo(), seed=0)


def test_log_probs_and_updates_match_the_fsdp_backend(qwen2: str) -> None:
    """Same weights, batch and settings: log-probs within 1e-5 (fp32), then 3 updates' losses, grad
    norms and weights within 1e-4 of the FSDP backend's."""
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    # eps=1e-5: a first Adam step is ~lr x sign(g), so with eps=1e-8 a gradient at rounding level moves by lr.
    settings = dict(lr=1e-3, eps=1e-5, micro_batch_size=4, log_prob_micro_batch_size=4, grad_clip=1.0, warmup_steps=2)
    fsdp = FSDPBackend(FSDPConfig(**settings)).create_worker(role=Role.ACTOR, model=ModelSpec(path=qwen2),
                                                             world=WorldInfo(), seed=0)
    mcore = _megatron(qwen2, **settings)
    batch = _batch(_hf(qwen2))
    real = batch.response_attention_mask.bool()
    a, b = fsdp.compute_log_probs(batch, with_entropy=True), mcore.compute_log_probs(batch, with_entropy=True)
    assert (a.log_probs[real] - b.log_probs[real]).abs().max() <= 1e-5
    assert (a.entropy[real] - b.entropy[real]).abs().max() <= 1e-5
    for _ in range(3):
        ma = fsdp.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        mb = mcore.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        assert abs(ma["test/loss"] - mb["test/loss"]) <= 1e-4
        assert abs(ma["actor/grad_norm"] - mb["actor/grad_norm"]) <= 1e-4
        assert ma["actor/lr"] == mb["actor/lr"]  # the same warm-up schedule
    wa, wb = dict(fsdp.iter_weights()), dict(mcore.iter_weights())
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-4
    fsdp.close()


def test_weight_decay_leaves_biases_and_norm_weights_alone(qwen2: str) -> None:
    """Megatron's convention, which the config documents: before, every parameter decayed (the norm weights
    shrank towards 0), since wd_mult=0 takes effect only through the LR scheduler this backend does not use."""
    batch = _batch(_hf(qwen2))
    updated = {}
    for decay in (0.0, 0.5):
        worker = _megatron(qwen2, weight_decay=decay)
        worker.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
        updated[decay] = dict(worker.iter_weights())
    exempt = [k for k in updated[0.0] if k.endswith((".bias", "norm.weight"))]
    assert "model.norm.weight" in exempt and "model.layers.0.self_attn.q_proj.bias" in exempt
    for k, v in updated[0.0].items():
        assert torch.equal(v, updated[0.5][k]) == (k in exempt), k


def test_llama_with_tied_embeddings_and_gqa_converts_exactly(llama_tied: str) -> None:
    hf = _hf(llama_tied)
    worker = _megatron(llama_tied)
    weights = dict(worker.iter_weights())
    expected = dict(hf.named_parameters())
    assert weights.keys() == expected.keys()  # lm_head is the embedding: not yielded twice
    assert all(torch.equal(weights[k], expected[k].detach()) for k in expected)
    batch = _batch(hf)
    ref, _ = BackendConformance.reference_log_probs(hf, batch)
    real = batch.response_attention_mask.bool()
    assert (worker.compute_log_probs(batch).log_probs[real] - ref[real]).abs().max() <= 1e-5


def test_export_writes_a_hugging_face_model_whose_logits_match(qwen2: str, tmp_path: Path) -> None:
    worker = _megatron(qwen2)
    batch = _batch(_hf(qwen2))
    worker.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
    worker.export_hf(str(tmp_path / "hf"))
    exported = _hf(str(tmp_path / "hf"))
    ref, _ = BackendConformance.reference_log_probs(exported, batch)
    real = batch.response_attention_mask.bool()
    assert (worker.compute_log_probs(batch).log_probs[real] - ref[real]).abs().max() <= 1e-5
    trained = dict(worker.iter_weights())
    assert all(torch.equal(trained[k], p.detach()) for k, p in exported.named_parameters())
    # The in-process generation module follows the trained weights too.
    with worker.generation_module() as module:
        assert all(torch.equal(trained[k], p) for k, p in module.named_parameters())


def test_critic_starts_at_zero_learns_and_resumes(qwen2: str, tmp_path: Path) -> None:
    critic = _megatron(qwen2, Role.CRITIC, critic_lr=1e-3)
    batch = _batch(_hf(qwen2))
    assert torch.equal(critic.compute_values(batch), torch.zeros(batch.response_ids.shape))
    first = critic.update_values(batch, loss_fn=simple_value_loss, mini_batch_size=0, epochs=1)
    second = critic.update_values(batch, loss_fn=simple_value_loss, mini_batch_size=0, epochs=1)
    assert second["test/value_loss"] < first["test/value_loss"]
    assert {k for k, _ in critic.iter_weights()} >= {"score.weight", "score.bias", "model.norm.weight"}
    critic.save_state(str(tmp_path / "critic"))
    again = _megatron(qwen2, Role.CRITIC, critic_lr=1e-3)
    again.load_state(str(tmp_path / "critic"))  # the value head is part of the sharded state
    assert torch.equal(again.compute_values(batch), critic.compute_values(batch))


def test_distributed_optimizer_resumes_bit_identically(qwen2: str, tmp_path: Path) -> None:
    """``use_distributed_optimizer`` with Megatron's torch AdamW (no TransformerEngine/Apex): save,
    load into a fresh worker (no optimizer state yet), one more update = the uninterrupted run, bit
    for bit (Adam's step and moments included); a state saved before the first update loads too."""
    settings = dict(use_distributed_optimizer=True, weight_decay=0.1)
    batch = _batch(_hf(qwen2))
    run = _megatron(qwen2, **settings)
    initial = {k: v.clone() for k, v in run.iter_weights()}
    run.save_state(str(tmp_path / "step0"))  # the optimizer has not allocated its state yet
    run.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
    run.save_state(str(tmp_path / "step1"))
    resumed = _megatron(qwen2, **settings)
    assert not any(_adam_state(resumed))
    resumed.load_state(str(tmp_path / "step1"))
    assert resumed.optimizer_steps == 1
    a = run.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
    b = resumed.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
    assert (a["test/loss"], a["actor/grad_norm"], a["actor/lr"]) == (b["test/loss"], b["actor/grad_norm"],
                                                                     b["actor/lr"])
    theirs = dict(resumed.iter_weights())
    assert all(torch.equal(v, theirs[k]) for k, v in run.iter_weights())
    for mine, other in zip(_adam_state(run), _adam_state(resumed), strict=True):
        assert len(mine) == len(other) > 0
        for p, q in zip(mine.values(), other.values(), strict=True):
            assert p.keys() == q.keys() and all(torch.equal(p[k], q[k]) for k in p)
            assert p["step"].item() == 2.0  # one step counter per parameter, not one shared by all
    fresh = _megatron(qwen2, **settings)
    fresh.load_state(str(tmp_path / "step0"))
    assert fresh.optimizer_steps == 0
    assert all(torch.equal(initial[k], v) for k, v in fresh.iter_weights())


def test_loading_another_roles_checkpoint_is_refused(qwen2: str, tmp_path: Path) -> None:
    critic = _megatron(qwen2, Role.CRITIC)
    critic.save_state(str(tmp_path / "critic"))
    with pytest.raises(CheckpointError, match="different role"):
        _megatron(qwen2).load_state(str(tmp_path / "critic"))
    with pytest.raises(CheckpointError, match="no Megatron state"):
        _megatron(qwen2).load_state(str(tmp_path))


def _adam_state(worker) -> list:
    return [sub.optimizer.state for sub in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])]


def test_load_saved_weights_reads_the_model_alone(qwen2: str, tmp_path: Path) -> None:
    """What ``verl export`` loads: the trained weights, into an actor or the reference, without
    allocating or reading the optimizer's state (which ``load_state`` then does restore)."""
    actor = _megatron(qwen2)
    actor.update_policy(_batch(_hf(qwen2)), loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
    actor.save_state(str(tmp_path / "actor"))
    trained = dict(actor.iter_weights())
    fresh = _megatron(qwen2)
    fresh.load_saved_weights(str(tmp_path / "actor"))
    assert all(torch.equal(trained[k], v) for k, v in fresh.iter_weights())
    assert fresh.optimizer_steps == 0 and not any(_adam_state(fresh)), "load_saved_weights touched the optimizer"
    fresh.load_state(str(tmp_path / "actor"))
    assert fresh.optimizer_steps == 1 and all(_adam_state(fresh))
    reference = _megatron(qwen2, Role.REFERENCE)
    reference.load_saved_weights(str(tmp_path / "actor"))  # the same language model: the actor's weights fit
    assert all(torch.equal(trained[k], v) for k, v in reference.iter_weights())
    with pytest.raises(CheckpointError, match="different role"):
        _megatron(qwen2, Role.CRITIC).load_saved_weights(str(tmp_path / "actor"))


def test_cpu_shims_rewrite_only_the_known_call_sites(qwen2: str) -> None:
    """The tripwire: a megatron-core upgrade that calls CUDA somewhere new shows up here (and in the log)."""
    if not _cpu.needed():
        pytest.skip("CUDA is available: Megatron runs unpatched")
    worker = _megatron(qwen2)
    worker.update_policy(_batch(_hf(qwen2)), loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
    known = {"megatron/core/optimizer/optimizer.py:907", "megatron/core/pipeline_parallel/schedules.py:596",
             "megatron/core/pipeline_parallel/schedules.py:2138", "megatron/core/optimizer/clip_grads.py:103",
             "megatron/core/optimizer/clip_grads.py:167", "megatron/core/optimizer/clip_grads.py:174",
             "megatron/core/utils.py:1207",
             # The distributed optimizer's (when an earlier test used it): its parameter type checks, its
             # MixedPrecisionOptimizer buffers and the gather of its state for a checkpoint.
             "megatron/core/optimizer/distrib_optimizer.py:361", "megatron/core/optimizer/distrib_optimizer.py:420",
             "megatron/core/optimizer/distrib_optimizer.py:582", "megatron/core/optimizer/distrib_optimizer.py:1089",
             "megatron/core/optimizer/optimizer.py:481", "megatron/core/optimizer/optimizer.py:485"}
    sites = set(_cpu.rewritten_call_sites())
    assert {"megatron/core/pipeline_parallel/schedules.py:596", "megatron/core/optimizer/clip_grads.py:167"} <= sites
    assert sites <= known | {s for s in sites if "dist_checkpointing" in s}, f"new CUDA call sites: {sites - known}"


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("settings, world_size, match", [
    ({"tensor_parallel_size": 2}, 3, "3 ranks, which is not a multiple of tensor_parallel_size=2"),
    ({"tensor_parallel_size": 4}, 4, "2 key/value heads; tensor_parallel_size=4 must divide both"),
    ({"pipeline_parallel_size": 4}, 4, "2 layers, which pipeline_parallel_size=4 does not divide"),
])
def test_layouts_that_do_not_fit_name_the_numbers(qwen2: str, settings, world_size, match) -> None:
    backend = MegatronBackend(MegatronConfig(**settings))
    with pytest.raises(ConfigError, match=match):
        backend.check(model=ModelSpec(path=qwen2), world_size=world_size)


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="'gpt2' model; the megatron backend converts qwen2, llama"):
        MegatronBackend(MegatronConfig()).check(model=ModelSpec(path=str(tmp_path / "gpt2")), world_size=1)


def test_missing_or_untested_megatron_core_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from verl_core.config import resolve_config
    from verl_core.registry import PluginRegistry

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.99.0" if name == "megatron-core" else real(name))
    with pytest.raises(ConfigError, match="megatron-core 0.99.0 is installed, but this backend was tested with 0.16.1"):
        resolve_config({"backend": {"name": "megatron"}}, PluginRegistry())
    resolve_config({"backend": {"name": "megatron", "allow_untested_version": True}}, PluginRegistry())

    def missing(name: str) -> str:
        if name == "megatron-core":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(ConfigError, match="megatron-core is not installed"):
        resolve_config({"backend": {"name": "megatron"}}, PluginRegistry())


@pytest.mark.slow
def test_cli_refuses_a_bad_layout_before_any_model_loads(run_verl, qwen2: str, tmp_path: Path) -> None:
    res = run_verl("run", "--backend", "megatron", "--model", qwen2, "--output-dir", str(tmp_path / "run"),
                   "backend.tensor_parallel_size=3", timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "backend.tensor_parallel_size" in res.stderr and "not a multiple" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_config_rejects_nonsense_sizes() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size: must be at least 1"):
        dataclasses.replace(MegatronConfig(), tensor_parallel_size=0).validate()


def test_single_process_settings_collapse_only_the_layout() -> None:
    """What ``verl export`` builds from a TP=2 x PP=2 run's saved config: one process, the rest kept."""
    saved = MegatronConfig(tensor_parallel_size=2, pipeline_parallel_size=2, use_distributed_optimizer=True, lr=3e-4)
    one = saved.for_single_process()
    assert (one.tensor_parallel_size, one.pipeline_parallel_size) == (1, 1)
    assert dataclasses.replace(one, tensor_parallel_size=2, pipeline_parallel_size=2) == saved
    assert (saved.tensor_parallel_size, saved.pipeline_parallel_size) == (2, 2)
