"""Executors: where worker groups run and how a call reaches their ranks."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence

# Annotations only: importing the contracts loads no torch (reward worker processes read RewardInput).
if TYPE_CHECKING:
    from verl_core.contracts.common import ModelSpec, Role, WorldInfo
    from verl_core.contracts.rollout import RolloutConfig, RolloutEngine

__all__ = ["ExecutorConfig", "WorkerFailedError", "WorkerGroup", "Executor"]


@dataclass
class ExecutorConfig:
    """Settings every executor understands.

    Attributes:
        world_size: training processes (data-parallel ranks) per worker group.
        threads_per_worker: torch threads per worker; 0 picks cores // workers.
        device: ``"auto"`` (CUDA where torch sees a device, else the CPU), ``"cpu"`` or ``"cuda"``.
    """

    world_size: int = 1
    threads_per_worker: int = 0
    device: str = "auto"

    def validate(self) -> None:
        import torch

        if self.device not in ("auto", "cpu", "cuda") or (self.device == "cuda" and not torch.cuda.is_available()):
            raise ValueError(f"device: must be 'auto', 'cpu' or 'cuda' (with a CUDA device torch can use), got "
                             f"{self.device!r}")


class WorkerFailedError(RuntimeError):
    """A worker process died (killed, out of memory, crashed), so the run cannot go on.

    Attributes:
        role: the role the failed call was made on (``"actor"``, ``"rollout"``, ...).
        rank: the worker's rank in its group.
        cause: what the executor knows about why it died.
    """

    def __init__(self, message: str, *, role: str, rank: int, cause: str) -> None:
        super().__init__(message)
        self.role = role
        self.rank = rank
        self.cause = cause


class WorkerGroup(abc.ABC):
    """Workers of one role running SPMD; method calls dispatch per :func:`dispatch`."""

    role: Role
    world_size: int

    @abc.abstractmethod
    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the workers as its dispatch mode declares."""

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self.call(method, *args, **kwargs)


class Executor(abc.ABC):
    """Places worker groups on processes and runs independent dataflow nodes."""

    Config: ClassVar[type[ExecutorConfig]] = ExecutorConfig

    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.plugins: tuple[tuple[str, str], ...] = ()

    def use_plugins(self, plugins: Sequence[tuple[str, str]]) -> None:
        """Name the ``(kind, name)`` plugins the run selected, before any group starts.

        Multi-process executors resolve them through the plugin registry in every worker process,
        so a plugin that cannot be found there fails at start-up with its name, not mid-run when a
        pickled object cannot be imported. An in-process executor has nothing to do.
        """
        self.plugins = tuple(plugins)

    @abc.abstractmethod
    def create_group(self, *, role: Role, factory: Callable[[WorldInfo], Any]) -> WorkerGroup:
        """Start a worker group; ``factory(world)`` builds the worker on each rank."""

    def create_rollout(self, *, engine: type[RolloutEngine], config: RolloutConfig, model: ModelSpec,
                       tokenizer: Any, actor: WorkerGroup) -> RolloutEngine:
        """Start the rollout engine that samples from ``actor``'s policy.

        The default builds the engine in this process on the actor group, which is what an
        in-process executor needs (an engine that shares the actor's weights reaches its module
        directly). A multi-process executor places the engine where its configuration says: inside
        the actor's worker processes (colocated: the engine gets the local actor worker) or on
        processes of its own (split: weights are sent over), and returns a stand-in that
        dispatches ``generate`` and ``load_weights`` to them.
        """
        return engine(config=config, model=model, tokenizer=tokenizer, actor=actor)

    @classmethod
    def is_controller(cls, config: ExecutorConfig) -> bool:
        """Whether this process drives the run: holds its directory's lock and writes it. A launcher
        that starts the same script on every rank (torchrun) answers False on the ranks that only serve
        the controller's calls; the default, one controller that starts its workers, True."""
        return True

    def run_parallel(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run independent tasks; the default runs them one after the other."""
        return [task() for task in tasks]

    def shutdown(self) -> None:
        """Stop all workers."""
