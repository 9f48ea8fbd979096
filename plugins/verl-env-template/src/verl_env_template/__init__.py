"""A template verl environment: :class:`verl_env_template.env.MyEnvironment` (``verl run --env my_env``).

Nothing is imported here: verl imports ``verl_env_template.env`` only when the environment is selected.
"""

__version__ = "0.1.0"
