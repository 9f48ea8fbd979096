"""The Hugging Face rollout, stand-alone on the tiny built-in model, against the shared
:class:`~verl_core.testing.RolloutConformance` suite. (The FSDP and Megatron backends' tests run the
same suite with the engine on their actors' modules.)
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from verl_core.contracts import ModelSpec
from verl_core.testing import RolloutConformance, tiny_model_dir
from verl_rollout_hf import HFRollout, HFRolloutConfig

# The machine is shared: one thread keeps these tests from stealing cores.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("hf-rollout"))


class TestHFRolloutConformance(RolloutConformance):
    # Loading the tiny model once per class is enough: the weight tests restore what they change.
    @pytest.fixture(scope="class")
    def engine(self, model_dir: str) -> Iterator[HFRollout]:
        from transformers import AutoTokenizer

        engine = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=model_dir),
                           tokenizer=AutoTokenizer.from_pretrained(model_dir), actor=None)
        yield engine
        engine.close()

    @pytest.fixture(scope="class")
    def prompt_ids(self, engine: HFRollout) -> list[list[int]]:
        tok = engine.tokenizer
        # Different lengths, so the engine has to left-pad the batch.
        texts = ["12+34=", "5+6=", "123+4=", "99+1="]
        return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                        return_dict=False) for t in texts]

    @pytest.fixture(scope="class")
    def reference_model(self, model_dir: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
