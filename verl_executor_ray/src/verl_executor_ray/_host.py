"""The process side: one :class:`WorkerHost` Ray actor per process of a resource pool.

A host holds every role worker placed on its pool (colocated roles share the process and its
``torch.distributed`` group) and, when the rollout is placed on the pool, the rollout engine, built
here with the local actor worker so an engine that shares the actor's weights reaches them
in-process. The controller reaches the host only through Ray; everything that crosses the
boundary is pickled, so generators are drained into lists here and context managers are refused.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
import time
from typing import Any, Callable

__all__ = ["WorkerHost"]


class WorkerHost:
    """One process of a pool.

    Args:
        pool: the pool's name.
        rank: this process's rank in the pool (its data-parallel rank).
        world_size: processes in the pool.
        local_rank: rank among the pool's processes on this node.
        device: ``"cpu"`` or ``"cuda"`` (Ray has already narrowed ``CUDA_VISIBLE_DEVICES``).
        threads: torch threads for this process (its share of the pool's CPUs).
    """

    def __init__(self, *, pool: str, rank: int, world_size: int, local_rank: int, device: str, threads: int) -> None:
        import torch

        from verl_core.contracts import WorldInfo

        # OMP_NUM_THREADS came with the process's environment; torch's pools are sized here too.
        torch.set_num_threads(threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already fixed by earlier parallel work in this process
            pass
        self.pool = pool
        self.world = WorldInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device,
                               threads=threads)
        self.workers: dict[str, Any] = {}
        self.shared: dict[str, Any] = {}
        self.engine: Any = None

    # ------------------------------------------------------------------ start-up
    def describe(self) -> dict[str, Any]:
        """Where this process runs (for error messages and tests)."""
        import torch

        import ray

        return {"pid": os.getpid(), "node": _node_ip(), "node_id": ray.get_runtime_context().get_node_id(),
                "threads": torch.get_num_threads(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""), "rank": self.world.rank}

    def load_plugins(self, plugins: list[tuple[str, str]]) -> tuple[str, str, str] | None:
        """Resolve the run's plugins through this process's own registry (entry points on its sys.path).

        Returns ``(kind, name, message)`` for the first plugin that cannot be loaded here: the
        registry's errors take keyword arguments and do not survive pickling, so the controller
        re-raises it.
        """
        from verl_core.registry import PluginError, PluginRegistry

        registry = PluginRegistry()
        for kind, name in plugins:
            try:
                registry.load(kind, name)
            except PluginError as exc:
                return kind, name, (f"{exc} [in the Ray worker process of pool {self.pool!r}, rank {self.world.rank}, "
                                    f"on node {_node_ip()}: install the plugin on every node, or put it on the "
                                    f"controller's PYTHONPATH so the executor passes it on]")
        return None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port for the pool's ``torch.distributed`` rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return _node_ip(), port

    def set_rendezvous(self, address: str, port: int) -> None:
        """Export the ``env://`` rendezvous that ``torch.distributed.init_process_group`` reads."""
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(self.world.rank),
                          WORLD_SIZE=str(self.world.world_size), LOCAL_RANK=str(self.world.local_rank))

    def create_worker(self, role: str, packed: bytes, shared: dict[str, bytes]) -> tuple[type, Any]:
        """Build ``role``'s worker on this rank; returns its class (for dispatch lookups) and its place
        in the mesh (the worker's own ``world`` when it has one, else this rank's).

        ``packed`` is the pickled factory; the training backends it refers to come in ``shared``
        and the first copy of each is kept, so every role this process hosts gets the same one.
        """
        for key, blob in shared.items():
            if key not in self.shared:
                self.shared[key] = pickle.loads(blob)
        factory: Callable[[Any], Any] = _SharedUnpickler(io.BytesIO(packed), self.shared).load()
        worker = factory(self.world)
        self.workers[role] = worker
        world = getattr(worker, "world", None)
        return type(worker), (world if isinstance(world, type(self.world)) else self.world)

    def create_engine(self, engine_cls: type, config: Any, model: Any, tokenizer: Any,
                      actor_role: str | None) -> dict[str, bool]:
        """Build the rollout engine here, on the local actor worker when the actor shares this process."""
        actor = self.workers[actor_role] if actor_role is not None else None
        self.engine = engine_cls(config=config, model=model, tokenizer=tokenizer, actor=actor, world=self.world)
        return {"shares_actor_weights": bool(self.engine.shares_actor_weights),
                "supports_memory_release": bool(self.engine.supports_memory_release),
                "accepts_lora_adapters": bool(self.engine.accepts_lora_adapters)}

    # ------------------------------------------------------------------ calls
    def call(self, role: str, method: str, packed: tuple[tuple[Any, ...], dict[str, Any]],
             mode: str) -> tuple[Any, float]:
        """Run ``method`` on ``role``'s worker; returns the result and the seconds it took."""
        args, kwargs = packed
        start = time.perf_counter()
        result = getattr(self.workers[role], method)(*args, **kwargs)
        result = self._portable(result, f"{role}.{method}", mode)
        return result, time.perf_counter() - start

    def engine_call(self, method: str, packed: tuple[tuple[Any, ...], dict[str, Any]],
                    mode: str) -> tuple[Any, float]:
        """Run a method of the rollout engine hosted here."""
        args, kwargs = packed
        start = time.perf_counter()
        result = getattr(self.engine, method)(*args, **kwargs)
        result = self._portable(result, f"rollout.{method}", mode)
        return result, time.perf_counter() - start

    def engine_load_weights(self, weights: list[tuple[str, Any]]) -> tuple[None, float]:
        """Split placement: load full tensors sent from the actor's processes."""
        start = time.perf_counter()
        self.engine.load_weights(weights)
        return None, time.perf_counter() - start

    def engine_sync_from(self, role: str, method: str, packed: tuple[tuple[Any, ...], dict[str, Any]],
                         mode: str) -> tuple[None, float]:
        """Colocated weight sync: stream ``role``'s weights into the engine inside this process."""
        args, kwargs = packed
        start = time.perf_counter()
        self.engine.load_weights(getattr(self.workers[role], method)(*args, **kwargs))
        return None, time.perf_counter() - start

    def close(self) -> None:
        """Release engines and workers and leave the process group (a clean exit; kill works too)."""
        if self.engine is not None:
            self.engine.close()
        for worker in self.workers.values():
            worker.close()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ helpers
    def _portable(self, result: Any, what: str, mode: str) -> Any:
        if hasattr(result, "__enter__") and hasattr(result, "__exit__"):
            raise TypeError(f"{what} returned a context manager, which cannot cross a process boundary; run the "
                            f"code that needs it inside the worker process (a rollout engine placed on the "
                            f"actor's pool gets the local worker)")
        if hasattr(result, "__next__") and hasattr(result, "__iter__"):
            # A generator (weight streaming) runs collectives on every rank while it is consumed, so
            # every rank drains it; under "broadcast" only rank 0's items are sent back.
            if mode == "broadcast" and self.world.rank != 0:
                for _ in result:
                    pass
                return None
            return list(result)
        return result


class _SharedUnpickler(pickle.Unpickler):
    """Resolves the factory's references to objects this process already holds."""

    def __init__(self, file: Any, shared: dict[str, Any]) -> None:
        super().__init__(file)
        self._shared = shared

    def persistent_load(self, pid: Any) -> Any:
        return self._shared[pid]


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests): the loopback address is where we are
        return "127.0.0.1"
