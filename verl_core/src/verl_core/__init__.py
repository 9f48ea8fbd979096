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
    "Algorithm": "verl_core.contracts",
    "AlgorithmConfig": "verl_core.contracts",
    "Requirements": "verl_core.contracts",
    "RolloutRequest": "verl_core.contracts",
    "TrainingBackend": "verl_core.contracts",
    "TrainingWorker": "verl_core.contracts",
    "BackendConfig": "verl_core.contracts",
    "RolloutEngine": "verl_core.contracts",
    "RolloutConfig": "verl_core.contracts",
    "RolloutOutput": "verl_core.contracts",
    "SamplingParams": "verl_core.contracts",
    "RewardFunction": "verl_core.contracts",
    "RewardInput": "verl_core.contracts",
    "RewardScorer": "verl_core.contracts",
    "Environment": "verl_core.contracts",
    "StepResult": "verl_core.contracts",
    "Executor": "verl_core.contracts",
    "WorkerGroup": "verl_core.contracts",
    "Role": "verl_core.contracts",
    "ModelSpec": "verl_core.contracts",
    "WorldInfo": "verl_core.contracts",
    "LogProbs": "verl_core.contracts",
    "dispatch": "verl_core.contracts",
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
