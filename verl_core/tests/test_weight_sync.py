"""How the controller brings a rollout engine to the actor's policy: full weights or a LoRA adapter."""

import pytest
import torch

from verl_core.config import ConfigError
from verl_core.contracts import LoRAAdapter, RolloutEngine, RolloutOutput, TrainingWorker
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


# --------------------------------------------------------------------------- the log-prob gap guard
class _GapActor(TrainingWorker):
    """The trainer's side: log-probs ``offset`` away from what the engine reported."""

    def __init__(self, offset):
        self.offset, self.calls = offset, []

    def compute_log_probs(self, batch, *, with_entropy=False):
        from verl_core.contracts import LogProbs

        self.calls.append(len(batch))
        return LogProbs(batch.rollout_log_probs + self.offset)


def _gap_context(offset, *, limit=0.05, action="error", shares=False):
    from verl_core.dataflow import StepContext
    from verl_core.testing import make_batch

    batch = make_batch(batch_size=8, group_size=4, tool_tokens=False)
    batch = batch.replace(rollout_log_probs=batch.old_log_probs.clone(), old_log_probs=None)
    rollout = Engine(adapters=False)
    rollout.shares_actor_weights = shares
    return StepContext(step=3, prompts=[], algorithm=None, actor=_GapActor(offset), rollout=rollout, reward=None,
                       sampling=None, batch=batch, max_log_prob_gap=limit, log_prob_gap_action=action,
                       rollout_name="vllm")


def _old_log_probs_flow():
    from verl_core.dataflow import DataflowBuilder

    df = DataflowBuilder()
    df.node("given", lambda ctx: None, writes=("batch",))
    df.actor_log_probs()
    return df.build()


def test_a_gap_over_the_limit_stops_the_step_naming_step_gap_and_engine():
    from verl_core.rollout_utils import WeightSyncError

    ctx = _gap_context(0.5)
    with pytest.raises(WeightSyncError) as excinfo:
        _old_log_probs_flow().run(ctx)
    message = str(excinfo.value)
    assert "RL step 3" in message and "'vllm'" in message and "weight sync after step 2" in message
    assert "0.5 per token" in message and "rollout.max_log_prob_gap=0.05" in message
    assert ctx.metrics["rollout/log_prob_diff_mean"] == pytest.approx(0.5)


def test_a_gap_within_the_limit_trains_and_is_recorded():
    ctx = _gap_context(0.01)
    _old_log_probs_flow().run(ctx)
    assert ctx.metrics["rollout/log_prob_diff_mean"] == pytest.approx(0.01)
    assert ctx.batch.old_log_probs is not None


def test_warn_mode_and_limit_zero_go_on(caplog):
    ctx = _gap_context(0.5, action="warn")
    with caplog.at_level("WARNING", logger="verl.rollout"):
        _old_log_probs_flow().run(ctx)
    assert "RL step 3" in caplog.text
    _old_log_probs_flow().run(_gap_context(5.0, limit=0.0))  # 0 turns the guard off


def test_a_nan_gap_is_divergence_not_a_sync_error():
    with pytest.raises(FloatingPointError, match="diverged"):
        _old_log_probs_flow().run(_gap_context(float("nan")))


def test_engines_that_cannot_be_out_of_sync_record_the_gap_and_never_stop():
    shared = _gap_context(0.5, shares=True)  # the HF rollout on the actor's own module
    _old_log_probs_flow().run(shared)
    assert shared.metrics["rollout/log_prob_diff_mean"] == pytest.approx(0.5)
    fixed = _gap_context(0.5)  # an OpenAI server with weight_sync="ignore": fixed weights on purpose
    fixed.rollout.follows_actor_weights = False
    _old_log_probs_flow().run(fixed)
    assert fixed.metrics["rollout/log_prob_diff_mean"] == pytest.approx(0.5)


def test_guard_limit_follows_the_least_precise_compute_dtype():
    from verl_core.rollout_utils import DEFAULT_LOG_PROB_GAP, guard_limit

    assert guard_limit(None, ["float32", "float32"]) == DEFAULT_LOG_PROB_GAP["float32"]
    # fp32 master weights with bf16 mixed precision (or a bf16 engine) get the 16-bit limit.
    assert guard_limit(None, ["float32", "bfloat16"]) == DEFAULT_LOG_PROB_GAP["bfloat16"]
    assert guard_limit(0.0, ["bfloat16"]) == 0.0 and guard_limit(0.2, ["float32"]) == 0.2


def test_the_rollout_stage_checks_a_few_samples_for_every_algorithm(monkeypatch):
    """GPG and use_rollout_log_probs never recompute old log-probs and SPIN rebuilds the batch; the
    stage checks a slice of what the engine generated itself."""
    from verl_core import rollout_stage
    from verl_core.contracts import RolloutRequest
    from verl_core.rollout_utils import WeightSyncError

    ctx = _gap_context(0.5)
    given = ctx.batch
    monkeypatch.setattr(rollout_stage, "_generate_scored", lambda ctx, request: given)  # as generated
    with pytest.raises(WeightSyncError):
        rollout_stage.run(ctx, RolloutRequest())
    assert ctx.actor.calls == [rollout_stage.ENGINE_CHECK_SAMPLES]
    # An engine on the actor's own weights needs no check (and gets no extra forward pass).
    shared = _gap_context(0.5, shares=True)
    rollout_stage.run(shared, RolloutRequest())
    assert shared.actor.calls == []


def test_an_engine_that_frees_memory_sleeps_while_the_step_trains_and_wakes_for_the_sync(monkeypatch):
    """vLLM's sleep mode was accepted and never used: nothing called release/reacquire in a run."""
    from verl_core import rollout_stage
    from verl_core.contracts import RolloutRequest

    ctx = _gap_context(0.0)
    ctx.rollout.supports_memory_release = True
    calls = []
    ctx.rollout.release_memory = lambda: calls.append("release")
    given = ctx.batch
    monkeypatch.setattr(rollout_stage, "_generate_scored", lambda ctx, request: calls.append("generate") or given)
    rollout_stage.run(ctx, RolloutRequest())
    assert calls == ["generate", "release"] and ctx.engine_released
    ctx = _gap_context(0.0)  # an engine that cannot free memory is left alone
    monkeypatch.setattr(rollout_stage, "_generate_scored", lambda ctx, request: given)
    rollout_stage.run(ctx, RolloutRequest())
    assert not ctx.engine_released
