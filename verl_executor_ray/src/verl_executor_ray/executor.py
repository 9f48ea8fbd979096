"""The Ray executor: worker groups as Ray actors on named resource pools.

The single controller (the process running :class:`~verl_core.trainer.Trainer`) stays where it
is; each resource pool becomes ``nnodes x procs`` :class:`~verl_executor_ray._host.WorkerHost`
actors placed with one placement group per node. A role's worker group runs SPMD on the
processes of the pool it is placed on, with a ``torch.distributed`` rendezvous per pool, and a
call on the group is dispatched as the worker method declares (:func:`verl_core.contracts.dispatch`).

Roles that share a pool share processes (the hybrid engine): calls on such groups are serialised
per pool, because their collectives run on the same process group. Groups on different pools run
concurrently under :meth:`RayExecutor.run_parallel`.

Ray is imported only when the executor starts its first group; selecting ``executor.name="ray"``
in a config costs nothing until then.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import math
import os
import site
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Sequence

from verl_core.config import ConfigError
from verl_core.contracts import (
    Executor,
    ModelSpec,
    Role,
    RolloutConfig,
    RolloutEngine,
    RolloutOutput,
    SamplingParams,
    TrainingBackend,
    WorkerFailedError,
    WorkerGroup,
    WorldInfo,
    dispatch_mode,
)
from verl_executor_ray._dispatch import Mesh, gather_split, split_call
from verl_executor_ray.config import RayExecutorConfig

__all__ = ["RayExecutor", "RayWorkerGroup", "RayRollout", "CallStats"]

logger = logging.getLogger(__name__)

# Environment passed on to every worker process besides the search path: verl's own settings.
_ENV_PREFIXES = ("VERL_", "HF_", "TRANSFORMERS_")


@dataclass
class CallStats:
    """Where the time of the executor's calls went (for the controller-overhead benchmark).

    Attributes:
        calls: calls dispatched.
        wall_s: controller wall time of those calls, from dispatch to gathered result.
        worker_s: per call, the longest time a worker spent in the method; summed.
        dispatch_s: splitting and submitting (serialisation happens here).
        gather_s: fetching and joining the results (deserialisation happens here).
    """

    calls: int = 0
    wall_s: float = 0.0
    worker_s: float = 0.0
    dispatch_s: float = 0.0
    gather_s: float = 0.0
    by_method: dict[str, list[float]] = field(default_factory=dict)

    def add(self, what: str, wall: float, worker: float, dispatch: float, gather: float) -> None:
        self.calls += 1
        self.wall_s += wall
        self.worker_s += worker
        self.dispatch_s += dispatch
        self.gather_s += gather
        row = self.by_method.setdefault(what, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += wall
        row[2] += worker

    @property
    def overhead_s(self) -> float:
        """Controller-side time not spent computing in a worker."""
        return self.wall_s - self.worker_s


class _Pool:
    """The processes of one resource pool and the lock that serialises SPMD calls on them."""

    def __init__(self, name: str, hosts: list[Any], info: list[dict[str, Any]], placement_groups: list[Any],
                 executor: "RayExecutor") -> None:
        self.name = name
        self.hosts = hosts
        self.info = info
        self.placement_groups = placement_groups
        self.executor = executor
        self.lock = threading.Lock()
        self.groups: list[RayWorkerGroup] = []

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    def run(self, host_method: str, per_rank: Sequence[tuple[Any, ...]], *, role: str, method: str,
            ) -> tuple[list[Any], list[float]]:
        """Call ``host_method`` on every host with its arguments; returns result refs and worker seconds.

        Waits for all ranks, but stops at the first failure: a rank that died leaves its peers
        blocked in a collective, so waiting for them would hang.
        """
        submitted = [getattr(h, host_method).options(num_returns=2).remote(*args)
                     for h, args in zip(self.hosts, per_rank)]
        seconds = self.executor._wait([s for _, s in submitted], pool=self, role=role, method=method)
        return [r for r, _ in submitted], seconds


class RayWorkerGroup(WorkerGroup):
    """A role's workers on the processes of one pool; calls dispatch per the method's declared mode."""

    def __init__(self, *, executor: "RayExecutor", role: Role, pool: _Pool, worker_cls: type,
                 mesh: Mesh | None = None) -> None:
        self.executor = executor
        self.role = role
        self.pool = pool
        self.world_size = pool.world_size
        self.worker_cls = worker_cls
        self.mesh = mesh  # split calls go over its data-parallel groups (None: one per rank)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.worker_cls, method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"{self.worker_cls.__name__} ({self.role.value}) has no method {method!r}")
        mode = dispatch_mode(self.worker_cls, method)
        if inspect.isgeneratorfunction(fn):
            # Streams run when consumed, so a consumer on the same processes can run them in place.
            return RemoteStream(self, method, args, kwargs, mode)
        return self.executor._dispatch(self.pool, "call", (self.role.value, method), args, kwargs, mode,
                                       role=self.role.value, method=method, mesh=self.mesh)

    def __repr__(self) -> str:
        return f"RayWorkerGroup({self.role.value}, pool={self.pool.name!r}, world_size={self.world_size})"


class RemoteStream(Iterable):
    """What a generator method (``iter_weights``) returns on a Ray group.

    Nothing runs until it is consumed. Iterating it runs the method on every rank (the stream's
    collectives need them all) and yields rank 0's items in this process; a rollout engine on the
    same processes instead runs it in place, and one on other processes takes :meth:`object_ref`
    so the tensors go from worker to worker without passing through this process.
    """

    def __init__(self, group: RayWorkerGroup, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 mode: str) -> None:
        self.group, self.method, self.args, self.kwargs, self.mode = group, method, args, kwargs, mode

    def object_ref(self) -> Any:
        """Run the stream on every rank; returns a reference to rank 0's list of items (not fetched)."""
        refs = self.group.executor._dispatch(self.group.pool, "call", (self.group.role.value, self.method),
                                             self.args, self.kwargs, self.mode, role=self.group.role.value,
                                             method=self.method, fetch=False)
        return refs[0]

    def __iter__(self) -> Iterator[Any]:
        items = self.group.executor._dispatch(self.group.pool, "call", (self.group.role.value, self.method),
                                              self.args, self.kwargs, self.mode, role=self.group.role.value,
                                              method=self.method)
        if self.mode == "all":
            items = [x for per_rank in items for x in per_rank]
        return iter(items)


