"""The in-process vLLM engine: the core's rollout contract, the trainer's log-probs, weight sync.

All tests share the session's one engine (``vllm_engine`` in conftest.py); the tests that change
its weights put the originals back.
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from verl_core.contracts import ModelSpec, Role, SamplingParams, WorldInfo
from verl_core.rollout_utils import build_batch
from verl_core.testing import RolloutConformance

pytestmark = pytest.mark.vllm


class TestVLLMRolloutConformance(RolloutConformance):
    @pytest.fixture
    def engine(self, vllm_engine: Any) -> Any:
        return vllm_engine

    @pytest.fixture
    def prompt_ids(self, prompts: list[list[int]]) -> list[list[int]]:
        return prompts

    @pytest.fixture(scope="class")
    def reference_model(self, model_dir: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def fsdp_actor(model_dir: str) -> Iterator[Any]:
    """An FSDP actor on the same model, in this process (it reuses vLLM's one-rank process group)."""
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig

    worker = FSDPBackend(FSDPConfig(lr=1e-3)).create_worker(role=Role.ACTOR, model=ModelSpec(path=model_dir),
                                                             world=WorldInfo(), seed=0)
    yield worker
    worker.close()


def _rollout_vs_actor_gap(engine: Any, actor: Any, prompts: list[list[int]], tokenizer: Any) -> float:
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, seed=3)
    rows = [{"prompt_ids": p} for p in prompts]
    batch = build_batch(rows, engine.generate(prompts, sampling=sampling), n=sampling.n,
                        pad_id=tokenizer.pad_token_id)
    trainer_lp = actor.compute_log_probs(batch).log_probs
    mask = batch.response_mask.bool()
    return float((trainer_lp - batch.rollout_log_probs)[mask].abs().max())


def test_log_probs_match_the_fsdp_trainer(vllm_engine: Any, fsdp_actor: Any, prompts: list[list[int]],
                                          tokenizer: Any) -> None:
    gap = _rollout_vs_actor_gap(vllm_engine, fsdp_actor, prompts, tokenizer)
    assert gap <= 1e-3, f"vLLM and FSDP log-probs of the same tokens differ by up to {gap:.2e}"


@pytest.mark.parametrize("transport", ["tensors", "file"])
def test_weight_sync_from_the_fsdp_actor(vllm_engine: Any, fsdp_actor: Any, prompts: list[list[int]],
                                         tokenizer: Any, model_dir: str, transport: str) -> None:
    """After an in-place sync the engine samples from the actor's new weights, exactly."""
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=8)
    before = vllm_engine.generate(prompts, sampling=greedy).response_ids
    module = fsdp_actor.hf_module()
    saved = {k: v.detach().clone() for k, v in fsdp_actor.iter_weights()}
    g = torch.Generator().manual_seed(7)
    # The file transport is what a multi-process engine uses; in-process it runs against the same engine.
    vllm_engine.config.multiprocessing = transport == "file"
    try:
        with torch.no_grad():
            for p in module.parameters():
                p.add_(_like(p, 0.5 * torch.randn(p.shape, generator=g)))
        vllm_engine.load_weights(fsdp_actor.iter_weights())
        assert vllm_engine.last_sync_seconds > 0
        assert vllm_engine.generate(prompts, sampling=greedy).response_ids != before
        gap = _rollout_vs_actor_gap(vllm_engine, fsdp_actor, prompts, tokenizer)
        assert gap <= 1e-3, f"after the sync, vLLM and the actor differ by up to {gap:.2e}"
    finally:
        vllm_engine.config.multiprocessing = False
        with torch.no_grad():
            params = dict(module.named_parameters())
            for name, value in saved.items():
                if name in params:
                    params[name].copy_(_like(params[name], value))
        vllm_engine.load_weights(iter(saved.items()))
    assert vllm_engine.generate(prompts, sampling=greedy).response_ids == before


