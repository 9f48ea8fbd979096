"""A rollout engine built and run in a child process of its own (``trainer.producer = "process"``, issue 19).

In ``colocate_async`` the producer generates the next batch while the trainer updates. An engine that
generates in this process (the Hugging Face rollout) would share the interpreter lock and torch's one
intra-op thread pool with the trainer, so the two sides never really run at once. :class:`HostedEngine`
builds the engine in a spawned child instead, with its own thread budget, and forwards the contract's
calls to it over a pipe; the producer thread in the trainer process only waits on that pipe.

Weight sync goes through shared memory. The overlapping modes publish each weight version straight into
a block of shared memory (:meth:`HostedEngine.snapshot`, a :class:`SharedWeights`); loading it hands the
child a handle to that block, and an engine that can (``adopt_weights``, the HF rollout) uses it as its
parameters without a copy. A version is never written after it is published, and the child drops its
mapping when it adopts the next one, so the run holds one copy of each live version and no other
(bench/results/async_memory.md). Other weights (any iterable) go the older way: the first
:meth:`HostedEngine.load_weights` moves a copy into shared-memory tensors that the child maps once; each
later sync copies the new weights into them and tells the child to load them into its model. The child
only reads them inside that call, so a sync never races a generation.

The child never outlives its parent: it ignores Ctrl-C (the parent shuts it down), and a watchdog thread
ends it when its parent process is gone, however the parent died (``kill -9`` included).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import threading
import time
import traceback
from typing import Any, Iterable, Sequence

import torch

from verl_core.contracts import ModelSpec, RolloutConfig, RolloutEngine, RolloutOutput, SamplingParams, WorldInfo
from verl_trainer_async.producer import snapshot_weights

__all__ = ["HostedEngine", "SharedWeights", "shared_copy"]

logger = logging.getLogger(__name__)

# How often the parent checks that the child is alive while it waits for an answer, and the child
# that its parent is.
_POLL_S = 0.5


class SharedWeights(list):
    """A weight version in one block of shared memory: ``(name, tensor)`` pairs whose tensors are views of
    ``storage`` (bytes) as ``layout`` says (``(name, offset, shape, dtype)``; tied weights share an offset).
    A process it is sent to maps the block, not a copy (:meth:`HostedEngine.load_weights`)."""

    def __init__(self, storage: torch.Tensor, layout: list[tuple[str, int, tuple[int, ...], torch.dtype]]) -> None:
        super().__init__((name, _view(storage, offset, shape, dtype)) for name, offset, shape, dtype in layout)
        self.storage = storage
        self.layout = layout


def _view(storage: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    count = 1
    for size in shape:
        count *= size
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return storage[offset:offset + nbytes].view(dtype).view(shape)


def shared_copy(weights: Iterable[tuple[str, torch.Tensor]]) -> SharedWeights:
    """A copy of ``weights`` (from any device) in one new block of shared memory, each tensor 64-byte aligned;
    a tensor that appears under several names (tied embeddings) is stored once.

    A new block is paged in as the copy first touches it (2.6-4.5 s a version at the 0.5B shape on 2 busy
    cores, against 0.4 s into a reused one); keeping a dropped version's block for the next one held a third
    version's memory and, with the producer often still on the version before, was reused every other step
    only, with no step-time difference measured (bench/results/async_memory.md). So a block lives as long
    as its version.
    """
    weights = [(name, tensor.detach()) for name, tensor in weights]
    layout: list[tuple[str, int, tuple[int, ...], torch.dtype]] = []
    placed: dict[tuple[Any, ...], int] = {}
    sources: list[tuple[int, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tuple(tensor.stride()))
        if key not in placed:
            placed[key] = size
            sources.append((size, tensor))
            size += -(-tensor.numel() * tensor.element_size() // 64) * 64
        layout.append((name, placed[key], tuple(tensor.shape), tensor.dtype))
    size = max(size, 64)
    _check_room(size)
    if hasattr(torch.UntypedStorage, "_new_shared"):  # straight into shared memory
        storage = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))
    else:  # a private torch helper: without it, a block in ordinary memory moved to shared memory
        storage = torch.empty(size, dtype=torch.uint8).share_memory_()
    with torch.no_grad():
        for offset, tensor in sources:
            _view(storage, offset, tuple(tensor.shape), tensor.dtype).copy_(tensor)
    return SharedWeights(storage, layout)


def _check_room(size: int, shm: str = "/dev/shm") -> None:
    """Refuse a version that does not fit in shared memory: a block mapped past the end of ``/dev/shm`` kills the
    process with SIGBUS at the first touch instead of raising (a container's default is 64 MiB)."""
    try:
        free = shutil.disk_usage(shm).free
    except OSError:  # no /dev/shm to ask (not Linux): torch reports what it cannot allocate
        return
    if free < size:
        raise RuntimeError(f"trainer.producer='process': a weight version needs {size / 2**30:.2f} GiB of shared memory "
                           f"and {shm} has {free / 2**30:.2f} GiB free; give the container more (docker run "
                           f"--shm-size, at least two versions at max_staleness=1) or set trainer.producer='thread'")


class HostedEngine(RolloutEngine):
    """``engine_cls`` built in a spawned child process; the calls of the rollout contract are forwarded to it.

    Args:
        engine_cls: the rollout engine class (importable: it is sent to the child by reference).
        config, model, tokenizer: what the engine is built with (sent by value, so the child owns its copy
            of ``model.module``; the parent's objects are never shared with it).
        threads: torch threads in the child.
        world: the child's engine is built with it (its ``device``: where it generates, e.g. ``"cuda"``).
        start_timeout: seconds the child may take to import and build the engine.
    """

    def __init__(self, engine_cls: type[RolloutEngine], *, config: RolloutConfig, model: ModelSpec, tokenizer: Any,
                 threads: int = 1, world: WorldInfo = WorldInfo(), start_timeout: float = 600.0) -> None:
        super().__init__(config=config, model=ModelSpec(path=model.path, tokenizer_path=model.tokenizer_path,
                                                        dtype=model.dtype, trust_remote_code=model.trust_remote_code),
                         tokenizer=tokenizer, world=world)
        self.engine_name = engine_cls.__name__
        # The hosted engine's capabilities; it has weights of its own, so a sync is a real copy.
        for flag in ("supports_memory_release", "follows_actor_weights", "seeded_sampling", "accepts_multi_modal"):
            setattr(self, flag, getattr(engine_cls, flag))
        try:
            payload = pickle.dumps((engine_cls, config, model, tokenizer, world), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"trainer.producer='process' sends the rollout engine to a child process, but "
                f"{engine_cls.__module__}.{engine_cls.__qualname__}, its config, model or tokenizer does not "
                f"pickle ({exc}); define the engine at module level, or set trainer.producer='thread'") from exc
        import torch.multiprocessing as mp  # registers the shared-memory tensor reductions on the pipe

        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child_conn, payload, threads, os.getpid()), daemon=True,
                                 name=f"verl-rollout-{self.engine_name}")
        self._proc.start()
        child_conn.close()
        self._lock = threading.Lock()
        self._shared: list[tuple[str, torch.Tensor]] | None = None
        self._closed = False
        started = time.perf_counter()
        self._call("ready", timeout=start_timeout)
        logger.info("rollout engine %s started in process %d (%d torch threads) in %.1f s", self.engine_name,
                    self._proc.pid, self.child_info()["torch_threads"], time.perf_counter() - started)

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self._proc.pid

    def child_info(self) -> dict[str, Any]:
        """The child's ``pid``, the ``torch_threads`` it generates with and the ``device`` of its engine."""
        return self._call("info")

    # ------------------------------------------------------------------ the contract
    def generate(self, prompt_ids: Sequence[Sequence[int]], *, sampling: SamplingParams) -> RolloutOutput:
        return self._call("generate", list(prompt_ids), sampling)

    def snapshot(self, actor: Any) -> list[tuple[str, torch.Tensor]]:
        """A version of ``actor``'s weights to publish: in shared memory that :meth:`load_weights` hands over
        without a copy, for a child that generates on the CPU. A child on a GPU copies whatever it is given onto
        it, so there the version is the producer's usual clone on the trainer's device (fast, no host memory
        paged in during the trainer's step), sent through the staging buffer when loaded."""
        if self.world.device != "cpu":
            return snapshot_weights(actor)
        return shared_copy(actor.iter_weights())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if isinstance(weights, SharedWeights):  # a published version: the child maps its block
            self._shared = None
            self._call("adopt", weights.storage, weights.layout, forking=True)
            return
        weights = [(name, tensor.detach()) for name, tensor in weights]
        with torch.no_grad():
            if self._shared is not None and _same_layout(self._shared, weights):
                for (_, dst), (_, src) in zip(self._shared, weights):
                    dst.copy_(src)
                self._call("load")
                return
            # First sync (or a changed layout): new shared-memory tensors, mapped by the child once.
            _check_room(sum(tensor.numel() * tensor.element_size() for _, tensor in weights))
            self._shared = [(name, tensor.to("cpu", copy=True).share_memory_()) for name, tensor in weights]
        self._call("attach", self._shared, forking=True)
        self._call("load")

    def release_memory(self) -> None:
        self._call("release_memory")

    def reacquire_memory(self) -> None:
        self._call("reacquire_memory")

    def close(self) -> None:
        """Stop the child: a clean shutdown when it is idle; when a call is still running (the producer is
        being stopped mid-batch), it is terminated and that call fails."""
        if self._closed:
            return
        self._closed = True
        if self._lock.acquire(timeout=0.1):
            try:
                if self._proc.is_alive():
                    self._exchange("close", (), forking=False, timeout=30.0)
            except Exception as exc:  # a child that cannot close cleanly is stopped below
                logger.warning("rollout process %s did not close cleanly: %s", self._proc.pid, exc)
            finally:
                self._lock.release()
            self._proc.join(10.0)
        for stop in (self._proc.terminate, self._proc.kill):
            if not self._proc.is_alive():
                break
            stop()
            self._proc.join(5.0)
        self._shared = None

    def __del__(self) -> None:  # a trainer that forgot close() still stops its child
        try:
            if not self._closed and self._proc.is_alive():
                self._proc.kill()
        except Exception:
            pass

    # ------------------------------------------------------------------ plumbing
    def _call(self, op: str, *args: Any, forking: bool = False, timeout: float | None = None) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the rollout process of {self.engine_name} is closed")
            return self._exchange(op, args, forking=forking, timeout=timeout)

    def _exchange(self, op: str, args: tuple, *, forking: bool, timeout: float | None) -> Any:
        """Send one call and wait for its answer (lock held)."""
        message = (op, args)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:  # a child that died before the call breaks the pipe on sending (BrokenPipeError: an OSError)
            if forking:  # shared-memory tensors travel as handles (torch's reductions)
                self._conn.send(message)
            else:  # everything else by value: no file descriptors to keep alive for small messages
                self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
            while not self._conn.poll(_POLL_S):
                if not self._proc.is_alive():
                    raise RuntimeError(f"the rollout process of {self.engine_name} (pid {self._proc.pid}) died "
                                       f"with exit code {self._proc.exitcode} during {op!r}")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the rollout process of {self.engine_name} did not answer {op!r} within "
                                       f"{timeout:.0f} s")
            status, value = self._conn.recv()
        except TimeoutError:  # an OSError too, but the child is alive: not a closed pipe
            raise
        except (EOFError, OSError) as exc:
            self._proc.join(5.0)
            raise RuntimeError(f"the rollout process of {self.engine_name} (pid {self._proc.pid}) closed its "
                               f"pipe during {op!r} (exit code {self._proc.exitcode})") from exc
        if status == "ok":
            return value
        error, text = value
        if error is None:
            raise RuntimeError(f"the rollout process of {self.engine_name} failed in {op!r}:\n{text}")
        error.add_note(f"(raised in the rollout process of {self.engine_name}, pid {self._proc.pid}:)\n{text}")
        raise error


