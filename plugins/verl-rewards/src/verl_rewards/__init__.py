"""The reward stage of a verl run: the ``default`` scorer (``verl.scorers``) and how rewards are loaded.

* :class:`~verl_rewards.manager.RewardManager` decodes responses and sums weighted reward components,
  routed per row by ``data_source``, with a reward model as one possible component;
* :mod:`verl_rewards.functions`: reward functions by name (entry points, ``file:path.py:fn``), per sample
  or per batch, sync or ``async``, configured from ``reward.options`` (:func:`per_sample`, :func:`batch_reward`);
* :mod:`verl_rewards.workers`: rewards in worker processes that are killed at ``reward.timeout``;
* :class:`~verl_rewards.config.RewardConfig`: the ``[reward]`` section.

Importing this package costs no torch (reward worker processes import it); :class:`RewardManager`
loads on first use.
"""

from verl_core.contracts import RewardError, RewardInput
from verl_rewards.config import REWARD_MODEL_COMPONENT, RewardComponent, RewardConfig
from verl_rewards.functions import RewardSpecError, batch_reward, load_reward, per_sample, resolve_data_source

__version__ = "0.1.0"

__all__ = [
    "REWARD_MODEL_COMPONENT",
    "RewardComponent",
    "RewardConfig",
    "RewardError",
    "RewardInput",
    "RewardManager",
    "RewardSpecError",
    "batch_reward",
    "load_reward",
    "per_sample",
    "resolve_data_source",
]


def __getattr__(name: str):
    if name == "RewardManager":
        from verl_rewards.manager import RewardManager

        return RewardManager
    raise AttributeError(f"module 'verl_rewards' has no attribute {name!r}")
