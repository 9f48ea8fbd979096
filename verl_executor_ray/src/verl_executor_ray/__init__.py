"""Ray executor for verl: worker groups as Ray actors on named resource pools.

Selected with ``verl run --executor ray`` (``executor.name = "ray"``). Ray itself is imported
only when the first worker group starts.
"""

__version__ = "0.1.0"

__all__ = ["RayExecutor", "RayExecutorConfig", "RayWorkerGroup", "RayRollout"]


def __getattr__(name: str):
    if name == "RayExecutorConfig":
        from verl_executor_ray.config import RayExecutorConfig

        return RayExecutorConfig
    if name in __all__:
        from verl_executor_ray import executor

        return getattr(executor, name)
    raise AttributeError(name)
