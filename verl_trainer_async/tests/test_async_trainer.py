"""The overlapping trainer modes (issue 19): bad settings, staleness, weight versions, drop/wait, lossless
resume, and the old-log-prob forward that is skipped only where it equals the update's own log-probs.

Small but real: the default tiny task, model, backend, HF rollout and GRPO, 2-6 steps in process.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from verl_core.config import ConfigError
from verl_core.registry import UnknownPluginError
from verl_core.dataflow import DataflowBuilder, StepContext, old_log_probs_reusable

FAST = ["data.batch_size=8", "rollout.n=4", "run.val_every=0", "run.val_before_train=false", "run.threads=2",
        "reward.isolation=\"none\"", "run.loggers=[]", "run.resume='never'", "backend.lr_schedule='cosine'",
        "backend.min_lr_ratio=0.1"]


def trainer(tmp: Path, *overrides: str, steps: int = 3) -> Any:
    from verl_core.trainer import Trainer

    return Trainer.from_config(overrides=[*FAST, f"run.max_steps={steps}", f"run.output_dir='{tmp}'", *overrides])


def weights(t: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.actor.iter_weights()}


class _Steps:
    """Records each step's metrics."""

    def __init__(self, t: Any) -> None:
        self.metrics: list[dict[str, float]] = []
        run_step = t.run_step

        def recorded() -> dict[str, float]:
            m = run_step()
            self.metrics.append(m)
            return m

        t.run_step = recorded


# ------------------------------------------------------------------ bad input, before any model loads
@pytest.mark.parametrize("override, match", [
    ("trainer.max_staleness=-1", "trainer.max_staleness: must be >= 0"),
    ("trainer.mode='overlap'",
     "trainer.mode: no step_source plugin named 'overlap'.*colocate_async, partial, separate_async, sync"),
    ("trainer.on_stale='skip'", "trainer.on_stale: must be 'wait' or 'drop'"),
    ("trainer.producer='fork'", "trainer.producer: must be one of"),
    # In sync mode the overlapping modes' settings are refused unless at their defaults (old config.toml files).
    ("trainer.mode='sync' trainer.max_staleness=2", "trainer.max_staleness: applies to the overlapping modes only"),
])
def test_bad_trainer_settings_name_their_key(override: str, match: str, tmp_path: Path) -> None:
    overrides = override.split() if "mode=" in override else ["trainer.mode='colocate_async'", override]
    with pytest.raises((ConfigError, UnknownPluginError), match=match):
        trainer(tmp_path, *overrides)


