"""The FSDP2 backend against the shared conformance suites.

:class:`~verl_core.testing.BackendConformance` checks the workers; :class:`~verl_core.testing.RolloutConformance`
checks the Hugging Face rollout running on an FSDP actor's own (sharded) module.

Every worker runs on a one-rank gloo process group inside this pytest process; the first worker
creates it and the others reuse it, which is exactly what the suite needs to exercise. The suite's
heavy multi-rank case starts two processes of its own (a two-way sharded group).
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
import torch.distributed as dist

from verl_backend_fsdp.backend import FSDPBackend, FSDPConfig
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import BackendConformance, RolloutConformance, tiny_model_dir
from verl_rollout_hf import HFRollout, HFRolloutConfig

# The machine is shared: one thread keeps these tests from stealing cores.
torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _process_group() -> Iterator[None]:
    # Leave torch.distributed as we found it, so later test modules can set up their own group.
    was_initialized = dist.is_available() and dist.is_initialized()
    yield
    if not was_initialized and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def _tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("fsdp"))


class TestFSDPBackendConformance(BackendConformance):
    @pytest.fixture
    def backend(self) -> FSDPBackend:
        # Micro-batches smaller than the batch, so gradient accumulation and chunked log-prob
        # passes are part of what the suite checks.
        return FSDPBackend(FSDPConfig(lr=1e-3, micro_batch_size=4, log_prob_micro_batch_size=4))

    @pytest.fixture
    def model_dir(self, _tiny_model: str) -> str:
        return _tiny_model

    @pytest.fixture
    def multi_rank_backend(self) -> FSDPBackend:
        # Two ranks: every parameter sharded two ways. eps=1e-5, not AdamW's 1e-8: an element whose
        # true gradient is ~0 gets summation-order noise that Adam's first step would turn into an
        # lr-sized move at one world size and not the other.
        return FSDPBackend(FSDPConfig(lr=1e-3, eps=1e-5, micro_batch_size=2, log_prob_micro_batch_size=2))


    @pytest.fixture(params=["full", "lora"])
    def micro_batching_backends(self, request: pytest.FixtureRequest) -> dict[str, FSDPBackend]:
        # The suite's batch: 16 samples of 0 to 12 loss tokens. eps=1 makes Adam's first step ~linear in
        # the gradient (the suite compares the weights it writes); lr=0.1 makes that step visible.
        common = dict(lr=0.1, eps=1.0, lora_rank=4 if request.param == "lora" else 0)
        layouts = {
            "one micro-batch": dict(micro_batch_size=16),
            "3 micro-batches": dict(micro_batch_size=6),
            "8 micro-batches": dict(micro_batch_size=2),
            "token budget 48": dict(micro_batch_max_tokens=48),
            "packed, 3 micro-batches": dict(micro_batch_size=6, remove_padding="true"),
            "no shared prompt, 8 micro-batches": dict(micro_batch_size=2, shared_prompt="false"),
        }
        return {name: FSDPBackend(FSDPConfig(**common, **layout)) for name, layout in layouts.items()}


class TestHFRolloutOnFSDPActorConformance(RolloutConformance):
    """The Hugging Face rollout sharing an FSDP actor's module: the in-process weight-sync path."""

    @pytest.fixture(scope="class")
    def engine(self, _tiny_model: str) -> Iterator[HFRollout]:
        from transformers import AutoTokenizer

        spec = ModelSpec(path=_tiny_model)
        actor = FSDPBackend(FSDPConfig()).create_worker(role=Role.ACTOR, model=spec, world=WorldInfo(threads=1),
                                                        seed=0)
        engine = HFRollout(config=HFRolloutConfig(), model=spec, tokenizer=AutoTokenizer.from_pretrained(_tiny_model),
                           actor=actor)
        yield engine
        engine.close()
        actor.close()

    @pytest.fixture(scope="class")
    def prompt_ids(self, engine: HFRollout) -> list[list[int]]:
        tok = engine.tokenizer
        texts = ["12+34=", "5+6=", "123+4="]  # different lengths: the batch is left-padded
        return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                        return_dict=False) for t in texts]

    @pytest.fixture(scope="class")
    def reference_model(self, _tiny_model: str) -> torch.nn.Module:
        # The actor is never trained here, so the checkpoint still holds its weights.
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(_tiny_model, dtype=torch.float32).eval()
