"""FSDP2 training backend for verl."""

__version__ = "0.1.0"

__all__ = ["FSDPBackend", "FSDPConfig", "FSDPWorker"]


def __getattr__(name: str):
    # Keep `import verl_backend_fsdp` light: torch.distributed loads only when used.
    if name in __all__:
        from verl_backend_fsdp import backend

        return getattr(backend, name)
    raise AttributeError(name)
