"""The Megatron backend on a CUDA device (NCCL, no CPU shims); skipped on machines without one."""

from __future__ import annotations

import pytest
import torch

from verl_backend_megatron import _cpu
from verl_backend_megatron.backend import MegatronBackend, MegatronConfig
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import BackendConformance, make_batch, tiny_model_dir
from verl_core.testing._backend import simple_policy_loss

pytestmark = [pytest.mark.gpu, pytest.mark.megatron,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_worker_matches_hf_and_trains_unpatched(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    assert not _cpu.needed()  # with CUDA the shims stay out
    path = tiny_model_dir(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = make_batch(batch_size=6, prompt_length=7, response_length=6, vocab_size=hf.config.vocab_size,
                       group_size=3, pad_id=hf.config.pad_token_id or 0, advantages=True)
    worker = MegatronBackend(MegatronConfig(lr=1e-3)).create_worker(
        role=Role.ACTOR, model=ModelSpec(path=path), world=WorldInfo(device="cuda:0"), seed=0)
    ref, _ = BackendConformance.reference_log_probs(hf, batch)
    real = batch.response_attention_mask.bool()
    # TF32 matmuls and fused kernels on a GPU: a looser bound than the fp32 CPU parity.
    assert (worker.compute_log_probs(batch).log_probs.cpu()[real] - ref[real]).abs().max() <= 1e-3
    metrics = worker.update_policy(batch, loss_fn=simple_policy_loss, mini_batch_size=0, epochs=1)
    assert metrics["actor/grad_norm"] > 0
    assert not _cpu.rewritten_call_sites()