class RayRollout(RolloutEngine):
    """Stands in, in the controller, for rollout engines hosted in the processes of a pool.

    ``generate`` is dispatched ``"split"`` over the pool's ranks (prompts sharded, outputs joined in
    order); weights reach the engines in place when they share processes with the actor, or as
    full tensors through Ray's object store when they do not.
    """

    def __init__(self, *, executor: "RayExecutor", pool: _Pool, engine: type[RolloutEngine], config: RolloutConfig,
                 model: ModelSpec, tokenizer: Any, actor_role: str | None, caps: dict[str, bool]) -> None:
        super().__init__(config=config, model=model, tokenizer=tokenizer, actor=None)
        self.executor = executor
        self.pool = pool
        self.engine_cls = engine
        self.actor_role = actor_role
        self.shares_actor_weights = caps["shares_actor_weights"]
        self.supports_memory_release = caps["supports_memory_release"]
        self._accepts_lora_adapters = caps.get("accepts_lora_adapters", False)
        self.accepts_multi_modal = bool(getattr(engine, "accepts_multi_modal", False))  # prompts carry their images
        self.world_size = pool.world_size

    @property
    def colocated(self) -> bool:
        """True when the engines live in the actor's worker processes."""
        return self.actor_role is not None

    def generate(self, prompt_ids: Sequence[Sequence[int]], *, sampling: SamplingParams) -> RolloutOutput:
        shards = split_call((list(prompt_ids),), {"sampling": sampling}, self.pool.world_size, method="generate")
        for rank, (_, kwargs) in enumerate(shards.calls):
            if sampling.seed is not None and rank:
                # Same seed on every rank would give every shard the same random stream.
                kwargs["sampling"] = replace(sampling, seed=sampling.seed + 7919 * rank)
        return self.executor._dispatch_shards(self.pool, "engine_call", ("generate",), shards, "split",
                                              role="rollout", method="generate")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        if isinstance(weights, RemoteStream) and weights.group.pool is self.pool:
            # Colocated: each process streams its actor's weights into its engine, nothing is sent.
            self.executor._dispatch(self.pool, "engine_sync_from", (weights.group.role.value, weights.method),
                                    weights.args, weights.kwargs, "all", role="rollout", method="load_weights")
            return
        if isinstance(weights, RemoteStream):
            ref = weights.object_ref()  # full tensors, produced on the actor's rank 0
        else:
            ref = self.executor._ray.put(list(weights))
        # A top-level argument, so Ray hands each process the tensors straight from the object store.
        self.executor._run(self.pool, "engine_load_weights", [(ref,)] * self.pool.world_size, role="rollout",
                           method="load_weights")

    @property
    def accepts_lora_adapters(self) -> bool:
        return self._accepts_lora_adapters

    def load_lora_adapter(self, adapter: Any) -> None:
        self.executor._dispatch(self.pool, "engine_call", ("load_lora_adapter",), (adapter,), {}, "all",
                                role="rollout", method="load_lora_adapter")

    def release_memory(self) -> None:
        self.executor._dispatch(self.pool, "engine_call", ("release_memory",), (), {}, "all", role="rollout",
                                method="release_memory")

    def reacquire_memory(self) -> None:
        self.executor._dispatch(self.pool, "engine_call", ("reacquire_memory",), (), {}, "all", role="rollout",
                                method="reacquire_memory")

    def close(self) -> None:
        if not self.executor._closed:
            self.executor._dispatch(self.pool, "engine_call", ("close",), (), {}, "all", role="rollout",
                                    method="close")


