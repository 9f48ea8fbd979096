"""A pure-PyTorch stand-in for SGLang's kernel package, for serving on a CPU.

PyPI has only CUDA builds of SGLang's kernel package (``sglang-kernel``, import name
``sgl_kernel``), and with ``SGLANG_USE_CPU_ENGINE=1`` sglang imports a few names from it at module
level. This package provides exactly those names and nothing else:

* two helpers of the KV-cache bookkeeping, written here in plain torch
  (:func:`assign_req_to_token_pool_cpu`, :func:`copy_all_layer_kv_cache_cpu`);
* the CPU helpers of speculative decoding, which raise :class:`NotImplementedError` (verl never
  enables speculative decoding).

It registers no ``torch.ops.sgl_kernel`` operators. SGLang uses its AMX kernels only when the CPU
has AMX *and* ``torch.ops.sgl_kernel.convert_weight_packed`` exists, so with this package every
layer takes its native-torch path on every CPU (attention: ``torch_native``), the same on an
Intel CPU with AMX as on an AMD one without. Any other name raises :class:`AttributeError`, so
``from sgl_kernel import X`` fails with ImportError and SGLang's own fallbacks apply.

The engine puts this package's parent directory first on the server's ``PYTHONPATH`` when it
serves on a CPU, so that SGLang's spawned scheduler and detokenizer processes import it too.
With ``VERL_SGL_KERNEL_LOG=FILE`` every name SGLang asks for and does not get is appended to FILE:
after an sglang upgrade, a new name there is a new import to answer.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Sequence

import torch

__version__ = "0.0.0+verl.cpu"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """For request i: ``req_to_token[req_pool_indices[i], start_i:end_i]`` takes the next
    ``end_i - start_i`` entries of the flat ``out_cache_loc`` (called from
    ``sglang/srt/mem_cache/allocation.py``)."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + count].to(req_to_token.dtype)
        taken += count


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every KV buffer (its base address and row stride in bytes) copy row ``src_loc[j]`` onto
    row ``tgt_loc[j]`` (called from ``sglang/kernels/ops/kvcache/cache_move.py``)."""
    targets, sources = tgt_loc.tolist(), src_loc.tolist()
    if not targets:
        return
    rows = max(max(targets), max(sources)) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_char * (rows * stride)).from_address(address)
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        view[targets] = view[sources]


def _unsupported(name: str):
    def call(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"sgl_kernel.{name}: speculative decoding is not supported by verl's CPU "
                                  f"stand-in for SGLang's kernel package")

    call.__name__ = name
    return call


_SPECULATIVE: Sequence[str] = (
    "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu", "rotate_input_ids_cpu", "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
)
globals().update({name: _unsupported(name) for name in _SPECULATIVE})


def __getattr__(name: str) -> Any:
    log = os.environ.get("VERL_SGL_KERNEL_LOG")
    if log and not name.startswith("__"):
        with open(log, "a") as out:
            out.write(f"{os.getpid()} sgl_kernel.{name}\n")
    raise AttributeError(f"module 'sgl_kernel' has no attribute {name!r} (verl's CPU stand-in)")
