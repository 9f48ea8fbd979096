"""verl: reinforcement-learning post-training for language models.

This package re-exports the public Python API of ``verl-core`` (see :mod:`verl_core`) and the reward
decorators of ``verl-rewards`` (``per_sample``, ``batch_reward``), which ``pip install verl`` installs.
"""

__version__ = "0.1.0"

import verl_core as _core

#: Names from the default plugins, by the module that provides them (loaded on first use).
_PLUGIN_EXPORTS = {
    "per_sample": "verl_rewards",
    "batch_reward": "verl_rewards",
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
