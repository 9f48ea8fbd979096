"""The core's helpers plugins may use, in one public module (the rest of the core may change under them).

Loaded lazily, name by name, so ``from verl_core.kit import DataError`` costs no torch::

    from verl_core.kit import left_pad, sync_rollout_weights  # a rollout engine
    from verl_core.kit import check_step_result, Boundary     # an environment kit

The helpers the core itself does not use (sharding and dispatch, the backends' micro-batching, engine helpers,
built-in models, the model side of vision) are the ``verl-kit`` library's: ``from verl_kit.sharding import
split_call``.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> (core module, attribute).
_EXPORTS: dict[str, tuple[str, str]] = {
    **{n: ("verl_core.boundary", n) for n in ("Boundary", "check_messages", "check_step_result")},
    **{n: ("verl_core.contracts", n) for n in ("CheckpointError", "DataError")},
    **{n: ("verl_core.dataflow", n) for n in ("BATCH", "EXTRAS_PREFIX", "DataflowBuilder")},
    **{n: ("verl_core.hooks", n) for n in ("hookimpl", "sample_records", "SAMPLE_FIELDS")},
    "BASELINE": ("verl_core.rollout_stage", "BASELINE"),
    "run_rollout_stage": ("verl_core.rollout_stage", "run"),
    "produce_rollout": ("verl_core.rollout_stage", "produce"),
    **{n: ("verl_core.rollout_utils", n) for n in ("sync_rollout_weights", "WeightSyncError", "left_pad", "right_pad",
                                                   "build_batch", "run_guard_limit", "generate_batch",
                                                   "check_log_prob_gap")},
    **{n: ("verl_core.assembly", n) for n in ("OBJECT_PREFIX",)},
}

__all__ = sorted(_EXPORTS)

#: Names that left the kit with what they belong to: where they are now.
_MOVED = {n: ("verl-run-store", "verl_run_store") for n in ("CheckpointManager", "pid_alive", "copied_keys")}


def __getattr__(name: str) -> Any:
    if name in _MOVED:  # an ImportError, so that `from verl_core.kit import ...` shows this message
        raise ImportError(f"verl_core.kit.{name} moved out of the core to {_MOVED[name][0]}: "
                          f"from {_MOVED[name][1]} import {name}")
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'verl_core.kit' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # next time without this function
    return value


def __dir__() -> list[str]:
    return __all__
