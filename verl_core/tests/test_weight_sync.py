"""How the controller brings a rollout engine to the actor's policy: full weights or a LoRA adapter."""

import pytest
import torch

from verl_core.config import ConfigError
from verl_core.interfaces import LoRAAdapter, RolloutEngine, RolloutOutput, TrainingWorker
from verl_core.rollout_utils import check_weight_sync, sync_rollout_weights


class Actor(TrainingWorker):
    def __init__(self, adapter=None):
        self.adapter, self.asked, self.streamed = adapter, 0, 0

    def compute_log_probs(self, batch, *, with_entropy=False):
        raise AssertionError("not used")

    def lora_adapter(self):
        self.asked += 1
        return self.adapter

    def iter_weights(self):
        self.streamed += 1
        yield "w", torch.zeros(1)


class Engine(RolloutEngine):
    def __init__(self, adapters: bool):
        self.adapters, self.loaded = adapters, []

    @property
    def accepts_lora_adapters(self):
        return self.adapters

    def generate(self, prompt_ids, *, sampling):
        return RolloutOutput([], None, [])

    def load_weights(self, weights):
        self.loaded.append(("weights", [name for name, _ in weights]))

    def load_lora_adapter(self, adapter):
        self.loaded.append(("adapter", sorted(adapter.tensors)))


def test_full_weights_when_the_actor_syncs_no_adapter_and_the_question_is_asked_once():
    actor, engine = Actor(), Engine(adapters=True)
    for _ in range(3):
        sync_rollout_weights(engine, actor)
    assert engine.loaded == [("weights", ["w"])] * 3
    assert actor.asked == 1  # the answer cannot change: no round trip on later steps


def test_an_adapter_goes_to_an_engine_that_serves_adapters_and_is_refused_by_one_that_does_not():
    adapter = LoRAAdapter(rank=4, alpha=16, target_modules=["q_proj"], tensors={"a.lora_A.weight": torch.zeros(4, 8)})
    engine = Engine(adapters=True)
    sync_rollout_weights(engine, Actor(adapter))
    assert engine.loaded == [("adapter", ["a.lora_A.weight"])]
    with pytest.raises(ConfigError, match="backend.lora_sync"):
        check_weight_sync(Engine(adapters=False), Actor(adapter))
