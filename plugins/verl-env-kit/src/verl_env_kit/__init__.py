"""The environment kit for verl: the multi-turn loop environments run in.

Environment plugins subclass :class:`~verl_env_kit.environment.MultiTurnEnvironment` (instead of
``verl_core.contracts.Environment``); its :meth:`run_episodes` is the episode runner the core's
rollout stage and validation call on the run's environment class. :mod:`verl_env_kit.episodes` holds
the loop and the chat-template helpers (:func:`~verl_env_kit.episodes.render_tokens`,
:func:`~verl_env_kit.episodes.check_append_only`).

Importing this package imports no torch; running episodes does.
"""

from verl_env_kit.environment import MultiTurnEnvironment

__version__ = "0.1.0"

__all__ = ["MultiTurnEnvironment"]