def _no_cluster(address: str, why: str) -> str:
    return (f"no Ray cluster answers at {address!r} ({why.rstrip('.')}). Start one first with `ray start --head` "
            f"(and `ray start --address=<head>:6379` on each other machine), or drop executor.address to start "
            f"a Ray instance for this run alone")


def _check_reachable(address: str) -> None:
    """A ``host:port`` nobody listens on fails in seconds here; ``ray.init`` would wait on it for minutes."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        raise ConfigError("executor.address", _no_cluster(address, f"{host}:{port}: {exc.strerror or exc}")) from None


class RayExecutor(Executor):
    """Places worker groups on Ray actors, one process per slot of a resource pool.

    Starts a local Ray instance (no dashboard) sized to this machine, or joins the cluster at
    ``executor.address``. Pools start lazily when the first role placed on them is created.
    :meth:`shutdown` (also run at interpreter exit; Ray turns SIGTERM into an exit) kills every
    worker and stops a Ray instance this executor started.
    """

    Config = RayExecutorConfig

    def __init__(self, config: RayExecutorConfig) -> None:
        super().__init__(config)
        self.config: RayExecutorConfig = config
        self._ray: Any = None
        self._started_ray = False
        self._closed = False
        self._pools: dict[str, _Pool] = {}
        self._pending_groups: list[Any] = []
        self.stats = CallStats()
        self.cpus_per_proc = 0.0
        self.threads = 1
        self.device = "cpu"
        atexit.register(self.shutdown)

    @classmethod
    def trainer_mode_problem(cls, config: RayExecutorConfig, mode: str) -> str | None:
        """Why verl-trainer-async's ``trainer.mode`` cannot run here (None: it can); that source asks before any
        model loads. ``separate_async`` needs the rollout on a pool of its own; ``colocate_async`` cannot be
        placed: the controller's producer would share the actor's worker processes, whose calls run one at a time."""
        if mode == "colocate_async":
            return ("'colocate_async' runs the producer in the controller's process, which the ray executor's "
                    "workers do not share; use trainer.mode='separate_async' with the rollout on a pool of its own "
                    "(executor.pools={gen=1}, executor.placement={rollout='gen'}), or executor.name='local'")
        actor_pool = config.pool_of("actor")
        if mode == "separate_async" and config.pool_of("rollout") == actor_pool:
            return (f"'separate_async' needs the rollout on a pool of its own, but it is placed on the actor's pool "
                    f"{actor_pool!r}; set executor.pools={{gen=1}} and executor.placement={{rollout='gen'}}")
        return None

    # ------------------------------------------------------------------ cluster
    def _connect(self) -> None:
        if self._ray is not None:
            return
        if self._closed:
            raise RuntimeError("this RayExecutor was shut down; create a new one")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network calls home from a training run
        import ray

        cfg = self.config
        if ray.is_initialized():
            pass  # a Ray session the caller opened (tests, notebooks): use it, leave it running
        elif cfg.address:
            _check_reachable(cfg.address)
            try:
                ray.init(address=cfg.address, logging_level=logging.WARNING, log_to_driver=cfg.log_to_driver)
            except ConnectionError as exc:
                raise ConfigError("executor.address", _no_cluster(cfg.address, str(exc))) from None
        else:
            # address="local": a new instance even when RAY_ADDRESS or an earlier `ray start` points elsewhere.
            ray.init(address="local", num_cpus=cfg.num_cpus or os.cpu_count() or 1,
                     num_gpus=None if cfg.num_gpus < 0 else cfg.num_gpus,
                     include_dashboard=False, logging_level=logging.WARNING, log_to_driver=cfg.log_to_driver)
            self._started_ray = True
        self._ray = ray
        self._plan_resources(ray.cluster_resources())

    def _plan_resources(self, resources: dict[str, float]) -> None:
        cfg = self.config
        cpus, gpus = float(resources.get("CPU", 0)), float(resources.get("GPU", 0))
        procs = sum(cfg.pool_sizes().values()) * cfg.nnodes
        if cfg.device == "cuda" and gpus < procs:
            raise ConfigError("executor.device", f"'cuda' needs a GPU per process ({procs} processes) but the Ray "
                                                 f"cluster has {gpus:g} GPUs")
        self.device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and gpus >= procs) else "cpu"
        share = cfg.cpus_per_proc or math.floor(cpus / procs * 1e4) / 1e4
        if share <= 0 or share * procs > cpus + 1e-6:
            raise ConfigError("executor.pools", f"{procs} processes x {share:g} CPUs need {share * procs:g} CPUs but "
                                                f"the Ray cluster has {cpus:g}; use fewer processes (pools, "
                                                f"world_size) or a smaller executor.cpus_per_proc")
        if share < 1:
            logger.warning("executor: %d worker processes share %g CPUs; phases that run at the same time will "
                           "contend for cores", procs, cpus)
        self.cpus_per_proc = share
        self.threads = cfg.threads_per_worker or max(1, int(share))

    def _worker_env(self) -> dict[str, str]:
        """Environment of every worker process: thread counts and the controller's plugin search path."""
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        threads = str(self.threads)
        env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads,
                   TOKENIZERS_PARALLELISM="false")
        # Entry points are found on sys.path: a plugin installed into a --target directory or
        # added to sys.path at run time must be on the workers' path too, or they cannot import it.
        paths = _extra_sys_path()
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        return env

    def _pool(self, name: str, *, role: str) -> _Pool:
        if name in self._pools:
            return self._pools[name]
        self._connect()
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from verl_executor_ray._host import WorkerHost

        cfg = self.config
        procs = cfg.pool_sizes()[name]
        gpu = 1 if self.device == "cuda" else 0
        bundle = {"CPU": self.cpus_per_proc, **({"GPU": gpu} if gpu else {})}
        # One bundle per node, holding that node's processes together (local ranks, NVLink), and
        # the bundles spread over distinct nodes: nnodes=2 means two machines, not two slots that
        # happen to fit on one.
        node_bundle = {key: amount * procs for key, amount in bundle.items()}
        group = placement_group([dict(node_bundle) for _ in range(cfg.nnodes)],
                                strategy="STRICT_SPREAD" if cfg.nnodes > 1 else "STRICT_PACK",
                                name=f"verl-{name}-{os.getpid()}")
        self._pending_groups.append(group)
        ready, _ = ray.wait([group.ready()], num_returns=1, timeout=cfg.startup_timeout_s)
        if not ready:
            nodes = len([n for n in ray.nodes() if n.get("Alive")])
            raise ConfigError(f"executor.pools.{name}",
                              f"{cfg.nnodes} node(s) x {procs} processes with {bundle} each could not be placed "
                              f"within {cfg.startup_timeout_s:g}s; the cluster has {nodes} node(s) and "
                              f"{ray.available_resources()} free")
        host_cls = ray.remote(WorkerHost)
        env = self._worker_env()
        world = procs * cfg.nnodes
        hosts = []
        for n in range(cfg.nnodes):
            for i in range(procs):
                hosts.append(host_cls.options(
                    num_cpus=self.cpus_per_proc, num_gpus=gpu, max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=n),
                    runtime_env={"env_vars": env},
                ).remote(pool=name, rank=n * procs + i, world_size=world, local_rank=i, device=self.device,
                         threads=self.threads))
        pool = _Pool(name, hosts, [{} for _ in hosts], [group], self)
        self._pools[name] = pool
        pool.info = self._get(pool, [h.describe.remote() for h in hosts], role=role, method="start")
        for problem in self._get(pool, [h.load_plugins.remote(list(self.plugins)) for h in hosts], role=role,
                                 method="load_plugins"):
            if problem is not None:
                from verl_core.registry import PluginError

                kind, plugin, message = problem
                raise PluginError(message, kind=kind, name=plugin)
        address, port = self._get(pool, [hosts[0].rendezvous_address.remote()], role=role, method="rendezvous")[0]
        self._get(pool, [h.set_rendezvous.remote(address, port) for h in hosts], role=role, method="rendezvous")
        return pool

    # ------------------------------------------------------------------ executor contract
    def create_group(self, *, role: Role, factory: Callable[[WorldInfo], Any]) -> WorkerGroup:
        role = Role(role)
        pool = self._pool(self.config.pool_of(role.value), role=role.value)
        if any(g.role is role for g in pool.groups):
            raise ValueError(f"the {role.value} group already exists on pool {pool.name!r}")
        packed, shared = self._pack_factory(factory)
        with pool.lock:
            created = self._get(pool, [h.create_worker.remote(role.value, packed, shared) for h in pool.hosts],
                                role=role.value, method="create_worker")
        group = RayWorkerGroup(executor=self, role=role, pool=pool, worker_cls=created[0][0],
                               mesh=Mesh.of([world for _, world in created]))
        pool.groups.append(group)
        return group

    @staticmethod
    def _pack_factory(factory: Callable[[WorldInfo], Any]) -> tuple[bytes, dict[str, bytes]]:
        """Pickle a worker factory so that each training backend in it stays one object per process.

        A backend may keep per-process state across the roles it builds (the FSDP backend gives
        the reference of a LoRA actor the actor's own module instead of a second copy). Pickled
        with every group, it would arrive as a fresh copy each time; instead it travels by
        reference and each process keeps the first copy it receives, as in a single process.
        """
        import io

        from ray import cloudpickle

        shared: dict[str, bytes] = {}

        class Pickler(cloudpickle.Pickler):
            def persistent_id(self, obj: Any) -> str | None:
                if not isinstance(obj, TrainingBackend):
                    return None
                key = f"{type(obj).__qualname__}@{id(obj)}"
                shared.setdefault(key, cloudpickle.dumps(obj))
                return key

        buffer = io.BytesIO()
        Pickler(buffer).dump(factory)
        return buffer.getvalue(), shared

    def create_rollout(self, *, engine: type[RolloutEngine], config: RolloutConfig, model: ModelSpec,
                       tokenizer: Any, actor: WorkerGroup) -> RolloutEngine:
        pool = self._pool(self.config.pool_of("rollout"), role="rollout")
        # Colocated when the actor's processes are this pool's: the engine gets the local actor.
        actor_role = actor.role.value if isinstance(actor, RayWorkerGroup) and actor.pool is pool else None
        with pool.lock:
            caps = self._get(pool, [h.create_engine.remote(engine, config, model, tokenizer, actor_role)
                                    for h in pool.hosts], role="rollout", method="create_engine")
        return RayRollout(executor=self, pool=pool, engine=engine, config=config, model=model, tokenizer=tokenizer,
                          actor_role=actor_role, caps=caps[0])

    def run_parallel(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run independent tasks at once; groups on different pools then compute concurrently.

        Daemon threads, not a thread pool: after a failure or Ctrl-C the controller must be able to
        exit while another task still waits on workers that :meth:`shutdown` is about to kill.
        """
        if len(tasks) <= 1:
            return [task() for task in tasks]
        results: list[Any] = [None] * len(tasks)
        errors: list[BaseException] = []
        done = threading.Semaphore(0)

        def work(i: int, task: Callable[[], Any]) -> None:
            try:
                results[i] = task()
            except BaseException as exc:  # handed to the controller's thread below
                errors.append(exc)
            finally:
                done.release()

        for i, task in enumerate(tasks):
            threading.Thread(target=work, args=(i, task), daemon=True, name=f"verl-parallel-{i}").start()
        for _ in tasks:
            while not done.acquire(timeout=0.5):  # a timed wait lets Ctrl-C through
                pass
            if errors:
                raise errors[0]
        return results

    def shutdown(self) -> None:
        """Kill every worker process, release the placement groups, stop a Ray instance started here."""
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        if ray is None or not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        for pool in self._pools.values():
            for host in pool.hosts:
                try:
                    ray.kill(host, no_restart=True)
                except Exception:  # already dead
                    pass
        for group in self._pending_groups:
            try:
                remove_placement_group(group)
            except Exception:
                pass
        if self._started_ray:
            ray.shutdown()

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, pool: _Pool, host_method: str, head: tuple[Any, ...], args: tuple[Any, ...],
                  kwargs: dict[str, Any], mode: str, *, role: str, method: str, fetch: bool = True,
                  mesh: Mesh | None = None) -> Any:
        start = time.perf_counter()
        if mode == "split":
            shards = split_call(args, kwargs, mesh.dp_size if mesh else pool.world_size, method=f"{role}.{method}",
                                balance=self.config.balance_batches)
            return self._dispatch_shards(pool, host_method, head, shards, mode, role=role, method=method, start=start,
                                         mesh=mesh)
        packed: Any = (tuple(args), dict(kwargs))
        if pool.world_size > 1 and (args or kwargs):
            packed = self._ray.put(packed)  # serialised once, read by every rank
        per_rank = [(*head, packed, mode)] * pool.world_size
        submitted = time.perf_counter()
        with pool.lock:
            refs, seconds = pool.run(host_method, per_rank, role=role, method=method)
        finished = time.perf_counter()
        if not fetch:
            self.stats.add(f"{role}.{method}", finished - start, max(seconds), submitted - start, 0.0)
            return refs
        wanted = refs[:1] if mode == "broadcast" else refs
        values = self._ray.get(wanted)
        end = time.perf_counter()
        self.stats.add(f"{role}.{method}", end - start, max(seconds), submitted - start, end - finished)
        return values[0] if mode == "broadcast" else values

    def _dispatch_shards(self, pool: _Pool, host_method: str, head: tuple[Any, ...], shards: Any, mode: str, *,
                         role: str, method: str, start: float | None = None, mesh: Mesh | None = None) -> Any:
        start = time.perf_counter() if start is None else start
        # Each shard goes to the ranks of one data-parallel group: Ray serialises it with the task.
        calls = mesh.per_rank(shards) if mesh else shards.calls
        per_rank = [(*head, call, mode) for call in calls]
        submitted = time.perf_counter()
        with pool.lock:
            refs, seconds = pool.run(host_method, per_rank, role=role, method=method)
        finished = time.perf_counter()
        if mesh:
            refs = mesh.read(refs)  # one result per data-parallel group, from its output rank
        result = gather_split(self._ray.get(refs), real=shards.real, padded=shards.padded, order=shards.order)
        end = time.perf_counter()
        self.stats.add(f"{role}.{method}", end - start, max(seconds), submitted - start, end - finished)
        return result

    def _run(self, pool: _Pool, host_method: str, per_rank: list[tuple[Any, ...]], *, role: str,
             method: str) -> list[Any]:
        """Call a host method with per-rank arguments as given (object refs among them resolved by Ray)."""
        start = time.perf_counter()
        with pool.lock:
            refs, seconds = pool.run(host_method, per_rank, role=role, method=method)
        values = self._ray.get(refs)
        self.stats.add(f"{role}.{method}", time.perf_counter() - start, max(seconds), 0.0, 0.0)
        return values

    def _get(self, pool: _Pool, refs: list[Any], *, role: str, method: str) -> list[Any]:
        self._wait(refs, pool=pool, role=role, method=method)
        return self._ray.get(refs)

    def _wait(self, refs: list[Any], *, pool: _Pool, role: str, method: str) -> list[Any]:
        """Values of ``refs`` (one per rank), raising within a second of any rank failing."""
        ray = self._ray
        pending = list(refs)
        while pending:
            # Timed, so a failed rank (its ref becomes ready with an error) is seen even while its
            # peers hang in a collective with it, and Ctrl-C gets through.
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            if ready:
                try:
                    ray.get(ready)
                except ray.exceptions.RayError:
                    self._raise_first_failure(ready, refs, pool=pool, role=role, method=method)
        return ray.get(refs)

    def _raise_first_failure(self, ready: list[Any], refs: list[Any], *, pool: _Pool, role: str, method: str) -> None:
        ray = self._ray
        # A rank that dies makes its peers fail in their next collective ("connection reset by
        # peer"), and that error may arrive first. Give the others a moment to report: a dead
        # rank is the cause to name; the peers' errors only follow from it.
        others = [r for r in refs if r not in ready]
        if others:
            more, _ = ray.wait(others, num_returns=len(others), timeout=_DEATH_GRACE_S)
            ready = list(ready) + list(more)
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                    ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError):
                dead.append(ref)
            except ray.exceptions.RayError:
                pass
        for ref in dead + [r for r in ready if r not in dead]:
            rank = refs.index(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                raise _task_error(exc, pool=pool, rank=rank, role=role, method=method) from None
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                    ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError) as exc:
                raise _death_error(exc, pool=pool, rank=rank, role=role, method=method) from None
            except ray.exceptions.RayError as exc:  # e.g. a result or exception that cannot be unpickled
                raise RuntimeError(f"{role}.{method} failed on {_where(pool, rank)}: {exc}") from exc


# ---------------------------------------------------------------------- errors
_DEATH_GRACE_S = 5.0  # how long a failure waits for the other ranks' outcome before it is reported
def _where(pool: _Pool, rank: int) -> str:
    info = pool.info[rank] if rank < len(pool.info) else {}
    place = ", ".join(f"{k} {info[k]}" for k in ("pid", "node") if info.get(k))
    return f"rank {rank} of {pool.world_size} on pool {pool.name!r}" + (f" ({place})" if place else "")


def _task_error(exc: Any, *, pool: _Pool, rank: int, role: str, method: str) -> BaseException:
    """A Python exception raised inside a worker: re-raise the original, noting where it happened."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        cause.add_note(f"raised in {role}.{method} on {_where(pool, rank)}")
        return cause
    return RuntimeError(f"{role}.{method} failed on {_where(pool, rank)}: {exc}")


def _death_error(exc: Any, *, pool: _Pool, rank: int, role: str, method: str) -> WorkerFailedError:
    """A worker process that died: say which, during what, and why as far as Ray knows."""
    cause = _death_cause(exc)
    return WorkerFailedError(f"the {role} worker, {_where(pool, rank)}, died during {method}: {cause}",
                             role=role, rank=rank, cause=cause)


def _death_cause(exc: BaseException) -> str:
    """A one-line reason from a Ray error about a dead worker."""
    text = str(exc)
    if type(exc).__name__ == "OutOfMemoryError" or "low on memory" in text:
        return ("Ray's memory monitor killed it because the node ran out of memory (lower the micro-batch sizes "
                "or the processes per node)")
    detail = ""
    if "Worker exit detail:" in text:
        detail = text.split("Worker exit detail:", 1)[1].split("Some common causes", 1)[0].strip()
    if "connection error" in detail or "End of file" in detail or "SIGKILL" in text:
        return ("its process exited without a Python error: killed by a signal (SIGKILL, the kernel's OOM "
                "killer) or crashed (segfault); the node's kernel log says which")
    if detail:
        return detail.splitlines()[0].strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first or type(exc).__name__


def _extra_sys_path() -> list[str]:
    """Entries of this process's sys.path that a fresh interpreter would not have (plugin directories)."""
    default: set[str] = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            default.add(os.path.realpath(path))
    for path in [*getattr(site, "getsitepackages", lambda: [])(), site.getusersitepackages()]:
        default.add(os.path.realpath(path))
    extra: list[str] = []
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        if path in default or not os.path.isdir(path) or path in extra:
            continue
        if any(path.startswith(d + os.sep) for d in default if d.endswith(("site-packages", "dist-packages"))):
            continue
        if path.startswith(os.path.realpath(sys.prefix) + os.sep + "lib"):
            continue  # the interpreter's own directories (lib-dynload, zip) are on every worker's path
        extra.append(path)
    env = os.environ.get("PYTHONPATH", "")
    for entry in env.split(os.pathsep):
        if entry and os.path.realpath(entry) not in extra:
            extra.append(os.path.realpath(entry))
    return extra
