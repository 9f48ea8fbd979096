"""The torchrun executor: the processes ``torchrun`` started are the ranks of every worker group.

``torchrun --nproc_per_node=N train.py`` starts N copies of a script that builds a
:class:`~verl_core.trainer.Trainer` (``GRPOTrainer(...).train()``, ``verl run``). Each copy reads
its place from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and joins one ``torch.distributed`` group when the trainer builds this executor.
Rank 0 goes on as the single controller and hosts rank 0 of every worker group. Every other process
stops there, inside the trainer's set-up, and serves as a worker: it builds the workers rank 0 asks
for and runs the calls rank 0 dispatches, SPMD, until rank 0's interpreter exits (a script may train
more than once); then it exits with status 0, so code after ``train()`` runs on rank 0 only.

Calls travel over a gloo group of their own, pickled (so what they carry must be importable on
every rank: the same script and environment give that), and the training backend's collectives
keep the default group to themselves. A call is dispatched as the worker method declares
(:func:`verl_core.contracts.dispatch`): ``"split"`` cuts the batch into one shard per rank
(:mod:`verl_kit.sharding`) and joins the results, ``"all"`` returns every rank's result,
``"broadcast"`` rank 0's. A method that returns a context manager (``generation_module``) is
entered on every rank and left on every rank when rank 0 leaves it; a generator (``iter_weights``)
runs on every rank while rank 0 consumes it. The rollout engine and the reward stage run in the
controller, as with the in-process executor; an engine that would generate on the actor's own
weights (``hf``) gets a copy of them on rank 0, synced after every step like any engine's.

An error raised by a call on some ranks reaches the controller as the error itself (re-raised on
rank 0 with the rank it came from) when every rank finishes the call. A rank that cannot finish it
(a peer left a collective it waits in) ends its process after :data:`FAILURE_GRACE_S`; torchrun
then stops the others and names the rank.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import inspect
import io
import itertools
import logging
import os
import pickle
import sys
import threading
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from verl_core.config import ConfigError
from verl_core.contracts import (
    Executor,
    ExecutorConfig,
    ModelSpec,
    Role,
    RolloutConfig,
    RolloutEngine,
    TrainingBackend,
    WorkerFailedError,
    WorkerGroup,
    WorldInfo,
    dispatch_mode,
)
from verl_kit.sharding import Mesh, gather_split, split_call

__all__ = ["TorchrunExecutor", "TorchrunExecutorConfig", "TorchrunWorkerGroup", "torchrun_world",
           "FAILURE_GRACE_S"]

logger = logging.getLogger(__name__)

#: How long the ranks that finished a failed call wait for the others before giving up on them.
FAILURE_GRACE_S = 30.0

#: What torchrun (``python -m torch.distributed.run``) exports to every process it starts.
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class TorchrunExecutorConfig(ExecutorConfig):
    """Settings of the torchrun executor (``executor.name = "torchrun"``).

    Attributes:
        world_size: 0 (default): every process torchrun started (``WORLD_SIZE``); any other value
            must equal it.
        device: ``"auto"`` (``cuda:LOCAL_RANK`` when CUDA is available, else the CPU), ``"cpu"`` or ``"cuda"``.
        balance_batches: give every rank a near-equal number of tokens (samples regrouped
            longest-first) instead of contiguous slices of the batch; ``false`` keeps the
            micro-batches of one process, so a run matches a single-process run to float precision.
        idle_timeout_s: how long a worker rank waits for the controller's next call (meanwhile the
            controller generates, scores, validates and checkpoints).
    """

    world_size: int = 0
    device: str = "auto"
    balance_batches: bool = True
    idle_timeout_s: float = 7 * 24 * 3600.0

    def validate(self) -> None:
        if self.world_size < 0:
            raise ConfigError("world_size", "must be 0 (every process torchrun started) or that number")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device", "must be 'auto', 'cpu' or 'cuda'")
        if self.threads_per_worker < 0:
            raise ConfigError("threads_per_worker", "must be >= 0 (0: the threads the trainer set)")
        if self.idle_timeout_s <= 0:
            raise ConfigError("idle_timeout_s", "must be > 0 seconds")


def torchrun_world() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from torchrun's environment; ``None`` outside torchrun."""
    if any(not os.environ.get(key) for key in _ENV):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