def _same_layout(shared: list[tuple[str, torch.Tensor]], weights: list[tuple[str, torch.Tensor]]) -> bool:
    return len(shared) == len(weights) and all(
        a == b and x.shape == y.shape and x.dtype == y.dtype for (a, x), (b, y) in zip(shared, weights))


def _watch_parent(parent_pid: int) -> None:
    """End this process when the parent is gone (it was re-parented), however the parent died."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(_POLL_S)


def _serve(conn: Any, payload: bytes, threads: int, parent_pid: int) -> None:
    """The child: build the engine, then answer calls until ``close``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes us
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="verl-parent-watch").start()
    torch.set_num_threads(threads)
    engine: RolloutEngine | None = None
    shared: list[tuple[str, torch.Tensor]] = []
    try:
        engine_cls, config, model, tokenizer, world = pickle.loads(payload)
        engine = engine_cls(config=config, model=model, tokenizer=tokenizer, world=world)
    except BaseException as exc:
        _reply_error(conn, exc)
        return
    while True:
        try:
            op, args = conn.recv()
        except EOFError:  # the parent closed the pipe
            break
        try:
            if op == "ready":
                result = None
            elif op == "info":
                result = {"pid": os.getpid(), "torch_threads": torch.get_num_threads(), "device": engine.world.device}
            elif op == "generate":
                result = engine.generate(args[0], sampling=args[1])
            elif op == "attach":
                shared = args[0]
                result = None
            elif op == "load":
                _own_parameters(engine)  # never write into a published version the engine adopted
                engine.load_weights(iter(shared))
                result = None
            elif op == "adopt":
                _adopt(engine, SharedWeights(*args))
                result = None
            elif op == "release_memory":
                result = engine.release_memory()
            elif op == "reacquire_memory":
                result = engine.reacquire_memory()
            elif op == "close":
                engine.close()
                conn.send(("ok", None))
                break
            else:
                raise ValueError(f"unknown rollout-process call {op!r}")
        except BaseException as exc:
            _reply_error(conn, exc)
            continue
        conn.send_bytes(pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL))
    conn.close()


def _adopt(engine: RolloutEngine, weights: SharedWeights) -> None:
    """Load a published version: as the engine's own parameters where it can take them (no copy; the
    version is never written while it is published), a copy otherwise. Memory the engine's earlier weights
    held goes back to the system (glibc keeps freed heap memory otherwise)."""
    adopt = getattr(engine, "adopt_weights", None)
    if adopt is None:
        engine.load_weights(iter(weights))
        return
    adopt(weights)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _own_parameters(engine: RolloutEngine) -> None:
    """Give parameters that are views of an adopted version (shared memory) storage of their own again."""
    for module in [m for m in vars(engine).values() if isinstance(m, torch.nn.Module)]:
        for param in module.parameters():
            if param.device.type == "cpu" and param.is_shared():
                param.data = param.data.clone()


def _reply_error(conn: Any, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))
        value = (exc, text)
    except Exception:  # an exception that does not pickle comes back as its traceback
        value = (None, text)
    try:
        conn.send(("error", value))
    except Exception:
        pass
