"""The ``health`` hook plugin (``verl.hooks``, on whenever verl-loggers is installed; ``run.disable_hooks =
["health"]`` leaves it out): the problems a user would want to hear about while a run trains.

:class:`HealthMonitor` reads the metrics the run emits and returns the checks that fail; :class:`HealthChecks`
hands them to the ``verl_health`` hook (the console prints them, the ``jsonl`` logger records them in
``<run_dir>/health.jsonl``, ``verl dashboard`` shows them). Each check speaks once when it starts
failing and again only after it has recovered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from verl_core.kit import hookimpl, run_guard_limit

__all__ = ["HealthChecks", "HealthMonitor", "flat_group_fraction"]


def flat_group_fraction(batch: Any) -> float | None:
    """The share of the batch's groups whose samples all got the same reward (no learning signal for
    group-relative advantages); ``None`` without scores."""
    if batch.scores is None or not len(batch):
        return None
    flat = total = 0
    for g in torch.unique(batch.group_ids):
        scores = batch.scores[batch.group_ids == g]
        total += 1
        flat += int(bool((scores == scores[0]).all()))
    return flat / total


class HealthChecks:
    """The run's health checks as a hook plugin: ``reward/flat_group_frac`` measured on each step's batch,
    every metric the run emits observed (``run.health_flat_steps``, ``run.health_max_kl``, the weight-sync
    guard's limit), and each check that starts failing reported to ``verl_health``."""

    def __init__(self) -> None:
        self._hooks: Any = None
        self.monitor: HealthMonitor | None = None

    @hookimpl
    def verl_run_start(self, config: Any, run_dir: Path, hooks: Any) -> None:
        self._hooks, self.monitor = hooks, HealthMonitor(config.run, run_guard_limit(config))

    @hookimpl
    def verl_step_batch(self, step: int, batch: Any) -> dict[str, float] | None:
        flat = flat_group_fraction(batch)
        return None if flat is None else {"reward/flat_group_frac": flat}  # groups whose samples all scored alike

    @hookimpl(trylast=True)  # after the sinks have the metrics, as a warning about them
    def verl_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.monitor is not None:
            for check, message in self.monitor.observe(step, metrics):
                self._hooks.verl_health(step=step, check=check, message=message)


class HealthMonitor:
    """Watches metrics for: no learning signal, every response truncated, KL too high, no validation
    data, and the rollout engine's log-probs drifting from the trainer's (a weight-sync gap).

    Args:
        run: the run's :class:`~verl_core.config.RunConfig` (``health_flat_steps``, ``health_max_kl``).
        max_log_prob_gap: the weight-sync guard's limit (``rollout.max_log_prob_gap`` as resolved; 0: off).
    """

    def __init__(self, run: Any, max_log_prob_gap: float = 0.0) -> None:
        self.flat_steps = run.health_flat_steps
        self.max_kl = run.health_max_kl
        self.validates = bool(run.val_every or run.val_before_train)
        self.max_gap = max_log_prob_gap or 0.0
        self._flat_run = 0
        self._failing: set[str] = set()

    def observe(self, step: int, metrics: dict[str, float]) -> list[tuple[str, str]]:
        """The ``(check, message)`` pairs that start failing with these metrics."""
        failing: dict[str, str] = {}
        if "data/val_prompts" in metrics and not metrics["data/val_prompts"] and self.validates:
            failing["no_validation"] = ("validation skipped: there are no validation prompts (set data.val to a "
                                        "validation file, or to a dataset with data.val_split naming its split)")
        flat = metrics.get("reward/flat_group_frac")
        if flat is not None:
            self._flat_run = self._flat_run + 1 if flat >= 1.0 else 0
            if self.flat_steps and self._flat_run >= self.flat_steps:
                failing["flat_rewards"] = (f"every group's samples got the same reward for {self._flat_run} steps: "
                                           f"group-relative advantages are all zero, nothing is learned (the task "
                                           f"is too hard or too easy for the model; raise rollout.n or "
                                           f"rollout.temperature, or check the reward)")
        if metrics.get("response_length/clip_frac", 0.0) >= 1.0:
            failing["all_truncated"] = ("every response hit the length limit (response_length/clip_frac = 1): raise "
                                        "rollout.max_new_tokens (with an environment, environment.max_response_tokens), "
                                        "or reward stopping (the answers are cut off)")
        invalid = metrics.get("reward/invalid_rows")
        if invalid:
            failing["invalid_rewards"] = (f"{invalid:g} rows had a NaN or infinite reward and were dropped "
                                          f"(reward.on_invalid = \"skip\"): a reward or environment plugin is broken")
        for key in ("ppo/kl_divergence", "actor/ref_kl"):
            value = metrics.get(key)
            if self.max_kl and value is not None and value > self.max_kl:
                failing["kl"] = (f"{key} = {value:.3g} is above run.health_max_kl={self.max_kl:g}: the policy is "
                                 f"moving far from its reference (lower backend.lr, or raise algorithm.kl_coef)")
                break
        gap = metrics.get("rollout/log_prob_diff_mean")
        if self.max_gap and gap is not None and gap > self.max_gap:
            failing["weight_sync_gap"] = (f"the rollout engine's log-probs differ from the trainer's by {gap:.3g} per "
                                          f"token (rollout.max_log_prob_gap={self.max_gap:g}): the engine may be "
                                          f"sampling from stale weights")
        # A check that is not measured at this step (no KL metric, say) keeps its state.
        measured = {"flat_rewards": flat is not None,
                    "all_truncated": "response_length/clip_frac" in metrics,
                    "kl": any(k in metrics for k in ("ppo/kl_divergence", "actor/ref_kl")),
                    "weight_sync_gap": gap is not None, "no_validation": "data/val_prompts" in metrics,
                    "invalid_rewards": invalid is not None}
        for check, seen in measured.items():
            if seen and check not in failing:
                self._failing.discard(check)
        new = [(check, message) for check, message in failing.items() if check not in self._failing]
        self._failing.update(failing)
        return new