# ---------------------------------------------------------------------- the process's place
class _Session:
    """This process's place in the torchrun world and its channel to the other ranks (one per process)."""

    def __init__(self, config: TorchrunExecutorConfig) -> None:
        import torch
        import torch.distributed as dist

        place = torchrun_world()
        if place is None:
            missing = [key for key in _ENV if not os.environ.get(key)]
            raise ConfigError("executor.name", f"the torchrun executor runs in the processes torchrun starts, and "
                                               f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                                               f"set; start the script with `torchrun --nproc_per_node=N "
                                               f"train.py` (or `python -m torch.distributed.run ...`), or use "
                                               f"executor.name='local' for one process")
        self.rank, self.world_size, self.local_rank = place
        if config.world_size not in (0, self.world_size):
            raise ConfigError("executor.world_size", f"is {config.world_size} but torchrun started "
                                                     f"{self.world_size} processes; leave it at 0 to use them all")
        cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
        if cuda and not torch.cuda.is_available():
            raise ConfigError("executor.device", "'cuda' but torch sees no CUDA device")
        self.device = "cuda" if cuda else "cpu"
        self.owns_process_group = not dist.is_initialized()
        if self.owns_process_group:
            if cuda:
                torch.cuda.set_device(self.local_rank)
            dist.init_process_group("nccl" if cuda else "gloo", rank=self.rank, world_size=self.world_size)
        elif dist.get_world_size() != self.world_size:
            raise RuntimeError(f"torch.distributed is initialised with world size {dist.get_world_size()}, but "
                               f"torchrun started {self.world_size} processes")
        # Calls and results go over gloo (pickled objects on the CPU), apart from the backend's collectives.
        self.control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=config.idle_timeout_s))
        self.world = WorldInfo(rank=self.rank, world_size=self.world_size, local_rank=self.local_rank,
                               device=self.device, threads=config.threads_per_worker or torch.get_num_threads())
        self.workers: dict[int, Any] = {}
        self.roles: dict[int, str] = {}
        self.lock = threading.RLock()
        self.broken = False  # the ranks may be out of step: send nothing more
        self.stopped = False
        self._ids = itertools.count()
        # Training backends travel by reference, so the roles of one run share one copy per rank,
        # as they share one object in the controller (see verl_executor_ray's _pack_factory).
        self._backend_keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._sent: set[str] = set()
        self.backends: dict[str, Any] = {}  # worker ranks: the copies received, by key
        self._backends_of: dict[int, set[str]] = {}
        self.stream: Iterator[Any] | None = None  # rank 0: the generator call being consumed
        self._last: Any = None
        if self.rank == 0:
            atexit.register(self.stop)

    # ------------------------------------------------------------------ messages
    def pack(self, messages: list[Any]) -> list[bytes]:
        """Pickle one message per worker rank, with the training backends none of them has yet."""
        blobs: dict[str, bytes] = {}
        session = self

        class Pickler(pickle.Pickler):
            def persistent_id(self, obj: Any) -> str | None:
                if not isinstance(obj, TrainingBackend):
                    return None
                key = session._backend_keys.get(obj)
                if key is None:
                    key = session._backend_keys[obj] = f"{type(obj).__qualname__}#{next(session._ids)}"
                if key not in session._sent:
                    blobs.setdefault(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
                return key

        payloads = []
        for message in messages:
            buffer = io.BytesIO()
            try:
                Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                what = f"the {message[2]} worker's factory" if message[0] == "create" else f"a call of {message[2]}"
                raise TypeError(f"{what} cannot be sent to the other torchrun ranks ({exc}): what a call carries "
                                f"must pickle (module-level functions and classes, functools.partial; no lambdas "
                                f"or closures)") from exc
            payloads.append(buffer.getvalue())
        self._sent.update(blobs)
        return [pickle.dumps((blobs, payload), protocol=pickle.HIGHEST_PROTOCOL) for payload in payloads]

    def send(self, messages: list[Any]) -> None:
        """Rank 0: hand ``messages[i]`` to rank ``i + 1`` (one entry per worker rank)."""
        if self.world_size > 1:
            self.send_packed(self.pack(messages))

    def send_all(self, message: Any) -> None:
        """Rank 0: the same message to every worker rank (pickled once)."""
        if self.world_size > 1:
            self.send_packed(self.pack([message]) * (self.world_size - 1))

    def send_packed(self, packed: list[bytes]) -> None:
        import torch.distributed as dist

        if self.broken:
            raise RuntimeError("the torchrun ranks are out of step after an earlier failure; no more calls can run")
        try:
            dist.scatter_object_list([None], [b"", *packed], src=0, group=self.control)
        except Exception as exc:
            self.broken = True
            raise _lost(exc, "sending a call") from exc

    def receive(self) -> tuple[Any, set[str]]:
        """A worker rank: the next message from rank 0, and the keys of the training backends it refers to."""
        import torch.distributed as dist

        out: list[Any] = [None]
        dist.scatter_object_list(out, None, src=0, group=self.control)
        blobs, payload = pickle.loads(out[0])
        for key, blob in blobs.items():
            self.backends.setdefault(key, pickle.loads(blob))
        backends, used = self.backends, set()

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                used.add(pid)
                return backends[pid]

        return Unpickler(io.BytesIO(payload)).load(), used

    def gather(self, status: Any, *, timeout: float | None = None) -> list[Any] | None:
        """Every rank's ``status`` at rank 0 (``None`` elsewhere, and at rank 0 after ``timeout`` seconds)."""
        import torch.distributed as dist

        if self.world_size == 1:
            return [status]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        if timeout is None:
            dist.gather_object(status, out, dst=0, group=self.control)
            return out
        done = threading.Event()

        def run() -> None:
            dist.gather_object(status, out, dst=0, group=self.control)
            done.set()

        # A thread, so that rank 0 can give up on ranks stuck in a collective it left.
        threading.Thread(target=run, daemon=True, name="verl-torchrun-gather").start()
        return out if done.wait(timeout) else None

    # ------------------------------------------------------------------ worker ranks
    def serve(self) -> None:
        """A worker rank: run what rank 0 sends until its interpreter exits; then leave the process group."""
        import torch.distributed as dist

        try:
            self._serve(depth=0)
        finally:
            self.broken = True
        for gid in list(self.workers):
            self._close_worker(gid)
        if self.owns_process_group:
            dist.destroy_process_group()

    def _serve(self, depth: int) -> bool:
        """Handle messages; returns True on ``stop``, False when the context entered at ``depth`` is left."""
        while True:
            (op, *rest), used = self.receive()
            if op == "stop":
                return True
            if op == "exit_context":
                if depth:
                    return False
                continue  # a context this rank failed to enter, which rank 0 has given up
            if op == "close":
                for gid in rest[0]:
                    self._close_worker(gid)
            elif op == "create":
                gid, role, factory, threads = rest
                world = dataclasses.replace(self.world, threads=threads)
                self._run(f"building the {role} worker", lambda: factory(world), report=_mesh_place)
                if self._last is not None:
                    self.workers[gid], self.roles[gid], self._backends_of[gid] = self._last, role, used
            elif op == "call":
                gid, method, args, kwargs, mode = rest
                if self._call(gid, method, args, kwargs, mode, depth):
                    return True

    def _call(self, gid: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], mode: str,
              depth: int) -> bool:
        worker = self.workers[gid]
        what = f"{self.roles[gid]}.{method}"
        if inspect.isgeneratorfunction(getattr(type(worker), method)):
            # Every rank runs the stream's collectives while rank 0 consumes it.
            with _fatal(self, what):
                items = list(getattr(worker, method)(*args, **kwargs))
            if mode != "broadcast":
                self.gather((None, None, items))
            return False
        cm = self._run(what, lambda: getattr(worker, method)(*args, **kwargs), mode=mode)
        if cm is None:
            return False
        # Entered with rank 0 (gathering shards is a collective); left when rank 0 leaves it.
        with _fatal(self, what):
            try:
                return self._serve(depth + 1)
            finally:
                cm.__exit__(None, None, None)

    def _run(self, what: str, fn: Callable[[], Any], *, mode: str = "broadcast",
             report: Callable[[Any], Any] | None = None) -> Any:
        """Run ``fn``, entering a context manager it returns, and report the outcome to rank 0.

        Returns the entered context manager, if any; the result is in ``self._last`` (``None``
        after an error, which goes to rank 0 instead).
        """
        self._last = None
        try:
            result = fn()
            entered = _enter(result, what, mode)
        except Exception as exc:
            text = "".join(traceback.format_exception(exc))
            # If rank 0 never collects this (it waits in a collective this rank left), end the
            # process, so that torchrun stops the run and reports it instead of both hanging.
            timer = threading.Timer(FAILURE_GRACE_S, _die, args=(self, what, text))
            timer.daemon = True
            timer.start()
            self.gather((_portable(exc), text, None))
            timer.cancel()
            return None
        self._last = result
        if report is not None:  # what rank 0 needs of the result, not the result
            self.gather((None, None, report(result)))
            return None
        self.gather((None, None, None if mode == "broadcast" or entered is not None else result))
        return None if entered is None else entered[0]

    def _close_worker(self, gid: int) -> None:
        worker = self.workers.pop(gid, None)
        self.roles.pop(gid, None)
        self._backends_of.pop(gid, None)
        used = set().union(*self._backends_of.values())
        for key in [k for k in self.backends if k not in used]:
            del self.backends[key]
        if worker is not None:
            try:
                worker.close()
            except Exception:  # a worker that fails to close must not keep the others open
                logger.exception("closing a worker on torchrun rank %d failed", self.rank)

    # ------------------------------------------------------------------ rank 0
    def stop(self) -> None:
        """Rank 0, at interpreter exit: let the worker ranks exit, and leave the process group."""
        import torch.distributed as dist

        if self.stopped:
            return
        self.stopped = True
        if self.broken or self.stream is not None:
            return  # the ranks are out of step: torchrun stops the others when this process exits
        try:
            self.send_all(("stop",))
            if self.owns_process_group and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # at exit, a peer that is already gone is not worth a traceback
            pass


