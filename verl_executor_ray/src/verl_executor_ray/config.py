"""Settings of the Ray executor: where the cluster is, the resource pools, and which role runs where.

A *pool* is a named set of worker processes (``procs`` per node on each of ``nnodes`` nodes),
each holding a slice of the cluster's CPUs and, on GPU clusters, one GPU. Roles (``actor``,
``critic``, ``reference``, ``rollout``, ``reward_model``) map to pools. Roles on the same pool
share its processes: that is colocation (the hybrid engine). A role on a pool of its own is split
placement. Both are configuration::

    [executor]
    name = "ray"
    world_size = 2                       # the "default" pool: 2 processes
    pools = { gen = 1 }                  # one more pool with 1 process
    placement = { rollout = "gen" }      # the rollout runs there; every other role on "default"
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_core.config import ConfigError
from verl_core.contracts import ExecutorConfig, Role

__all__ = ["RayExecutorConfig", "ROLES", "DEFAULT_POOL"]

#: Roles that can be placed: the training roles and the rollout engine.
ROLES = tuple(r.value for r in Role) + ("rollout",)
DEFAULT_POOL = "default"


@dataclass
class RayExecutorConfig(ExecutorConfig):
    """Ray executor settings on top of the common executor settings.

    Attributes:
        address: an existing Ray cluster to join (``"auto"``, ``"host:port"`` or
            ``"ray://host:port"``); empty starts a local Ray instance for this run and stops it at
            the end.
        nnodes: nodes each pool spans.
        procs_per_node: processes per node in the ``default`` pool (0: ``world_size / nnodes``).
            When set, ``world_size`` becomes ``nnodes * procs_per_node``.
        pools: extra pools (or a resized ``default``), name -> processes per node.
        placement: role -> pool. Roles not listed run on the ``default`` pool.
        num_cpus: CPUs of the local Ray instance (0: this machine's). Ignored when joining.
        num_gpus: GPUs of the local Ray instance (-1: what Ray detects). Ignored when joining.
        device: ``"auto"`` (a GPU per process when the cluster has GPUs), ``"cpu"`` or ``"cuda"``.
        cpus_per_proc: CPUs each process reserves (0: the cluster's CPUs shared evenly over all
            processes). Its whole part, at least 1, is the process's torch thread count unless
            ``threads_per_worker`` says otherwise.
        startup_timeout_s: how long to wait for the pools' resources and for workers to start.
        log_to_driver: show the workers' output in this process.
        balance_batches: give every data-parallel rank a near-equal number of tokens (samples
            regrouped longest-first) instead of contiguous slices of the batch. Regrouping changes
            which samples share a micro-batch, so a token-mean loss weighs tokens slightly
            differently than one process would; ``false`` keeps contiguous slices, whose
            micro-batches are the one-process ones.
    """

    address: str = ""
    nnodes: int = 1
    procs_per_node: int = 0
    pools: dict[str, int] = field(default_factory=dict)
    placement: dict[str, str] = field(default_factory=dict)
    num_cpus: int = 0
    num_gpus: int = -1
    device: str = "auto"
    cpus_per_proc: float = 0.0
    startup_timeout_s: float = 180.0
    log_to_driver: bool = True
    balance_batches: bool = True

    def validate(self) -> None:
        if self.nnodes < 1:
            raise ConfigError("nnodes", "must be at least 1")
        if self.procs_per_node < 0:
            raise ConfigError("procs_per_node", "must be >= 0 (0: world_size / nnodes)")
        if self.world_size < 1:
            raise ConfigError("world_size", "must be at least 1")
        if self.procs_per_node:
            total = self.nnodes * self.procs_per_node
            if self.world_size not in (1, total):
                raise ConfigError("world_size", f"is {self.world_size} but nnodes * procs_per_node is {total}; "
                                                f"set one or the other")
            self.world_size = total
        elif self.world_size % self.nnodes:
            raise ConfigError("world_size", f"{self.world_size} processes do not divide over nnodes="
                                            f"{self.nnodes}; use a multiple of nnodes")
        else:
            self.procs_per_node = self.world_size // self.nnodes
        for name, size in self.pools.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ConfigError(f"pools.{name}", f"must be a number of processes per node (>= 1), got {size!r}")
        if DEFAULT_POOL in self.pools and self.pools[DEFAULT_POOL] != self.procs_per_node:
            if self.world_size != 1 or self.procs_per_node != 1:
                raise ConfigError(f"pools.{DEFAULT_POOL}", f"is {self.pools[DEFAULT_POOL]} but world_size/"
                                                           f"procs_per_node give {self.procs_per_node}; set one")
            self.procs_per_node = self.pools[DEFAULT_POOL]
            self.world_size = self.nnodes * self.procs_per_node
        pools = self.pool_sizes()
        for role, pool in self.placement.items():
            if role not in ROLES:
                raise ConfigError(f"placement.{role}", f"unknown role; roles are {list(ROLES)}")
            if not isinstance(pool, str) or pool not in pools:
                raise ConfigError(f"placement.{role}", f"unknown pool {pool!r}; pools are {sorted(pools)} "
                                                       f"(add it to executor.pools)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", "must be 'auto', 'cpu' or 'cuda'")
        if self.cpus_per_proc < 0:
            raise ConfigError("cpus_per_proc", "must be >= 0 (0: share the cluster's CPUs evenly)")
        if self.num_cpus < 0:
            raise ConfigError("num_cpus", "must be >= 0 (0: this machine's CPUs)")
        if self.threads_per_worker < 0:
            raise ConfigError("threads_per_worker", "must be >= 0 (0: from the pool's CPU share)")
        if self.startup_timeout_s <= 0:
            raise ConfigError("startup_timeout_s", "must be > 0")

    def pool_sizes(self) -> dict[str, int]:
        """Processes per node of every pool, the ``default`` pool first."""
        return {DEFAULT_POOL: self.procs_per_node, **{k: v for k, v in self.pools.items() if k != DEFAULT_POOL}}

    def pool_of(self, role: str) -> str:
        """The pool ``role`` is placed on."""
        return self.placement.get(role, DEFAULT_POOL)
