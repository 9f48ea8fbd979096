"""torchrun executor for verl: one run over the processes ``torchrun`` started, the controller on rank 0.

Selected with ``executor.name = "torchrun"`` (``verl run --executor torchrun``; the ``PPOTrainer``
and ``GRPOTrainer`` of ``verl`` pick it by themselves under torchrun). ``torch.distributed`` is
set up only when the trainer builds the executor.
"""

__version__ = "0.1.0"

__all__ = ["TorchrunExecutor", "TorchrunExecutorConfig", "TorchrunWorkerGroup", "torchrun_world"]


def __getattr__(name: str):
    if name in __all__:
        from verl_executor_torchrun import executor

        return getattr(executor, name)
    raise AttributeError(name)
