"""verl: reinforcement-learning post-training for language models.

This package re-exports the public Python API of ``verl-core``; see :mod:`verl_core`.
"""

__version__ = "0.1.0"

import verl_core as _core

__all__ = [name for name in _core.__all__ if name != "__version__"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(_core, name)
    raise AttributeError(f"module 'verl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
