"""The plugin contracts, one module per kind (issue #29 moves the rest of :mod:`verl_core.interfaces` here)."""

from verl_core.contracts.step_source import SourcedStep, StepSource, StepSourceConfig

__all__ = ["SourcedStep", "StepSource", "StepSourceConfig"]
