"""OpenEnv environments written with OpenEnv's own server API, to try and test the adapter with.

* :mod:`verl_env_openenv.examples.addition`: two-digit addition (``launch =
  "verl_env_openenv.examples.addition:app"``).
"""
