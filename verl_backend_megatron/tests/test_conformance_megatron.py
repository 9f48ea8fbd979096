"""The Megatron backend against the shared backend conformance suite: one rank in this process, and
TP=2 and DP=2 over two spawned processes (the suite's heavy multi-rank case).

Every worker runs real Megatron-Core (GPT model, DDP, optimizer, schedule, dist_checkpointing) on a
gloo group; on a machine without CUDA the shims of ``verl_backend_megatron._cpu`` apply.
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from verl_backend_megatron.backend import MegatronBackend, MegatronConfig
from verl_core.contracts import ModelSpec, Role, WorldInfo
from verl_core.testing import BackendConformance, RolloutConformance, chat_prompt_ids, tiny_model_dir
from verl_rollout_hf import HFRollout, HFRolloutConfig


pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def _tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("megatron"))


class TestMegatronBackendConformance(BackendConformance):
    @pytest.fixture
    def backend(self) -> MegatronBackend:
        # Micro-batches smaller than the batch: accumulation through Megatron's schedule is checked too.
        return MegatronBackend(MegatronConfig(lr=1e-3, micro_batch_size=4, log_prob_micro_batch_size=4))

    @pytest.fixture
    def model_dir(self, _tiny_model: str) -> str:
        return _tiny_model

    @pytest.fixture(params=["tp2", "dp2", "pp2"])
    def multi_rank_backend(self, request: pytest.FixtureRequest) -> MegatronBackend:
        # TP=2: one data-parallel group whose two ranks each hold half of every layer (one output
        # rank); DP=2: two replicas, each group its own output rank; PP=2: two stages, the pipelined
        # schedule's micro-batches (3 of 2 samples) weighted like any others. eps=1e-5 as in the FSDP suite:
        # Adam's first step would turn summation-order noise on ~0 gradients into lr-sized moves.
        layout = {"tp2": dict(tensor_parallel_size=2), "dp2": {}, "pp2": dict(pipeline_parallel_size=2)}[request.param]
        return MegatronBackend(MegatronConfig(lr=1e-3, eps=1e-5, micro_batch_size=2, log_prob_micro_batch_size=2,
                                              **layout))


    @pytest.fixture
    def micro_batching_backends(self) -> dict[str, MegatronBackend]:
        # eps=1: Adam's first step ~linear in the gradient, which the suite compares through the weights.
        layouts = {
            "one micro-batch": dict(micro_batch_size=16),
            "3 micro-batches": dict(micro_batch_size=6),
            "8 micro-batches": dict(micro_batch_size=2),
            "token budget 48": dict(micro_batch_max_tokens=48),
        }
        return {name: MegatronBackend(MegatronConfig(lr=0.1, eps=1.0, **layout)) for name, layout in layouts.items()}


class TestHFRolloutOnMegatronActorConformance(RolloutConformance):
    """The in-process Hugging Face rollout generating from a Megatron actor's weights (its generation module)."""

    @pytest.fixture(scope="class")
    def engine(self, _tiny_model: str) -> Iterator[HFRollout]:
        from transformers import AutoTokenizer

        spec = ModelSpec(path=_tiny_model)
        actor = MegatronBackend(MegatronConfig()).create_worker(role=Role.ACTOR, model=spec, world=WorldInfo(), seed=0)
        engine = HFRollout(config=HFRolloutConfig(), model=spec, tokenizer=AutoTokenizer.from_pretrained(_tiny_model),
                           actor=actor)
        yield engine
        engine.close()
        actor.close()

    @pytest.fixture(scope="class")
    def prompt_ids(self, engine: HFRollout) -> list[list[int]]:
        return chat_prompt_ids(engine.tokenizer)

    @pytest.fixture(scope="class")
    def reference_model(self, _tiny_model: str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(_tiny_model, dtype=torch.float32).eval()
