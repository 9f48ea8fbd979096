"""The plugin contracts, one module per plugin kind. Plugins import them from here::

    from verl_core.contracts import Algorithm, RolloutEngine, TrainingWorker

Each extension kind has one uniform interface with keyword-only arguments over the typed
:class:`~verl_core.batch.Batch`: training backends (worker roles), rollout engines, algorithms, rewards,
environments, executors, step sources, config formats, data readers and run stores. The controller talks to plugins
only through these, so it never needs to know which plugin it drives. The conformance suites in
:mod:`verl_core.testing` check an implementation against them.
"""

from verl_core.contracts.common import Role, ModelSpec, WorldInfo, ConfigError, dispatch, dispatch_mode
from verl_core.contracts.backend import LogProbs, LossFn, AlgorithmLoss, BackendConfig, LoRAAdapter, TrainingWorker, TrainingBackend
from verl_core.contracts.rollout import SamplingParams, PromptIds, RolloutOutput, RolloutConfig, RolloutEngine, ServerError
from verl_core.contracts.algorithm import AlgorithmConfig, Requirements, RolloutRequest, Algorithm
from verl_core.contracts.reward import RewardInput, RewardFunction, RewardError, ScorerConfig, RewardScorer
from verl_core.contracts.environment import ENV_REWARDS, StepResult, EnvironmentConfig, Environment
from verl_core.contracts.executor import ExecutorConfig, WorkerFailedError, WorkerGroup, Executor
from verl_core.contracts.providers import ModelProvider, DatasetProvider
from verl_core.contracts.config_format import ConfigFormat
from verl_core.contracts.step_source import SourcedStep, StepSource, StepSourceConfig
from verl_core.contracts.data import DataError, DataReader
from verl_core.contracts.run_store import RunStore, CheckpointError, CheckpointWriteError, CorruptCheckpointError

__all__ = [
    "Role",
    "ModelSpec",
    "WorldInfo",
    "ConfigError",
    "dispatch",
    "dispatch_mode",
    "LogProbs",
    "LossFn",
    "AlgorithmLoss",
    "BackendConfig",
    "LoRAAdapter",
    "TrainingWorker",
    "TrainingBackend",
    "SamplingParams",
    "PromptIds",
    "RolloutOutput",
    "RolloutConfig",
    "RolloutEngine",
    "ServerError",
    "AlgorithmConfig",
    "Requirements",
    "RolloutRequest",
    "Algorithm",
    "RewardInput",
    "RewardFunction",
    "RewardError",
    "ScorerConfig",
    "RewardScorer",
    "ENV_REWARDS",
    "StepResult",
    "EnvironmentConfig",
    "Environment",
    "ExecutorConfig",
    "WorkerFailedError",
    "WorkerGroup",
    "Executor",
    "ModelProvider",
    "DatasetProvider",
    "ConfigFormat",
    "SourcedStep",
    "StepSource",
    "StepSourceConfig",
    "DataError",
    "DataReader",
    "RunStore",
    "CheckpointError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
]