@pytest.mark.parametrize("overrides, match", [
    (["trainer.mode='colocate_async'", "algorithm.name='gpg'"], "algorithm 'gpg' cannot.*off_policy is false"),
    (["trainer.mode='colocate_async'", "algorithm.name='dpo'"], "generates nothing"),
    (["trainer.mode='separate_async'"], "'separate_async' needs a rollout pool.*LocalExecutor"),
    (["trainer.mode='colocate_async'", "executor.name='ray'"], "does not share|do not share"),
    (["trainer.mode='separate_async'", "executor.name='ray'"], "placed on the actor's pool 'default'"),
])
def test_async_modes_refuse_what_they_cannot_run_before_any_model_loads(overrides: list[str], match: str,
                                                                        tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_core.trainer import Trainer

    def no_workers(self: Any, resume: str) -> None:
        raise AssertionError("workers started before the trainer mode was checked")

    monkeypatch.setattr(Trainer, "_start_workers", no_workers)
    t = trainer(tmp_path, *overrides)
    with pytest.raises(ConfigError, match=match) as info:
        t.setup()
    assert info.value.path == "trainer.mode"


@pytest.mark.parametrize(("overrides", "cap"), [
    (["trainer.mode='colocate_async'"], 2.0),                                   # stale samples: corrected
    (["trainer.mode='colocate_async'", "algorithm.rollout_is_cap=0"], 0.0),     # the user's setting wins
    (["trainer.mode='colocate_async'", "algorithm.rollout_is_cap=5.0"], 5.0),
    (["trainer.mode='colocate_async'", "trainer.max_staleness=0"], 0.0),        # on-policy: nothing to correct
    (["trainer.mode='colocate_async'", "algorithm.use_rollout_log_probs=true"], 0.0),  # the rollout's are the old
    ([], 0.0),                                                                  # sync
])
def test_async_modes_weigh_stale_samples_unless_told_otherwise(tmp_path: Path, overrides: list[str],
                                                               cap: float) -> None:
    t = trainer(tmp_path, *overrides)
    assert t.config.algorithm.config.rollout_is_cap == cap
    assert ("sets algorithm.rollout_is_cap=2.0" in t.config.profile) == (cap == 2.0 and len(overrides) == 1)


# ------------------------------------------------------------------ staleness, versions, drop and wait
def test_one_step_off_policy_trains_step_n_on_weights_n_minus_2_and_the_producer_holds_them(tmp_path: Path) -> None:
    t = trainer(tmp_path, "trainer.mode='colocate_async'", "trainer.max_staleness=1", steps=4)
    steps = _Steps(t)
    seen: list[list[Any]] = []
    t.setup()
    take = t.source.next

    def recorded_take(step: int) -> Any:
        sourced = take(step)
        seen.append(list(sourced.produced.meta["weight_version"]))
        return sourced

    t.source.next = recorded_take
    t.train()
    # Step s trains on a batch from the weights after max(0, s - 2) updates.
    assert [m["async/weight_version"] for m in steps.metrics] == [0.0, 0.0, 1.0, 2.0]
    assert [m["async/staleness"] for m in steps.metrics] == [0.0, 1.0, 1.0, 1.0]
    assert [set(v) for v in seen] == [{0}, {0}, {1}, {2}]
    # Stale batches recompute their old log-probs; the fresh first one may reuse the update's.
    assert [m["actor/old_log_probs_reused"] for m in steps.metrics] == [1.0, 0.0, 0.0, 0.0]


def test_staleness_zero_overlaps_nothing_and_trains_as_sync_does(tmp_path: Path) -> None:
    sync = trainer(tmp_path / "sync")
    sync.train()
    overlapped = trainer(tmp_path / "async", "trainer.mode='colocate_async'", "trainer.max_staleness=0")
    overlapped.train()
    a, b = weights(sync), weights(overlapped)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_the_producer_engine_samples_from_the_published_weights_not_its_initial_ones(tmp_path: Path) -> None:
    # The thread producer's own module can be read here; the process producer's is checked by
    # test_the_process_producer_trains_exactly_as_the_thread_producer.
    t = trainer(tmp_path, "trainer.mode='colocate_async'", "trainer.max_staleness=0", "trainer.producer='thread'",
                steps=2)
    t.setup()
    producer = t.source.producer
    assert producer.engine is not t.rollout  # the run's HF engine shares the actor's module
    versions: dict[int, list[tuple[str, torch.Tensor]]] = {}
    publish = producer.publish

    def kept(version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
        versions[version] = weights
        publish(version, weights)

    producer.publish = kept
    initial = {k: v.clone() for k, v in producer.engine._own.named_parameters()}
    t.train()
    # The last batch came from version 1, loaded into the producer's own module, every parameter of it.
    assert producer.engine_version == 1
    own = dict(producer.engine._own.named_parameters())
    assert {name for name, _ in versions[1]} >= set(own)
    assert all(torch.equal(own[name], tensor) for name, tensor in versions[1] if name in own)
    assert any(not torch.equal(initial[name], own[name]) for name in own)


def test_the_producers_engine_is_checked_on_the_weights_each_batch_comes_from(tmp_path: Path) -> None:
    """Every batch of one-step off-policy training comes from older weights, and step 1 reuses the update's own
    log-probs, so the step's own check never runs; the producer's engine is checked when it starts and right
    after each update instead (trainer.sync_check_every)."""
    healthy = trainer(tmp_path, "trainer.mode='colocate_async'", "trainer.producer='thread'", steps=3)
    steps = _Steps(healthy)
    healthy.train()
    # Each step reports the check of the weights its successors come from (the thread producer's HF copy: fp32).
    assert [m["async/staleness"] for m in steps.metrics] == [0.0, 1.0, 1.0]
    assert all(m["rollout/log_prob_diff_mean"] < 1e-5 for m in steps.metrics)


@pytest.mark.parametrize("clean_loads, match, trained_steps", [
    (0, "at RL step 1: .* since its start", 0),  # version 0, loaded when the producer starts
    (1, "at RL step 2: .* since the weight sync after step 1", 1),  # step 1 is reported; step 2 never trains
])
def test_a_broken_sync_to_the_producers_engine_stops_the_run_before_its_weights_train(
        tmp_path: Path, clean_loads: int, match: str, trained_steps: int) -> None:
    from verl_core.kit import WeightSyncError

    t = trainer(tmp_path, "trainer.mode='colocate_async'", "trainer.producer='thread'", steps=3)
    t.setup()
    engine = t.source.producer.engine
    load, loads = engine.load_weights, []

    def corrupt(weights: list[tuple[str, torch.Tensor]]) -> None:
        loads.append(1)
        load([(name, tensor * (1.0 if len(loads) <= clean_loads else 1.1)) for name, tensor in weights])

    engine.load_weights = corrupt
    trained = _Steps(t)
    with pytest.raises(WeightSyncError, match=match):
        t.train()
    assert len(trained.metrics) == trained_steps
    # Off, the same corrupt engine trains silently: what the check is for.
    off = trainer(tmp_path / "off", "trainer.mode='colocate_async'", "trainer.producer='thread'",
                  "trainer.sync_check_every=0", steps=3)
    off.setup()
    off.source.producer.engine.load_weights = lambda weights, load=off.source.producer.engine.load_weights: load(
        [(name, tensor * 1.1) for name, tensor in weights])
    assert "rollout/log_prob_diff_mean" not in off.train()


def test_the_producer_engine_is_built_on_the_device_the_runs_engine_generates_on(tmp_path: Path,
                                                                                  monkeypatch: Any) -> None:
    """A CUDA trainer's producer copy left on the CPU would generate there, silently. Here the actor is on the CPU,
    so the device the run's engine reports is stood in by "meta" (a device torch has everywhere): the copy must
    land there. The CUDA run itself is test_colocate_async_generates_on_the_trainers_cuda_device (GPU check)."""
    import verl_trainer_async.source as source
    from verl_core.contracts import ModelSpec, WorldInfo
    from verl_rollout_hf import HFRollout, HFRolloutConfig

    t = trainer(tmp_path, "trainer.mode='colocate_async'", "trainer.producer='thread'", steps=1)
    t.setup()
    try:
        assert source.generation_device(t.rollout) == "cpu"
        engine = t.source.producer.engine
        assert engine.world.device == "cpu" and next(engine._own.parameters()).device.type == "cpu"
    finally:
        t._close_source()
        t.executor.shutdown()
    monkeypatch.setattr(source, "generation_device", lambda engine: "meta")
    t = trainer(tmp_path / "meta", "trainer.mode='colocate_async'", "trainer.producer='thread'", steps=1)
    t.setup()
    try:
        engine = t.source.producer.engine
        assert engine.world.device == "meta"
        assert {p.device.type for p in engine._own.parameters()} == {"meta"}
    finally:
        t._close_source()
        t.executor.shutdown()
    # The stand-alone HF engine puts its own copy where its world says.
    spec = ModelSpec(path=t.model_spec.path, module=torch.nn.Linear(2, 2))
    hf = HFRollout(config=HFRolloutConfig(), model=spec, tokenizer=t.tokenizer, world=WorldInfo(device="meta"))
    assert next(hf._own.parameters()).device.type == "meta"


def test_a_published_version_in_shared_memory_is_one_block_a_rollout_process_adopts_without_a_copy(
        tmp_path: Path) -> None:
    """The process producer's weight versions (bench/results/async_memory.md): one shared block per version,
    tied weights stored once, and the HF engine takes its views as its parameters instead of copying them."""
    from verl_core.contracts import ModelSpec
    from verl_rollout_hf import HFRollout, HFRolloutConfig
    from verl_trainer_async.engine_host import shared_copy

    emb = torch.randn(5, 3)
    given = [("embed", emb), ("head", emb), ("bias", torch.arange(3, dtype=torch.bfloat16))]
    version = shared_copy(given)
    assert version.storage.is_shared() and [name for name, _ in version] == ["embed", "head", "bias"]
    assert version.layout[0][1] == version.layout[1][1] and version.layout[2][1] % 64 == 0
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(version, given)) and version[2][1].dtype == torch.bfloat16
    emb.add_(1.0)
    assert not torch.equal(version[0][1], emb)  # a copy of what was published
    # No room left in /dev/shm: an error that says what to do, not a SIGBUS at the first touch.
    import shutil

    import verl_trainer_async.engine_host as engine_host

    full = shutil.disk_usage("/")._replace(free=16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_host.shutil, "disk_usage", lambda path: full)
        with pytest.raises(RuntimeError, match=r"/dev/shm has 0.00 GiB free; give the container more .*--shm-size"):
            shared_copy(given)

    t = trainer(tmp_path, steps=1)
    t.setup()
    try:
        weights = shared_copy(t.actor.iter_weights())
        module = copy.deepcopy(t.model_spec.module) if t.model_spec.module is not None else None
        hf = HFRollout(config=HFRolloutConfig(), model=ModelSpec(path=t.model_spec.path, module=module),
                       tokenizer=t.tokenizer)
        hf.adopt_weights(weights)
        own = dict(hf._own.named_parameters())
        block = (weights.storage.data_ptr(), weights.storage.data_ptr() + weights.storage.numel())
        assert own and all(block[0] <= p.data_ptr() < block[1] for p in own.values())
        by_name = dict(weights)
        assert all(torch.equal(p, by_name[name]) for name, p in own.items())
    finally:
        t._close_source()
        t.executor.shutdown()


def test_the_rollout_process_reads_each_adopted_version_after_the_trainer_drops_it(tmp_path: Path) -> None:
    """Versions published into shared memory, loaded into the engine's process and dropped here: the child
    generates what an in-process engine with those weights generates, and a plain weight load afterwards never
    writes into a published version. The child is built with the world it is given (its device)."""
    from verl_core.contracts import ModelSpec, SamplingParams, WorldInfo
    from verl_rollout_hf import HFRollout, HFRolloutConfig
    from verl_trainer_async.engine_host import HostedEngine, shared_copy

    t = trainer(tmp_path, steps=1)
    t.setup()
    spec = ModelSpec(path=t.model_spec.path, dtype=t.model_spec.dtype)
    hosted = HostedEngine(HFRollout, config=HFRolloutConfig(), model=spec, tokenizer=t.tokenizer)
    local = HFRollout(config=HFRolloutConfig(), model=spec, tokenizer=t.tokenizer)
    meta = HostedEngine(HFRollout, config=HFRolloutConfig(), model=spec, tokenizer=t.tokenizer,
                        world=WorldInfo(device="meta"))
    try:
        assert hosted.child_info()["device"] == "cpu" and meta.child_info()["device"] == "meta"
        base = [(name, tensor.detach().clone()) for name, tensor in t.actor.iter_weights()]
        prompts = [[3, 4, 5], [6, 7]]
        greedy = SamplingParams(max_new_tokens=6, greedy=True, logprobs=False)
        torch.manual_seed(0)
        for _ in range(3):
            weights = [(name, tensor + 0.05 * torch.randn_like(tensor)) for name, tensor in base]
            version = shared_copy(weights)  # what HostedEngine.snapshot publishes for a CPU child
            hosted.load_weights(version)
            local.load_weights(iter(weights))
            del version  # the trainer's reference goes; the child's mapping keeps the block
            assert hosted.generate(prompts, sampling=greedy).response_ids == local.generate(
                prompts, sampling=greedy).response_ids
        published = shared_copy(base)
        hosted.load_weights(published)
        before = [tensor.clone() for _, tensor in published]
        hosted.load_weights([(name, tensor + 1.0) for name, tensor in base])  # the staging path
        assert all(torch.equal(a, b) for a, b in zip(before, (tensor for _, tensor in published)))
        local.load_weights((name, tensor + 1.0) for name, tensor in base)
        assert hosted.generate(prompts, sampling=greedy).response_ids == local.generate(
            prompts, sampling=greedy).response_ids
    finally:
        hosted.close()
        meta.close()
        t._close_source()
        t.executor.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("producer", ["thread", "process"])
def test_colocate_async_generates_on_the_trainers_cuda_device(tmp_path: Path, producer: str) -> None:
    t = trainer(tmp_path, "trainer.mode='colocate_async'", f"trainer.producer='{producer}'", "executor.device='cuda'",
                steps=2)
    t.setup()
    engine = t.source.producer.engine
    if producer == "thread":
        assert next(engine._own.parameters()).device.type == "cuda"
    else:
        assert engine.child_info()["device"].startswith("cuda")
    metrics = t.train()
    assert t.step == 2 and all(v == v for v in metrics.values())  # no NaN


def test_drop_throws_away_batches_over_the_bound_and_counts_them(tmp_path: Path) -> None:
    # With no staleness allowed and a producer that never waits for weights, the batch it generates while
    # a step trains is one version old by the time it is taken.
    t = trainer(tmp_path, "trainer.mode='colocate_async'", "trainer.max_staleness=0", "trainer.on_stale='drop'",
                steps=4)
    steps = _Steps(t)
    t.train()
    assert all(m["async/staleness"] == 0.0 for m in steps.metrics)
    assert steps.metrics[-1]["async/dropped_samples"] > 0
    assert steps.metrics[-1]["async/dropped_samples"] == steps.metrics[-1]["async/dropped_batches"] * 8 * 4


# ------------------------------------------------------------------ lossless resume
def _prompts_by_step(run_dir: Path) -> dict[int, list[int]]:
    out = {}
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        state = json.loads((ckpt / "trainer_state.json").read_text())
        out[state["step"]] = state["prompts"]
    return out


def _crash_at(t: Any, step: int) -> None:
    """Train ``t`` until its step ``step`` raises, as a crash would (the checkpoints before it stay)."""
    run_step = t.run_step

    def crashing() -> dict[str, float]:
        if t.step == step:
            raise RuntimeError("simulated crash")
        return run_step()

    t.run_step = crashing
    with pytest.raises(RuntimeError, match="simulated crash"):
        t.train()


RAY_SPLIT = ("trainer.mode='separate_async'", "executor.name='ray'", "executor.pools={gen=1}",
             "executor.placement={rollout='gen'}", "run.threads=1")


@pytest.mark.parametrize("mode", [("trainer.mode='colocate_async'",),
                                  pytest.param(RAY_SPLIT, marks=pytest.mark.heavy, id="separate_async")])
def test_a_crashed_async_run_resumes_with_its_buffer_and_ends_as_the_uninterrupted_run(
        tmp_path: Path, mode: tuple[str, ...]) -> None:
    common = [*mode, "trainer.max_staleness=1", "run.save_every=1", "run.keep_checkpoints=0"]
    # A multi-process executor's workers end with the run: read its weights back from the final checkpoint.
    final = _final_weights if "executor.name='ray'" in mode else (lambda run_dir, t: weights(t))
    whole = trainer(tmp_path / "whole", *common, steps=5)
    whole.train()
    expected = final(tmp_path / "whole", whole)

    _crash_at(trainer(tmp_path / "crashed", *common, "run.resume='auto'", steps=5), 4)
    ckpt = tmp_path / "crashed" / "checkpoints" / "step_000003"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    # Batch 4 (from version 2) waited in the buffer; it is in the checkpoint with its samples.
    assert [b["seq"] for b in state["async"]["buffered"]] == [4]
    assert state["async"]["buffered"][0]["version"] == 2
    assert (ckpt / "rollout_buffer.pt").is_file()

    resumed = trainer(tmp_path / "crashed", *common, "run.resume='auto'", steps=5)
    resumed.train()
    assert resumed.resumed_from.name == "step_000003"
    got = final(tmp_path / "crashed", resumed)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    assert _prompts_by_step(tmp_path / "crashed") == _prompts_by_step(tmp_path / "whole")


def test_drop_mode_resumes_without_losing_or_repeating_a_prompt(tmp_path: Path) -> None:
    """on_stale='drop' takes the newest weights, so its samples depend on timing and no resume can be bit-identical;
    what it keeps is the prompts: a crashed and resumed run trains each prompt at most once, and exactly the
    uninterrupted run's prompts, step for step, where neither dropped a batch."""
    common = ["trainer.mode='colocate_async'", "trainer.max_staleness=1", "trainer.on_stale='drop'",
              "run.save_every=1", "run.keep_checkpoints=0"]
    whole = trainer(tmp_path / "whole", *common, steps=5)
    whole_steps = _Steps(whole)
    whole.train()
    crashed = trainer(tmp_path / "crashed", *common, "run.resume='auto'", steps=5)
    _crash_at(crashed, 4)
    resumed = trainer(tmp_path / "crashed", *common, "run.resume='auto'", steps=5)
    resumed_steps = _Steps(resumed)
    resumed.train()
    assert resumed.resumed_from.name == "step_000003"
    got = _prompts_by_step(tmp_path / "crashed")
    assert sorted(got) == [1, 2, 3, 4, 5]
    trained = [i for step in sorted(got) for i in got[step]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    # The resumed run's count goes on from the checkpoint's: drops of the crashed run's first steps count too.
    saved = json.loads((tmp_path / "crashed" / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert resumed_steps.metrics[-1]["async/dropped_samples"] >= saved["async"]["dropped_samples"]
    dropped = whole_steps.metrics[-1]["async/dropped_samples"] + resumed_steps.metrics[-1]["async/dropped_samples"]
    if dropped == 0:
        assert got == _prompts_by_step(tmp_path / "whole")


def test_sync_mode_resumes_an_async_checkpoint_without_losing_its_buffered_prompts(tmp_path: Path) -> None:
    common = ["run.save_every=1", "run.keep_checkpoints=0"]
    async_run = trainer(tmp_path / "run", "trainer.mode='colocate_async'", "trainer.max_staleness=1", *common, steps=5)
    _crash_at(async_run, 3)
    resumed = trainer(tmp_path / "run", *common, "run.resume='auto'", steps=4)
    resumed.train()
    assert resumed.resumed_from.name == "step_000002"
    whole = trainer(tmp_path / "whole", *common, steps=4)
    whole.train()
    assert _prompts_by_step(tmp_path / "run") == _prompts_by_step(tmp_path / "whole")


# ------------------------------------------------------------------ the old-log-prob forward
def _ctx(*, epochs: int = 1, mini_batch_size: int = 0, staleness: int = 0, reuse: bool = True) -> StepContext:
    from verl_algorithms.grpo import GRPO

    algorithm = GRPO(GRPO.Config(epochs=epochs, mini_batch_size=mini_batch_size))
    ctx = StepContext(step=1, prompts=[], algorithm=algorithm, actor=None, rollout=None, reward=None, sampling=None,
                      staleness=staleness, reuse_update_log_probs=reuse)
    ctx.batch = [0] * 32  # only its length is read
    return ctx


def test_old_log_probs_are_reused_only_for_one_on_policy_full_batch_update() -> None:
    assert old_log_probs_reusable(_ctx())
    assert old_log_probs_reusable(_ctx(mini_batch_size=32))
    assert not old_log_probs_reusable(_ctx(epochs=2))
    assert not old_log_probs_reusable(_ctx(mini_batch_size=16))
    assert not old_log_probs_reusable(_ctx(staleness=1))
    assert not old_log_probs_reusable(_ctx(reuse=False))


def _flow(**config: Any) -> Any:
    from verl_algorithms.grpo import GRPO

    builder = DataflowBuilder()
    GRPO(GRPO.Config(**config)).build_dataflow(builder)
    return builder.build()


def test_the_dataflow_allows_reuse_only_when_the_update_alone_reads_the_actors_old_log_probs() -> None:
    assert _flow().old_log_probs_only_for_update
    # The engine's log-probs stand in for them: a different policy's numbers, nothing to reuse.
    assert not _flow(use_rollout_log_probs=True).old_log_probs_only_for_update
    # A KL penalty in the rewards reads them before the update runs.
    assert not _flow(kl_coef=0.01, kl_in_reward=True).old_log_probs_only_for_update
    builder = DataflowBuilder()
    builder.rollout()
    builder.actor_log_probs()
    builder.node("custom", lambda ctx: None, reads=("old_log_probs",))
    assert not builder.build().old_log_probs_only_for_update


def test_skipping_the_old_log_prob_forward_leaves_the_losses_unchanged(tmp_path: Path) -> None:
    runs = {}
    for reuse in (True, False):
        t = trainer(tmp_path / str(reuse), steps=2)
        t.setup()
        t.reuse_update_log_probs = reuse
        steps = _Steps(t)
        t.train()
        runs[reuse] = (steps.metrics, weights(t))
    (skipped, w_skipped), (computed, w_computed) = runs[True], runs[False]
    assert [m["actor/old_log_probs_reused"] for m in skipped] == [1.0, 1.0]
    assert [m["actor/old_log_probs_reused"] for m in computed] == [0.0, 0.0]
    for a, b in zip(skipped, computed):
        for key in ("ppo/pg_loss", "ppo/actor_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
        assert a["reward/mean"] == b["reward/mean"]
    for k in w_skipped:
        torch.testing.assert_close(w_skipped[k], w_computed[k], rtol=0, atol=1e-6, msg=k)


def test_the_forward_runs_with_several_epochs_or_mini_batches(tmp_path: Path) -> None:
    for i, extra in enumerate((["algorithm.epochs=2"], ["algorithm.mini_batch_size=16"])):
        t = trainer(tmp_path / str(i), *extra, steps=1)
        steps = _Steps(t)
        t.train()
        assert steps.metrics[0]["actor/old_log_probs_reused"] == 0.0


# ------------------------------------------------------------------ kill -9 at random moments (heavy)
def _cli_run(run_dir: Path, overrides: list[str]) -> list[str]:
    import sys

    return [sys.executable, "-m", "verl_cli", "run", *FAST, "run.resume='auto'", *overrides,
            f"run.output_dir='{run_dir}'"]


def _final_weights(run_dir: Path, _: Any = None) -> dict[str, torch.Tensor]:
    from verl_core.trainer import Trainer

    t = Trainer.from_checkpoint(run_dir, overrides=["run.loggers=[]"])
    t.setup()
    try:
        return weights(t)
    finally:
        t.executor.shutdown()


def _reached(run_dir: Path, step: int, event: str) -> bool:
    """Whether the run in ``run_dir`` got to ``event`` of ``step``: its metrics line written ("logged"), its
    checkpoint being written ("saving": the temporary directory, or already in place) or in place ("saved")."""
    checkpoints = run_dir / "checkpoints"
    if event == "logged":
        metrics = run_dir / "metrics.jsonl"
        for line in metrics.read_text().splitlines() if metrics.is_file() else []:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the line being written
                continue
            if row.get("step") == step and "ppo/actor_loss" in row:
                return True
        return False
    if event == "saving" and any(checkpoints.glob(f".tmp-step_{step:06d}-*")):
        return True
    return (checkpoints / f"step_{step:06d}").is_dir()


@pytest.mark.heavy
@pytest.mark.parametrize("mode", [("trainer.mode='colocate_async'",),
                                  pytest.param(RAY_SPLIT, marks=pytest.mark.long, id="separate_async")])
def test_kill_9_at_random_moments_loses_no_prompt_and_the_run_ends_as_the_uninterrupted_one(
        tmp_path: Path, mode: tuple[str, ...]) -> None:
    """SIGKILL (no handler runs, no checkpoint is written on the way out) at three random moments of an
    async run (colocate_async: its producer process too; separate_async: its Ray workers); each time the
    same command resumes. Every step trains the prompts the uninterrupted run trains at that step, and the
    run ends with its weights, bit for bit."""
    import itertools
    import os
    import random
    import signal
    import subprocess
    import time

    steps = 10
    overrides = [*mode, "trainer.max_staleness=1", "trainer.on_stale='wait'",
                 "run.save_every=1", "run.keep_checkpoints=0", f"run.max_steps={steps}", "run.loggers=['jsonl']"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = tmp_path / "whole"
    subprocess.run(_cli_run(whole, overrides), check=True, env=env, capture_output=True, timeout=600)

    # Each kill waits for a moment the run itself marks, so it lands there on any machine, fast or slow:
    # a step's metrics line (its checkpoint comes next, while the producer generates ahead), its checkpoint
    # being written, or the checkpoint in place (the next step starts); each once, in a random order. The
    # steps are drawn at random, two apart at least and before the last two, so each resumed run gets to
    # its kill before it ends: exactly three kills on any machine.
    rng = random.Random(19)
    plans = [p for p in itertools.combinations(range(2, steps - 1), 3) if p[1] - p[0] >= 2 and p[2] - p[1] >= 2]
    kills = list(zip(rng.choice(plans), rng.sample(("logged", "saving", "saved"), 3)))
    crashed = tmp_path / "crashed"
    for step, event in kills:
        proc = subprocess.Popen(_cli_run(crashed, overrides), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 600  # against a hang, not a measurement
            while not _reached(crashed, step, event):
                assert proc.poll() is None, f"the run ended (exit code {proc.returncode}) before step {step} {event}"
                assert time.monotonic() < deadline, f"no step {step} {event} within 600 s"
                time.sleep(0.01)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=600)
        assert proc.returncode == -signal.SIGKILL, (step, event, proc.returncode)
    done = subprocess.run(_cli_run(crashed, overrides), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (kills, done.stderr[-3000:])
    # Each resume cut metrics.jsonl back to its checkpoint: every step once, as in the uninterrupted run (#31).
    rows = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "ppo/actor_loss" in r] == list(range(1, steps + 1))
    assert _prompts_by_step(crashed) == _prompts_by_step(whole)
    assert sorted(_prompts_by_step(crashed)) == list(range(1, steps + 1))
    expected, got = _final_weights(whole), _final_weights(crashed)
    for k in expected:
        assert torch.equal(got[k], expected[k]), k


@pytest.mark.heavy
def test_separate_async_produces_on_a_ray_rollout_pool_of_its_own(tmp_path: Path) -> None:
    """The producer drives the HF engine on a Ray pool of its own; weights travel through the object store."""
    t = trainer(tmp_path, *RAY_SPLIT, "trainer.max_staleness=1", steps=3)
    steps = _Steps(t)
    t.setup()
    assert t.source.producer.engine is t.rollout and not t.rollout.shares_actor_weights
    t.train()
    assert [m["async/weight_version"] for m in steps.metrics] == [0.0, 0.0, 1.0]
    assert [m["async/staleness"] for m in steps.metrics] == [0.0, 1.0, 1.0]
    assert t.source is None  # closed with the run


@pytest.mark.parametrize(("producer", "producer_threads", "trainer_threads", "child_threads"),
                         [("thread", 0, 2, None), ("thread", 1, 1, None), ("process", 0, 4, 2), ("process", 1, 4, 1)])
def test_producer_threads_sets_each_sides_torch_threads(tmp_path: Path, producer: str, producer_threads: int,
                                                        trainer_threads: int, child_threads: int | None) -> None:
    """``trainer.producer_threads`` (0: half of run.threads): a thread producer shares the trainer's one torch
    pool, so both sides run with it; a process producer has it, and the trainer keeps all of run.threads."""
    before = torch.get_num_threads()
    t = trainer(tmp_path, "trainer.mode='colocate_async'", "run.threads=4", f"trainer.producer='{producer}'",
                f"trainer.producer_threads={producer_threads}")
    try:
        t.setup()
        assert torch.get_num_threads() == trainer_threads
        if child_threads is not None:
            assert t.source.producer.engine.child_info()["torch_threads"] == child_threads
    finally:
        t._close_source()
        t.executor.shutdown()
        torch.set_num_threads(before)


# ------------------------------------------------------------------ the producer in a process of its own
def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_process_producer_trains_exactly_as_the_thread_producer(tmp_path: Path) -> None:
    """Same seeds, one torch thread on each side: the child process generates the batches the thread would
    (from the weights it was sent through shared memory), so the runs end with the same weights, bit for bit."""
    # run.threads=1: the thread producer's trainer gets producer_threads, the process producer's keeps run.threads;
    # thread counts change float sums on some CPUs, so both trainers get one.
    common = ["trainer.mode='colocate_async'", "trainer.max_staleness=1", "trainer.producer_threads=1", "run.threads=1"]
    runs = {}
    for producer in ("thread", "process"):
        t = trainer(tmp_path / producer, *common, f"trainer.producer='{producer}'", steps=4)
        steps = _Steps(t)
        t.setup()
        pid = t.source.producer.engine.pid if producer == "process" else None
        ops: list[str] = []
        if pid is not None:  # which calls reach the child: published versions are adopted, never copied in
            engine = t.source.producer.engine
            call = engine._call
            engine._call = lambda op, *args, **kwargs: (ops.append(op), call(op, *args, **kwargs))[1]
        t.train()
        if pid is not None:
            assert "adopt" in ops and "load" not in ops and "attach" not in ops, ops
        runs[producer] = (weights(t), [m["async/weight_version"] for m in steps.metrics],
                          [m["reward/mean"] for m in steps.metrics])
        if pid is not None:
            assert not _alive(pid), "the rollout process outlived the run"
    (w_thread, v_thread, r_thread), (w_proc, v_proc, r_proc) = runs["thread"], runs["process"]
    assert v_proc == v_thread == [0.0, 0.0, 1.0, 2.0]
    assert r_proc == r_thread
    for k in w_thread:
        assert torch.equal(w_proc[k], w_thread[k]), k


def test_a_rollout_process_that_dies_fails_the_run_with_its_exit_code(tmp_path: Path) -> None:
    import os
    import signal

    t = trainer(tmp_path, "trainer.mode='colocate_async'", steps=4)
    t.setup()
    pid = t.source.producer.engine.pid
    run_step = t.run_step

    def killing() -> dict[str, float]:
        if t.step == 2:
            os.kill(pid, signal.SIGKILL)
        return run_step()

    t.run_step = killing
    with pytest.raises(RuntimeError, match=r"rollout process of HFRollout \(pid \d+\) (died with exit code -9|closed)"):
        t.train()
    assert t.source is None


def test_an_error_in_the_rollout_process_is_raised_here_with_its_traceback(tmp_path: Path) -> None:
    from verl_core.contracts import SamplingParams

    t = trainer(tmp_path, "trainer.mode='colocate_async'", steps=1)
    t.setup()
    try:
        engine = t.source.producer.engine
        with pytest.raises(IndexError) as info:  # a token id past the vocabulary, in the child's embedding
            engine.generate([[10**6]], sampling=SamplingParams(max_new_tokens=2))
        assert "raised in the rollout process of HFRollout" in "\n".join(info.value.__notes__)
        # The child is still serving after an error in one call.
        out = engine.generate([[1, 2, 3]], sampling=SamplingParams(max_new_tokens=2, greedy=True))
        assert len(out.response_ids) == 1
    finally:
        t._close_source()
        t.executor.shutdown()


def test_the_rollout_process_ends_when_its_trainer_is_killed(tmp_path: Path) -> None:
    """kill -9 of the trainer runs no clean-up of ours: the child's watchdog sees its parent gone and exits."""
    import os
    import signal
    import subprocess
    import sys
    import time

    overrides = [*FAST, "run.max_steps=1", f"run.output_dir='{tmp_path}'", "trainer.mode='colocate_async'"]
    script = (
        "import sys, time\n"
        "from verl_core.trainer import Trainer\n"
        f"t = Trainer.from_config(overrides={overrides!r})\n"
        "t.setup()\n"
        "print(t.source.producer.engine.pid, flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        child = int(proc.stdout.readline())
        assert _alive(child)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 20
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the rollout process outlived its killed trainer"
    finally:
        proc.kill()
