"""``trainer.mode = "partial"`` (issue 33, part 3): bad settings refused before any model loads, unfinished samples
carried across steps with their tokens, log-probs and weight versions, every prompt group trained once and whole,
and an exact resume after kill -9 with samples in flight.

Small but real: the default tiny task (responses of at most 4 tokens), model, backend, HF rollout and GRPO, with a
budget of 1 token per round so that most samples span several rounds and steps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from verl_core.config import ConfigError

FAST = ["data.batch_size=8", "rollout.n=4", "run.val_every=0", "run.val_before_train=false", "run.threads=2",
        "reward.isolation=\"none\"", "run.loggers=[]", "run.resume='never'"]
PARTIAL = ["trainer.mode='partial'", "trainer.token_budget=1"]


def trainer(tmp: Path, *overrides: str, steps: int = 3) -> Any:
    from verl_core.trainer import Trainer

    return Trainer.from_config(overrides=[*FAST, f"run.max_steps={steps}", f"run.output_dir='{tmp}'", *overrides])


# ------------------------------------------------------------------ bad input, before any model loads
def test_a_budget_under_one_token_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.token_budget: must be at least 1 token") as info:
        trainer(tmp_path, "trainer.mode='partial'", "trainer.token_budget=0")
    assert info.value.path == "trainer.token_budget"


@pytest.mark.parametrize("algorithm, match", [("gpg", "algorithm 'gpg' cannot.*off_policy is false"),
                                              ("dpo", "generates nothing")])
def test_partial_refuses_an_algorithm_it_cannot_run_before_any_model_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str, match: str) -> None:
    from verl_core.trainer import Trainer

    def no_workers(self: Any, resume: str) -> None:
        raise AssertionError("workers started before the trainer mode was checked")

    monkeypatch.setattr(Trainer, "_start_workers", no_workers)
    t = trainer(tmp_path, *PARTIAL, f"algorithm.name='{algorithm}'")
    with pytest.raises(ConfigError, match=match) as info:
        t.setup()
    assert info.value.path == "trainer.mode"


def test_carried_samples_are_importance_weighted_unless_told_otherwise(tmp_path: Path) -> None:
    assert trainer(tmp_path, *PARTIAL).config.algorithm.config.rollout_is_cap == 2.0
    assert trainer(tmp_path, *PARTIAL, "algorithm.rollout_is_cap=0").config.algorithm.config.rollout_is_cap == 0.0
    # The engine's log-probs as the old ones: the PPO ratio is against the behaviour policy itself, nothing to weigh.
    assert trainer(tmp_path, *PARTIAL, "algorithm.old_log_probs='rollout'").config.algorithm.config.rollout_is_cap == 0.0


# ------------------------------------------------------------------ carrying samples over
def test_unfinished_samples_carry_their_tokens_log_probs_and_versions_into_later_steps(tmp_path: Path) -> None:
    t = trainer(tmp_path, *PARTIAL, steps=4)
    t.setup()
    max_new = t.config.rollout.config.max_new_tokens
    seen: list[tuple[Any, Any]] = []
    take = t.source.next

    def recorded(step: int) -> Any:
        sourced = take(step)
        seen.append((sourced, sourced.produced))
        return sourced

    t.source.next = recorded
    metrics: list[dict[str, float]] = []
    run_step = t.run_step
    t.run_step = lambda: metrics.append(run_step()) or metrics[-1]
    t.train()

    trained: list[int] = []
    for step, ((sourced, batch), m) in enumerate(zip(seen, metrics), start=1):
        # Whole groups only: the step's prompts, n samples each, each ended by a stop token or at its limit.
        assert len(sourced.prompts) == 8 and len(batch) == 32
        assert sorted(batch.group_ids.tolist()) == [g for g in range(8) for _ in range(4)]
        lengths = batch.response_attention_mask.sum(-1).tolist()
        eos = t.tokenizer.eos_token_id
        for i, (reason, length) in enumerate(zip(batch.finish_reasons, lengths)):
            last = int(batch.response_ids[i, length - 1])
            assert (reason == "stop" and last == eos) or (reason == "length" and length == max_new), (reason, length)
        # The engine's log-prob of every response token, whichever weights sampled it.
        lp = batch.rollout_log_probs * batch.response_attention_mask
        assert bool((lp[batch.response_attention_mask.bool()] < 0).all())
        # Each sample's version is its oldest token's; the step's staleness the oldest of them.
        versions = batch.meta["weight_version"]
        assert all(0 <= v <= step - 1 for v in versions)
        assert sourced.staleness == step - 1 - min(versions) == m["partial/staleness"]
        trained += sourced.indices
    # With one token per round, responses of up to 4 tokens span steps: stale tokens, weighed, old log-probs recomputed.
    assert max(m["partial/staleness"] for m in metrics) >= 1
    assert any(m["partial/stale_token_frac"] > 0 for m in metrics)
    stale = [m for m in metrics if m["partial/staleness"] > 0]
    assert all(m["actor/old_log_probs_reused"] == 0.0 and "ppo/rollout_is_weight_mean" in m for m in stale)
    assert len(trained) == len(set(trained)) == 4 * 8  # no prompt twice


def test_a_budget_that_covers_the_response_limit_carries_nothing(tmp_path: Path) -> None:
    """At token_budget >= rollout.max_new_tokens every sample ends in its first round: one round a step, nothing
    carried, nothing stale, and the sync run's prompts."""
    metrics: dict[str, list[dict[str, float]]] = {}
    prompts: dict[str, list[list[int]]] = {}
    for mode in ("sync", "partial"):
        budget = ["trainer.token_budget=4"] if mode == "partial" else []
        t = trainer(tmp_path / mode, f"trainer.mode='{mode}'", *budget, steps=2)
        t.setup()
        metrics[mode], prompts[mode] = [], []
        run_step = t.run_step

        def recorded(t: Any = t, run_step: Any = run_step, mode: str = mode) -> dict[str, float]:
            metrics[mode].append(run_step())
            prompts[mode].append(list(t._drawn))
            return metrics[mode][-1]

        t.run_step = recorded
        t.train()
    assert prompts["partial"] == prompts["sync"]
    assert [m["partial/carried_samples"] for m in metrics["partial"]] == [0.0, 0.0]
    assert [m["partial/rounds"] for m in metrics["partial"]] == [1.0, 1.0]
    assert [m["partial/staleness"] for m in metrics["partial"]] == [0.0, 0.0]