def _like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` laid out like ``param`` (FSDP2 parameters are DTensors)."""
    value = value.to(param.dtype)
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(value, param.device_mesh, param.placements)
    return value


def test_host_threads_and_set_num_threads_survive_the_engine(vllm_engine: Any) -> None:
    # vLLM's CPU worker replaces torch.set_num_threads with a warning; the engine puts it back.
    assert torch.set_num_threads.__name__ == "set_num_threads"
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)


def _hf_log_probs(model: torch.nn.Module, prompts: list[list[int]], out: Any, n: int) -> list[list[float]]:
    """Log-probs of each sampled token under a Hugging Face model: the reference the engine must match."""
    result = []
    with torch.no_grad():
        for i, response in enumerate(out.response_ids):
            prompt = prompts[i // n]
            ids = torch.tensor([prompt + response])
            log_probs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
            result.append([float(log_probs[len(prompt) - 1 + t, tok]) for t, tok in enumerate(response)])
    return result


def _max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(x) for x in a] == [len(y) for y in b]
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def test_memory_release_cycle_keeps_the_synced_policy(vllm_engine: Any, model_dir: str,
                                                      prompts: list[list[int]]) -> None:
    """rollout.enable_sleep_mode: release/reacquire between rollouts never changes what the engine samples.

    On a GPU vLLM sleeps (weights offloaded, KV cache dropped) and wakes up; on CPU, where vLLM has
    no sleep mode, the engine started with the setting anyway, says it frees nothing, and the cycle
    leaves it as it was. Either way the weights synced before the cycle are the ones served after it
    (not the model directory's), and a sync after it takes effect.
    """
    from transformers import AutoModelForCausalLM

    assert vllm_engine.config.enable_sleep_mode  # the session engine asks for it (conftest.py)
    # Claiming to free memory that vLLM keeps would mislead whoever plans memory around it.
    assert vllm_engine.supports_memory_release is (not vllm_engine.on_cpu)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # the engine's start
    trained = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    greedy = SamplingParams(n=1, greedy=True, max_new_tokens=8)
    start_greedy = vllm_engine.generate(prompts, sampling=greedy).response_ids
    try:
        vllm_engine.load_weights(trained.state_dict().items())  # the policy as trained so far
        before = vllm_engine.generate(prompts, sampling=sampled)
        before_greedy = vllm_engine.generate(prompts, sampling=greedy).response_ids
        assert before_greedy != start_greedy
        assert _max_gap(before.log_probs, _hf_log_probs(trained, prompts, before, 2)) <= 1e-3  # the sync took

        vllm_engine.release_memory()
        vllm_engine.reacquire_memory()
        after = vllm_engine.generate(prompts, sampling=sampled)
        assert after.response_ids == before.response_ids and after.finish_reasons == before.finish_reasons
        assert _max_gap(after.log_probs, before.log_probs) <= 1e-5
        assert vllm_engine.generate(prompts, sampling=greedy).response_ids == before_greedy

        vllm_engine.release_memory()
        vllm_engine.reacquire_memory()
        vllm_engine.load_weights(base.state_dict().items())  # the next step's sync, after waking up
        synced = vllm_engine.generate(prompts, sampling=greedy)
        assert synced.response_ids == start_greedy
        assert _max_gap(synced.log_probs, _hf_log_probs(base, prompts, synced, 1)) <= 1e-3
    finally:
        vllm_engine.load_weights(base.state_dict().items())  # the other tests expect the starting weights


def test_top_k_one_is_greedy(vllm_engine: Any, prompts: list[list[int]]) -> None:
    greedy = vllm_engine.generate(prompts, sampling=SamplingParams(n=1, greedy=True, max_new_tokens=6))
    top1 = vllm_engine.generate(prompts, sampling=SamplingParams(n=2, temperature=1.0, top_k=1, max_new_tokens=6,
                                                                 seed=9))
    assert top1.response_ids == [r for r in greedy.response_ids for _ in range(2)]


@pytest.mark.vllm
def test_lora_actor_syncs_only_its_adapter(vllm_engine: Any, fsdp_actor: Any, model_dir: str,
                                           prompts: list[list[int]], tokenizer: Any) -> None:
    """backend.lora_sync='adapters': the engine keeps the base weights and serves the trained adapter."""
    pytest.importorskip("peft")
    from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
    from verl_core.rollout_utils import sync_rollout_weights
    from verl_core.testing import make_batch

    actor = FSDPBackend(FSDPConfig(lr=5e-2, lora_rank=4, lora_sync="adapters")).create_worker(
        role=Role.ACTOR, model=ModelSpec(path=model_dir), world=WorldInfo(), seed=0)
    batch = make_batch(batch_size=8, prompt_length=5, response_length=6, vocab_size=len(tokenizer),
                       advantages=True, seed=0)

    def loss(*, batch, log_probs, entropy=None, values=None):
        value = -(log_probs * batch.advantages * batch.response_mask).sum() / batch.response_mask.sum()
        return value, {}

    for _ in range(3):  # lora_B starts at zero: a few updates make the adapter matter
        actor.update_policy(batch, loss_fn=loss, mini_batch_size=0, epochs=1)
    adapter = actor.lora_adapter()
    assert adapter is not None and adapter.rank == 4
    assert adapter.tensors and all(".lora_A." in k or ".lora_B." in k for k in adapter.tensors)
    model_numel = sum(p.numel() for p in actor.module.parameters() if not p.requires_grad)
    assert sum(t.numel() for t in adapter.tensors.values()) < 0.5 * model_numel
    try:
        sync_rollout_weights(vllm_engine, actor)  # the adapter path: nothing else is sent
        assert vllm_engine._lora is not None
        moved = float((actor.compute_log_probs(batch).log_probs - fsdp_actor.compute_log_probs(batch).log_probs)
                      [batch.response_mask.bool()].abs().max())
        assert moved > 1e-2  # the adapter changed the policy ...
        assert _rollout_vs_actor_gap(vllm_engine, actor, prompts, tokenizer) <= 1e-3  # ... and vLLM serves it
    finally:
        vllm_engine.load_weights(fsdp_actor.iter_weights())  # full weights replace the adapter
        actor.close()
    assert vllm_engine._lora is None
    assert _rollout_vs_actor_gap(vllm_engine, fsdp_actor, prompts, tokenizer) <= 1e-3
