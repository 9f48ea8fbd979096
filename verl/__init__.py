"""verl: reinforcement-learning post-training for language models.

This package re-exports the public Python API of ``verl-core`` (see :mod:`verl_core`), the reward
decorators of ``verl-rewards`` (``per_sample``, ``batch_reward``), which ``pip install verl`` installs,
and adds ``PPOTrainer``, ``GRPOTrainer`` and ``DataConfig`` (:mod:`verl.trainers`), a thin layer over
:class:`~verl_core.trainer.Trainer` in the shape many articles show.
"""

__version__ = "0.1.0"

import verl_core as _core

#: Names from the default plugins and from this package, by the module that provides them (loaded on first use).
_PLUGIN_EXPORTS = {
    "per_sample": "verl_rewards",
    "batch_reward": "verl_rewards",
    "PPOTrainer": "verl.trainers",
    "GRPOTrainer": "verl.trainers",
    "DataConfig": "verl.trainers",
}

__all__ = [*(name for name in _core.__all__ if name != "__version__"), *_PLUGIN_EXPORTS]


def __getattr__(name: str):
    module = _PLUGIN_EXPORTS.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    if name in __all__:
        return getattr(_core, name)
    raise AttributeError(f"module 'verl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
