"""The SGLang engine on a CUDA device: run by scripts/gpu_check_sglang.sh on a GPU machine.

Skipped without CUDA. Covers what a CPU cannot: seeded sampling (deterministic inference), memory
release and resume around a sync, the ``tensor`` transport (CUDA tensors shared by IPC handle)
and the ``distributed`` transport (an NCCL broadcast group between trainer and server).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from verl_core.contracts import ModelSpec, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.sglang,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _engine(model_dir: str, tokenizer: Any, tmp_path, **changes: Any) -> Any:
    from verl_rollout_sglang.engine import SGLangRollout, SGLangRolloutConfig

    config = SGLangRolloutConfig(device="cuda", log_dir=str(tmp_path), mem_fraction_static=0.3, **changes)
    return SGLangRollout(config=config, model=ModelSpec(path=model_dir, dtype="float32"), tokenizer=tokenizer)


def _weights(model_dir: str, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).cuda()
    return [(n, p.detach() * (scale if "embed" in n else 1.0)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("transport", ["tensor", "distributed", "disk"])
def test_transport_changes_and_restores_outputs(model_dir: str, tokenizer: Any, prompts: list[list[int]],
                                                tmp_path, transport: str) -> None:
    engine = _engine(model_dir, tokenizer, tmp_path, weight_sync=transport)
    try:
        greedy = SamplingParams(n=1, greedy=True, max_new_tokens=8)
        before = engine.generate(prompts, sampling=greedy).response_ids
        engine.load_weights(iter(_weights(model_dir, 1.5)))
        assert engine.generate(prompts, sampling=greedy).response_ids != before
        engine.load_weights(iter(_weights(model_dir)))
        assert engine.generate(prompts, sampling=greedy).response_ids == before
        assert engine.weight_version == 2
    finally:
        engine.close()


def test_seeds_repeat_samples_and_sleep_wakes(model_dir: str, tokenizer: Any, prompts: list[list[int]],
                                              tmp_path) -> None:
    engine = _engine(model_dir, tokenizer, tmp_path, enable_sleep_mode=True)
    try:
        assert engine.seeded_sampling and engine.supports_memory_release
        sampled = SamplingParams(n=3, max_new_tokens=8, seed=7)
        first = engine.generate(prompts, sampling=sampled).response_ids
        free_before = torch.cuda.mem_get_info()[0]
        engine.release_memory()
        assert torch.cuda.mem_get_info()[0] > free_before, "release_memory freed no GPU memory"
        engine.reacquire_memory()
        engine.load_weights(iter(_weights(model_dir)))
        assert engine.generate(prompts, sampling=sampled).response_ids == first
    finally:
        engine.close()
