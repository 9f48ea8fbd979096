"""verl core: plugin registry, interfaces and the single-controller dataflow.

The public API is re-exported here and loaded lazily, so ``import verl_core`` (and the CLI's
``verl plugins list``) does not pull in torch until something that needs it is used.
"""

from verl_core._version import __version__

_EXPORTS = {
    # registry
    "PluginRegistry": "verl_core.registry",
    "PluginInfo": "verl_core.registry",
    "PluginError": "verl_core.registry",
    "UnknownPluginError": "verl_core.registry",
    "PLUGIN_API_VERSION": "verl_core.registry",
    # hooks
    "hookimpl": "verl_core.hooks",
    "hookspec": "verl_core.hooks",
    # data types and interfaces
    "Batch": "verl_core.batch",
    "Algorithm": "verl_core.interfaces",
    "AlgorithmConfig": "verl_core.interfaces",
    "Requirements": "verl_core.interfaces",
    "RolloutRequest": "verl_core.interfaces",
    "TrainingBackend": "verl_core.interfaces",
    "TrainingWorker": "verl_core.interfaces",
    "BackendConfig": "verl_core.interfaces",
    "RolloutEngine": "verl_core.interfaces",
    "RolloutConfig": "verl_core.interfaces",
    "RolloutOutput": "verl_core.interfaces",
    "SamplingParams": "verl_core.interfaces",
    "RewardFunction": "verl_core.interfaces",
    "RewardInput": "verl_core.interfaces",
    "RewardScorer": "verl_core.interfaces",
    "Environment": "verl_core.interfaces",
    "StepResult": "verl_core.interfaces",
    "Executor": "verl_core.interfaces",
    "WorkerGroup": "verl_core.interfaces",
    "Role": "verl_core.interfaces",
    "ModelSpec": "verl_core.interfaces",
    "WorldInfo": "verl_core.interfaces",
    "LogProbs": "verl_core.interfaces",
    "dispatch": "verl_core.interfaces",
    # dataflow and controller
    "DataflowBuilder": "verl_core.dataflow",
    "Dataflow": "verl_core.dataflow",
    "StepContext": "verl_core.dataflow",
    "Trainer": "verl_core.trainer",
    "Config": "verl_core.config",
    "ConfigError": "verl_core.config",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'verl_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
