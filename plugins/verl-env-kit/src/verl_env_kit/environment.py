"""The base class of environments run by the kit's multi-turn loop."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from verl_core.contracts import Environment

if TYPE_CHECKING:
    from verl_core.batch import Batch
    from verl_core.contracts import EnvironmentConfig, RolloutEngine, SamplingParams

__all__ = ["MultiTurnEnvironment"]


class MultiTurnEnvironment(Environment):
    """An :class:`~verl_core.contracts.Environment` whose episodes run in the kit's multi-turn loop
    (:func:`verl_env_kit.episodes.run_episodes`): subclass it and write ``reset``/``step`` (and
    ``tools``/``close`` where needed), as for the core's contract."""

    @classmethod
    def run_episodes(cls, engine: RolloutEngine, prompts: Sequence[dict[str, Any]], sampling: SamplingParams,
                     make_env: Callable[[], Environment], config: EnvironmentConfig, *, pad_id: int,
                     metrics: dict[str, float] | None = None, boundary: Any = None, step: int = 0) -> Batch:
        """The multi-turn loop of :mod:`verl_env_kit.episodes` (see
        :meth:`verl_core.contracts.Environment.run_episodes`)."""
        from verl_env_kit.episodes import run_episodes  # torch and the batch, only once episodes run

        return run_episodes(engine, prompts, sampling, make_env, config, pad_id=pad_id, metrics=metrics,
                            boundary=boundary, step=step)