@pytest.mark.parametrize("algorithm", ["dapo", "remax"])
def test_the_rollout_stage_filters_and_baselines_the_finished_groups(tmp_path: Path, algorithm: str) -> None:
    """The core's rollout stage runs on the finished groups as on generated ones: DAPO's filter keeps groups with a
    reward spread and draws more prompts for the rest (generated whole, on the current weights), ReMax's greedy
    baseline decodes on the engine; every prompt trains once."""
    t = trainer(tmp_path, *PARTIAL, f"algorithm.name='{algorithm}'", steps=3)
    trained: list[int] = []
    run_step = t.run_step

    def recorded() -> dict[str, float]:
        m = run_step()
        trained.extend(t._drawn)
        return m

    t.run_step = recorded
    t.train()
    assert t.step == 3 and len(trained) == len(set(trained))


# ------------------------------------------------------------------ kill -9 with samples in flight
def _cli_run(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "verl_cli", "run", *FAST, "run.resume='auto'", *overrides,
            f"run.output_dir='{run_dir}'"]


def _states(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {int(p.name.split("_")[1]): json.loads((p / "trainer_state.json").read_text())
            for p in sorted((run_dir / "checkpoints").glob("step_*"))}


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from verl_core.trainer import Trainer

    t = Trainer.from_checkpoint(run_dir, overrides=["run.loggers=[]"])
    t.setup()
    try:
        return {k: v.clone() for k, v in t.actor.iter_weights()}
    finally:
        t.executor.shutdown()


@pytest.mark.slow
def test_kill_9_with_samples_in_flight_resumes_exactly(tmp_path: Path) -> None:
    """SIGKILL right after a checkpoint whose pool carries unfinished samples; the same command resumes. Every
    step trains the prompts the uninterrupted run trains at that step, and the run ends with its weights, bit for
    bit: the carried samples were written into the checkpoint and resumed from it, none trained twice or lost."""
    steps = 5
    overrides = [*PARTIAL, "run.save_every=1", "run.keep_checkpoints=0", f"run.max_steps={steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    whole = tmp_path / "whole"
    subprocess.run(_cli_run(whole, overrides), check=True, env=env, capture_output=True, timeout=600)
    in_flight = [s for s, state in _states(whole).items() if state["partial"]["carried_samples"] and s < steps]
    assert in_flight, "no checkpoint of the uninterrupted run holds unfinished samples"
    kill_after = in_flight[0]

    crashed = tmp_path / "crashed"
    proc = subprocess.Popen(_cli_run(crashed, overrides), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600  # against a hang, not a measurement
        while not (crashed / "checkpoints" / f"step_{kill_after:06d}").is_dir():
            assert proc.poll() is None, f"the run ended (exit code {proc.returncode}) before step {kill_after}"
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    saved = json.loads((crashed / "checkpoints" / f"step_{kill_after:06d}" / "partial_rollouts.json").read_text())
    assert any(s["tokens"] and s["finish"] is None for g in saved["groups"] for s in g["samples"])
    done = subprocess.run(_cli_run(crashed, overrides), env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    expected, got = _states(whole), _states(crashed)
    assert sorted(got) == list(range(1, steps + 1))
    assert [got[s]["prompts"] for s in got] == [expected[s]["prompts"] for s in expected]
    assert [got[s]["partial"] for s in got] == [expected[s]["partial"] for s in expected]
    trained = [i for s in got for i in got[s]["prompts"]]
    assert len(trained) == len(set(trained))
    want, have = _final_weights(whole), _final_weights(crashed)
    for k in want:
        assert torch.equal(have[k], want[k]), k
