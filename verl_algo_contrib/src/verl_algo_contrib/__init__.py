"""verl-algo-contrib: RL and preference algorithms for verl, each a plugin found by entry point.

Every algorithm is a :class:`verl_core.contracts.Algorithm` with its own ``Config`` dataclass
(defaults from its paper), selected with ``verl run --algo NAME``:

=========================  =====================================================================
name                       algorithm
=========================  =====================================================================
``dapo``                   :class:`~verl_algo_contrib.dapo.DAPO`
``gspo``                   :class:`~verl_algo_contrib.gspo.GSPO`
``rloo``                   :class:`~verl_algo_contrib.rloo.RLOO`
``reinforce_pp``           :class:`~verl_algo_contrib.reinforce_pp.ReinforcePlusPlus`
``reinforce_pp_baseline``  :class:`~verl_algo_contrib.reinforce_pp.ReinforcePlusPlusBaseline`
``remax``                  :class:`~verl_algo_contrib.remax.ReMax`
``drgrpo``                 :class:`~verl_algo_contrib.drgrpo.DrGRPO`
``cispo``                  :class:`~verl_algo_contrib.cispo.CISPO`
``clip_cov``, ``kl_cov``   :mod:`verl_algo_contrib.entropy_cov` (Clip-Cov, KL-Cov)
``gpg``                    :class:`~verl_algo_contrib.gpg.GPG`
``opo``                    :class:`~verl_algo_contrib.opo.OPO`
``spin``                   :class:`~verl_algo_contrib.spin.SPIN`
``dpo``, ``kto``, ``orpo`` :mod:`verl_algo_contrib.preference` (offline, from preference data)
=========================  =====================================================================

The pieces they are made of (advantage estimators, losses, filters, reward shaping, preference
losses) are plain functions in :mod:`verl_algo_contrib.functional`, for new algorithms to reuse.
Importing this package imports no algorithm module: the registry loads each one on selection.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
