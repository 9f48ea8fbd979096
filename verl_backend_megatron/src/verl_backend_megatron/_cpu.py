"""Running Megatron-Core on a machine without CUDA: the few places it calls CUDA directly.

megatron-core 0.16.1 runs its model, tensor/pipeline/data-parallel, DDP, optimizer and
``dist_checkpointing`` code on CPU with gloo, except at these call sites (found by running it;
``../shared/notes/megatron-cpu.md`` has the measurements):

* ``rng``: ``tensor_parallel/random.py`` ``CudaRNGStatesTracker.add`` (line 235) and
  ``_get_cuda_rng_state``/``_set_cuda_rng_state`` read and write the CUDA generator; here they use
  the CPU generator. ``model_parallel_cuda_manual_seed`` and ``fork`` (dropout in tensor-parallel
  regions) then work unchanged.
* ``current_device``: ``torch.cuda.current_device()`` (175 call sites, e.g.
  ``rotary_pos_embedding.py:162`` ``inv_freq.to(torch.cuda.current_device())``, the DDP grad
  buffers, p2p shapes, the optimizer) returns ``"cpu"``.
* ``cuda_to_cpu``: tensors created with ``device="cuda"`` (``schedules.py:596`` and ``:2138``,
  ``optimizer.py:907``, ``clip_grads.py:103/174``, ``utils.py:1207``) are created on the CPU, and
  ``Tensor.cuda()`` (mbridge-style ``module.cuda()``) is a no-op. A ``TorchFunctionMode`` does this
  while :func:`megatron_on_cpu` is entered; every call site it rewrites is logged once, so a
  megatron-core upgrade that adds one shows up in the log (and in :func:`rewritten_call_sites`).
* ``cuda_type_str``: ``Tensor.type()`` called from megatron code answers ``torch.cuda.<T>`` for a
  CPU tensor: ``clip_grads.py:167`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'`` and
  ``distrib_optimizer.py:361/420/582`` accept only ``torch.cuda.*Tensor`` parameters.
* ``cuda_sync``: ``torch.cuda.synchronize()`` (``dist_checkpointing/strategies/filesystem_async.py:230``
  ``preload_tensors``) does nothing: CPU work is synchronous.

The distributed optimizer's checkpoint path adds ``distrib_optimizer.py:1089`` and ``optimizer.py:481/485``
to the sites these patches rewrite (``test_megatron.py``'s tripwire test lists every known site).

The rest is configuration, set where the model is built: the local (non-TransformerEngine) layer
spec, ``use_cpu_initialization``, fusions off, an explicit causal mask (``transformer/utils.py:35``
makes its default one with ``device="cuda"``), ``batch_p2p_comm=False`` and
``variable_seq_lengths=False`` (both would call ``torch.cuda.synchronize`` in ``p2p_communication.py``).

Nothing here is applied when CUDA is available: on a GPU machine Megatron runs unpatched on NCCL.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["install", "megatron_on_cpu", "needed", "rewritten_call_sites", "PATCHES"]

logger = logging.getLogger(__name__)

#: The patches, by name (see the module docstring for the call site each answers).
PATCHES = ("rng", "current_device", "cuda_to_cpu", "cuda_type_str", "cuda_sync")

_installed = False
_sites: dict[str, str] = {}  # "megatron/core/file.py:line" -> what was rewritten there
_MEGATRON_DIR = None


def needed() -> bool:
    """Whether the shims are needed: no CUDA device (the same backend runs unpatched on a GPU)."""
    return not torch.cuda.is_available()


def rewritten_call_sites() -> dict[str, str]:
    """Megatron call sites the shims have rewritten so far (``file:line`` -> what)."""
    return dict(_sites)


def _megatron_caller() -> str | None:
    """``megatron/.../file.py:line`` of the innermost megatron frame on the stack, if any."""
    global _MEGATRON_DIR
    if _MEGATRON_DIR is None:
        import megatron.core

        _MEGATRON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(megatron.core.__file__)))
    frame = inspect.currentframe()
    try:
        frame = frame.f_back if frame else None
        while frame is not None:
            filename = frame.f_code.co_filename
            if filename.startswith(_MEGATRON_DIR) or "/mbridge/" in filename:
                return f"{os.path.relpath(filename, os.path.dirname(_MEGATRON_DIR))}:{frame.f_lineno}"
            frame = frame.f_back
        return None
    finally:
        del frame


def _note(what: str) -> None:
    site = _megatron_caller() or "<outside megatron>"
    if site not in _sites:
        _sites[site] = what
        logger.info("megatron CPU shim: %s at %s", what, site)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """``cuda_to_cpu`` and ``cuda_type_str``: CUDA placements become CPU ones inside megatron code."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            _note("Tensor.cuda() kept on cpu")
            return args[0]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            _note(f"{getattr(func, '__name__', func)}(device={kwargs['device']!r}) -> cpu")
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            _note(f"Tensor.to({args[1]!r}) -> cpu")
            args = (args[0], "cpu", *args[2:])
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(result, str):
            if result.startswith("torch.") and not result.startswith("torch.cuda.") and _megatron_caller():
                _note(f"Tensor.type() answered torch.cuda.{result[6:]}")
                return "torch.cuda." + result[6:]
        return result


def install() -> None:
    """Apply the process-wide patches (``rng``, ``current_device``, ``cuda_sync``) once; a no-op with CUDA."""
    global _installed
    if _installed or not needed():
        return
    from megatron.core.tensor_parallel import random as mrandom

    # rng: random.py:41/72 read and write the CUDA generator; the tracker keeps CPU generator states.
    def get_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(tracker: Any, name: str, seed: int) -> None:
        # random.py:217-240 (CudaRNGStatesTracker.add) with the CPU generator in place of the CUDA one.
        tracker._is_initialized = True
        if seed in tracker.seeds_:
            raise Exception(f"seed {seed} already exists")
        tracker.seeds_.add(seed)
        if name in tracker.states_:
            raise Exception(f"cuda rng state {name} already exists")
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        tracker.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add
    # current_device: 175 call sites such as rotary_pos_embedding.py:162 inv_freq.to(torch.cuda.current_device()).
    torch.cuda.current_device = lambda: "cpu"
    # cuda_sync: filesystem_async.py:230 (dist_checkpointing save) synchronizes before reading tensors.
    torch.cuda.synchronize = lambda device=None: None
    _installed = True
    logger.info("megatron CPU shims installed (no CUDA): %s", ", ".join(PATCHES))


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Run megatron code on the CPU: the process patches plus ``cuda_to_cpu`` for the duration."""
    if not needed():
        yield
        return
    install()
    with _CudaToCpu():
        yield


@contextlib.contextmanager
def model_compute() -> Iterator[None]:
    """Inside :func:`megatron_on_cpu`, run the model's own forward without the ``cuda_to_cpu`` mode.

    The GPT forward makes no CUDA placements of its own (RoPE's ``current_device`` is patched
    process-wide, the causal mask is passed in), and a ``TorchFunctionMode`` dispatches every torch
    call through Python: on the ~32M bench model that cost about a quarter of the update.
    """
    from torch.overrides import _get_current_function_mode, _pop_mode_temporarily

    if not isinstance(_get_current_function_mode(), _CudaToCpu):
        yield
        return
    with _pop_mode_temporarily():
        yield
