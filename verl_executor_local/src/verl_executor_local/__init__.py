"""verl's in-process executor, ``executor.name = "local"`` (the default): every worker group is one worker in the
controller's process."""

from __future__ import annotations

import os
from typing import Any, Callable

from verl_core.contracts import ConfigError, Executor, ExecutorConfig, Role, WorkerGroup, WorldInfo, dispatch_mode

__all__ = ["LocalExecutor", "LocalWorkerGroup"]

__version__ = "0.1.0"


class LocalWorkerGroup(WorkerGroup):
    """A group of one worker; calls go straight to it."""

    def __init__(self, role: Role, worker: Any) -> None:
        self.role = role
        self.world_size = 1
        self.worker = worker

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        # Direct attribute access keeps context managers and generators working unchanged; an "all"
        # call returns every rank's result, as on any executor: a list of one here.
        attr = getattr(self.worker, method)
        if callable(attr) and dispatch_mode(type(self.worker), method) == "all":
            return lambda *args, **kwargs: [attr(*args, **kwargs)]
        return attr


class LocalExecutor(Executor):
    """Runs single-process jobs; the default. Multi-process runs need another executor."""

    def __init__(self, config: ExecutorConfig) -> None:
        super().__init__(config)
        if config.world_size != 1:
            raise ValueError(f"world_size: the local executor runs one process, got world_size="
                             f"{config.world_size}; use a multi-process executor (e.g. executor.name='ray')")
        import torch

        config.validate()
        # "auto" trains on the GPU where there is one, as the multi-process executors do, never silently on the CPU.
        self.device = "cuda" if config.device != "cpu" and torch.cuda.is_available() else "cpu"
        launched = os.environ.get("WORLD_SIZE", "1")
        if os.environ.get("TORCHELASTIC_RUN_ID") and launched.isdigit() and int(launched) > 1:
            raise ConfigError("executor.name", f"this process is one of {launched} that torchrun started, and the "
                                               f"local executor would train {launched} separate copies of the run; "
                                               f"use executor.name='torchrun' (pip install verl-executor-torchrun) "
                                               f"for one run over all of them")

    def create_group(self, *, role: Role, factory: Callable[[WorldInfo], Any]) -> WorkerGroup:
        import torch

        # One process: the worker gets the threads the controller chose unless told otherwise.
        threads = self.config.threads_per_worker or torch.get_num_threads()
        return LocalWorkerGroup(role, factory(WorldInfo(rank=0, world_size=1, device=self.device,
                                                              threads=threads)))
