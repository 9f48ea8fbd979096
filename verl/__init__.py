"""verl: reinforcement-learning post-training for language models.

This package re-exports the public Python API of ``verl-core`` (see :mod:`verl_core`), the algorithms
of ``verl-algorithms`` (``GRPO``, ``PPO``, ``PolicyGradient``, ``PPOFamilyConfig``) and the reward
decorators of ``verl-rewards`` (``per_sample``, ``batch_reward``), which ``pip install verl`` installs,
and adds ``PPOTrainer``, ``GRPOTrainer`` and ``DataConfig`` (:mod:`verl.trainers`), a thin layer over
:class:`~verl_core.trainer.Trainer` in the shape many articles show. ``ExternalInferenceClient`` and
``external_generate`` (generation on a running vLLM server) come from ``verl-rollout-vllm`` when it is
installed (``pip install 'verl[vllm]'``).
"""

__version__ = "0.1.0"

import verl_core as _core

#: Names from the default plugins and from this package, by the module that provides them (loaded on first use).
_PLUGIN_EXPORTS = {
    "GRPO": "verl_algorithms.grpo",
    "PPO": "verl_algorithms.ppo",
    "PolicyGradient": "verl_algorithms.base",
    "PPOFamilyConfig": "verl_algorithms.base",
    "per_sample": "verl_rewards",
    "batch_reward": "verl_rewards",
    "PPOTrainer": "verl.trainers",
    "GRPOTrainer": "verl.trainers",
    "DataConfig": "verl.trainers",
    "ExternalInferenceClient": "verl_rollout_vllm.client",
    "external_generate": "verl_rollout_vllm.client",
}

#: Where the names from distributions that ``pip install verl`` leaves out come from.
_OPTIONAL = {"verl_rollout_vllm.client": "verl-rollout-vllm (pip install verl-rollout-vllm, or 'verl[vllm]')"}


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module.split(".")[0]) is not None


# Names of a distribution that is not installed stay out of `from verl import *` (which would fail on them).
__all__ = [*(name for name in _core.__all__ if name != "__version__"),
           *(name for name, module in _PLUGIN_EXPORTS.items() if module not in _OPTIONAL or _installed(module))]


def __getattr__(name: str):
    module = _PLUGIN_EXPORTS.get(name)
    if module is not None:
        import importlib

        try:
            return getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as exc:
            if module not in _OPTIONAL or not module.startswith(str(exc.name)):
                raise
            raise ImportError(f"verl.{name} comes from {_OPTIONAL[module]}, which is not installed") from exc
    if name in _core.__all__:
        return getattr(_core, name)
    raise AttributeError(f"module 'verl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
