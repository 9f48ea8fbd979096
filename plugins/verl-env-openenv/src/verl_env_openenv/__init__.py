"""OpenEnv environments in verl: :class:`verl_env_openenv.env.OpenEnvEnvironment` (``verl run --env openenv``).

Nothing is imported here: verl imports ``verl_env_openenv.env`` (and OpenEnv's client) only when the
environment is selected.
"""

__version__ = "0.1.0"
