"""``trainer.mode = "sync"``: generate, then train, every step (the default step source).

The step's rollout stage generates from the prompts drawn here; after the update the run's engine gets
the new weights, so the next step samples from the policy it trains.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from verl_core.contracts.step_source import SourcedStep, StepSource
from verl_core.contracts import ConfigError
from verl_core.rollout_utils import sync_rollout_weights

__all__ = ["SyncConfig", "SyncSource"]


@dataclass
class SyncConfig:
    """The sync mode has no settings of its own. The overlapping modes' keys are accepted at their default
    values only, so that a ``config.toml`` written before they moved to verl-trainer-async (every run's
    records them) still loads; any other value names the modes that read it."""

    max_staleness: int = 1
    on_stale: str = "wait"
    producer: str = "process"
    producer_threads: int = 0

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) != f.default:
                raise ConfigError(f.name, "applies to the overlapping modes only; set trainer.mode to "
                                          "'colocate_async' or 'separate_async' (verl-trainer-async), or leave "
                                          "it out")


class SyncSource(StepSource):
    """Prompts from the trainer's sampler; the engine synced after each update."""

    Config = SyncConfig

    def next(self, step: int) -> SourcedStep:
        return SourcedStep(prompts=self.trainer.draw_prompts())

    def after_update(self, step: int) -> None:
        sync_rollout_weights(self.trainer.rollout, self.trainer.actor)
