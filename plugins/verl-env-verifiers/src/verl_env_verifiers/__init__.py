"""verifiers environments in verl: :class:`verl_env_verifiers.env.VerifiersEnvironment` (``verl run --env
verifiers``) and their tasks as prompt rows (:class:`verl_env_verifiers.data.VerifiersData`, ``verifiers:<id>``).

Nothing is imported here: verl imports ``verl_env_verifiers.env`` (and verifiers) only when it is selected.
"""

__version__ = "0.1.0"