_SESSION: _Session | None = None


def _session(config: TorchrunExecutorConfig) -> _Session:
    global _SESSION
    if _SESSION is None or _SESSION.stopped:
        _SESSION = _Session(config)
    return _SESSION


# ---------------------------------------------------------------------- rank 0: the executor
class TorchrunWorkerGroup(WorkerGroup):
    """A role's workers on every torchrun rank; rank 0's worker lives in the controller's process."""

    def __init__(self, *, executor: "TorchrunExecutor", role: Role, gid: int, worker: Any, mesh: Mesh) -> None:
        self.executor = executor
        self.role = role
        self.gid = gid
        self.worker = worker
        self.world_size = executor.session.world_size
        self.mesh = mesh  # split calls go over its data-parallel groups

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.executor._call(self, method, args, kwargs)

    def __repr__(self) -> str:
        return f"TorchrunWorkerGroup({self.role.value}, world_size={self.world_size})"


class TorchrunExecutor(Executor):
    """Runs every worker group SPMD over the processes torchrun started, the controller on rank 0.

    Built on a worker rank (any rank but 0), it does not return: the process serves rank 0's calls
    and exits (``SystemExit(0)``) when rank 0's interpreter exits.
    """

    @classmethod
    def is_controller(cls, config: ExecutorConfig) -> bool:
        """Rank 0 drives the run (its directory, its lock); the other ranks serve its calls."""
        return int(os.environ.get("RANK", "0")) == 0

    Config = TorchrunExecutorConfig

    def __init__(self, config: TorchrunExecutorConfig) -> None:
        super().__init__(config)
        self.config: TorchrunExecutorConfig = config
        self.session = _session(config)
        self._groups: list[TorchrunWorkerGroup] = []
        self._closed = False
        if self.session.rank != 0:
            self.session.serve()
            raise SystemExit(0)

    @property
    def world(self) -> WorldInfo:
        """Where rank 0's workers sit (every rank gets its own rank in the same world)."""
        import torch

        threads = self.config.threads_per_worker or torch.get_num_threads()
        return dataclasses.replace(self.session.world, threads=threads)

    def create_group(self, *, role: Role, factory: Callable[[WorldInfo], Any]) -> WorkerGroup:
        role = Role(role)
        s = self.session
        if self._closed:
            raise RuntimeError("this TorchrunExecutor was shut down; create a new one")
        world = self.world
        with s.lock:
            self._check_idle()
            gid = next(s._ids)
            s.send_all(("create", gid, role.value, factory, world.threads))
            try:
                built = self._finish(f"building the {role.value} worker", lambda: factory(world), mode="all")
            except BaseException:
                if not s.broken:
                    s.send_all(("close", [gid]))  # the ranks that built theirs
                raise
            worker = built[0]
            s.workers[gid], s.roles[gid] = worker, role.value
        mesh = Mesh.of([_mesh_place(worker), *built[1:]])  # every rank reports its place in the mesh
        group = TorchrunWorkerGroup(executor=self, role=role, gid=gid, worker=worker, mesh=mesh)
        self._groups.append(group)
        return group

    def create_rollout(self, *, engine: type[RolloutEngine], config: RolloutConfig, model: ModelSpec,
                       tokenizer: Any, actor: WorkerGroup) -> RolloutEngine:
        """The rollout engine, in the controller; one that would share the actor's weights gets a copy of its own.

        Over several processes the actor's parameters are sharded, and generating on them in place
        would need every rank in each generation step (``transformers`` syncs its ranks when the
        module is FSDP's). The copy on rank 0 is brought up to date by the weight sync after every
        step (the actor's weights, gathered from every rank), so it samples what one process would.
        """
        if self.session.world_size > 1 and engine.shares_actor_weights:
            return engine(config=config, model=model, tokenizer=tokenizer, actor=None)
        return engine(config=config, model=model, tokenizer=tokenizer, actor=actor)

    def _check_idle(self) -> None:
        if self.session.stream is not None:
            raise RuntimeError("a call on a torchrun worker group while the stream of another call (iter_weights) is "
                               "being consumed: every rank runs that stream's collectives, so consume it to the end "
                               "first")

    def _call(self, group: TorchrunWorkerGroup, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        fn = getattr(type(group.worker), method, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"{type(group.worker).__name__} ({group.role.value}) has no method {method!r}")
        if self._closed:
            raise RuntimeError(f"{group.role.value}.{method}: this torchrun executor was shut down")
        mode = dispatch_mode(type(group.worker), method)
        what = f"{group.role.value}.{method}"
        if inspect.isgeneratorfunction(fn):
            return self._stream(group, method, args, kwargs, mode, what)
        s = self.session
        with s.lock:
            self._check_idle()
            shards = None
            if mode == "split":
                shards = split_call(args, kwargs, group.mesh.dp_size, method=what,
                                    balance=self.config.balance_batches)
                calls = group.mesh.per_rank(shards)
                s.send([("call", group.gid, method, a, k, mode) for a, k in calls[1:]])
            else:
                calls = [(args, kwargs)]
                s.send_all(("call", group.gid, method, args, kwargs, mode))
            local_args, local_kwargs = calls[0]
            results = self._finish(what, lambda: getattr(group.worker, method)(*local_args, **local_kwargs),
                                   mode=mode)
        if isinstance(results, _Entered):
            return _SpmdContext(s, results)
        if mode == "split":
            return gather_split(group.mesh.read(results), real=shards.real, padded=shards.padded, order=shards.order)
        return results

    def _finish(self, what: str, fn: Callable[[], Any], *, mode: str = "broadcast") -> Any:
        """Run rank 0's part of a call, then collect every rank's outcome; raise the first error.

        Returns rank 0's result (``"broadcast"``; a context manager comes back entered) or every
        rank's, in rank order.
        """
        s = self.session
        try:
            local = fn()
            entered = _enter(local, what, mode)
            if entered is not None:
                local = _Entered(*entered)
        except Exception as exc:
            if s.gather((None, None, None), timeout=FAILURE_GRACE_S) is None:
                s.broken = True
                exc.add_note(f"raised in {what} on rank 0; the other torchrun ranks did not finish the call within "
                             f"{FAILURE_GRACE_S:g} s (torchrun stops them when this process exits)")
            raise
        try:
            statuses = s.gather((None, None, None))
        except Exception as exc:
            s.broken = True
            raise _lost(exc, f"waiting for {what}") from exc
        for rank, (error, text, _) in enumerate(statuses[1:], start=1):
            if error is not None or text is not None:
                if isinstance(local, _Entered):
                    local.abandon(s)  # not every rank entered it
                raise _remote_error(error, text, what=what, rank=rank, world=s.world_size)
        if mode == "broadcast":
            return local
        return [local, *(result for _, _, result in statuses[1:])]

    def _stream(self, group: TorchrunWorkerGroup, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                mode: str, what: str) -> Iterator[Any]:
        """A generator method: runs on every rank when consumed; rank 0's items (else every rank's, in order)."""
        s = self.session
        with s.lock:
            self._check_idle()
            s.send_all(("call", group.gid, method, args, kwargs, mode))
            local = getattr(group.worker, method)(*args, **kwargs)
            s.stream = local
        try:
            if mode == "broadcast":
                # Not `yield from`: closing this generator would close `local` too, and the rest
                # of its collectives must still run (below) while the other ranks run theirs.
                for item in local:
                    yield item
            else:
                items = list(local)
                for per_rank in [items, *(result for _, _, result in s.gather(None)[1:])]:
                    yield from per_rank
        except GeneratorExit:
            raise
        except BaseException:
            s.broken = True  # the other ranks wait in the stream's collectives, or are gone
            raise
        finally:
            try:
                for _ in local:  # the other ranks run the rest of the stream's collectives with us
                    pass
            except BaseException:
                s.broken = True
                raise
            finally:
                s.stream = None

    def shutdown(self) -> None:
        """Close this executor's workers on every rank; the processes stay for the script's next run."""
        if self._closed:
            return
        self._closed = True
        s = self.session
        gids = [g.gid for g in self._groups]
        if not gids:
            return
        with s.lock:
            if s.stream is not None:
                s.broken = True  # a stream left half-consumed: the other ranks wait inside its collectives
            if not s.broken and not s.stopped:
                try:
                    s.send_all(("close", gids))
                except Exception:  # the ranks are gone: nothing is left to close there
                    logger.debug("could not reach the torchrun worker ranks to close their workers", exc_info=True)
            for gid in gids:
                s._close_worker(gid)


class _Entered:
    """A context manager rank 0 entered together with the other ranks."""

    def __init__(self, cm: Any, value: Any) -> None:
        self.cm, self.value = cm, value

    def abandon(self, session: _Session) -> None:
        """Leave it on every rank that entered it (some did not)."""
        session.send_all(("exit_context",))
        self.cm.__exit__(None, None, None)


class _SpmdContext:
    """What a context-manager method returns on rank 0: leaving it lets every rank leave its own."""

    def __init__(self, session: _Session, entered: _Entered) -> None:
        self.session, self.entered = session, entered
        self._left = False

    def __enter__(self) -> Any:
        return self.entered.value

    def __exit__(self, *exc_info: Any) -> Any:
        if self._left:
            return None
        self._left = True
        s = self.session
        with s.lock:
            if not s.broken:
                s.send_all(("exit_context",))
            return self.entered.cm.__exit__(*exc_info)


# ---------------------------------------------------------------------- helpers
def _is_context(value: Any) -> bool:
    return hasattr(value, "__enter__") and hasattr(value, "__exit__")


def _mesh_place(worker: Any) -> WorldInfo:
    """A worker's place in its group's mesh: its own ``world`` when it keeps one (model-parallel
    backends), else this rank's (pure data parallel)."""
    world = getattr(worker, "world", None)
    if isinstance(world, WorldInfo):
        return world
    rank, size, _ = torchrun_world() or (0, 1, 0)
    return WorldInfo(rank=rank, world_size=size)


def _enter(value: Any, what: str, mode: str) -> tuple[Any, Any] | None:
    """Enter ``value`` if it is a context manager: ``(manager, what it gave)``; ``None`` otherwise."""
    if not _is_context(value):
        return None
    if mode != "broadcast":
        raise TypeError(f"{what} returns a context manager, which only a 'broadcast' method may")
    return value, value.__enter__()


def _portable(exc: BaseException) -> BaseException | None:
    """``exc`` if it survives pickling (errors whose constructors take other arguments do not)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return None
    return exc


def _remote_error(error: BaseException | None, text: str | None, *, what: str, rank: int, world: int) -> BaseException:
    where = f"raised in {what} on rank {rank} of {world} (a torchrun worker)"
    if error is not None:
        error.add_note(where)
        return error
    return RuntimeError(f"{what} failed on rank {rank} of {world}:\n{text}")


def _lost(exc: BaseException, doing: str) -> WorkerFailedError:
    return WorkerFailedError(f"a torchrun worker process stopped answering while {doing} ({exc}); torchrun's "
                             f"report names the rank that exited", role="worker", rank=-1, cause=str(exc))


class _fatal:
    """On an error in a stream or context (the ranks cannot agree on it), end this worker process."""

    def __init__(self, session: _Session, what: str) -> None:
        self.session, self.what = session, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
            _die(self.session, self.what, "".join(traceback.format_exception(exc)))
        return False


def _die(session: _Session, what: str, text: str) -> None:
    session.broken = True
    sys.stderr.write(f"[verl torchrun rank {session.rank}] {what} failed and the ranks cannot agree on it; "
                     f"this process exits so torchrun stops the run:\n{text}\n")
    sys.stderr.flush()
    os._exit(1)
