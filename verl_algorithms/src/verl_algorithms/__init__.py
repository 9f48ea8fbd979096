"""verl-algorithms: verl's first-party algorithms, GRPO and PPO, and the pieces they are made of.

Each algorithm is a plugin found by entry point (``verl.algorithms``), like any third party's,
and selected with ``verl run --algo NAME``:

=========  ====================================================================================
name       algorithm
=========  ====================================================================================
``grpo``   :class:`~verl_algorithms.grpo.GRPO`: group-relative advantages, no critic (the default)
``ppo``    :class:`~verl_algorithms.ppo.PPO`: a learned critic and GAE, the KL in the rewards
=========  ====================================================================================

:mod:`verl_algorithms.base` holds the policy-gradient family both belong to
(:class:`~verl_algorithms.base.PPOFamilyConfig`, :class:`~verl_algorithms.base.PolicyGradient`),
and :mod:`verl_algorithms.functional` the loss math (advantage and KL estimators, aggregation modes,
the PPO-clip loss) that other algorithm plugins (verl-algo-contrib, yours) reuse.
Importing this package imports no algorithm module: the registry loads each one on selection.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
