"""Tool-calling environments for verl.

* ``tools`` (``verl.environments``): :class:`~verl_env_tools.env.ToolsEnvironment`, Hermes/Qwen
  ``<tool_call>`` parsing (or a parser of your own), a calculator and a sandboxed Python tool
  (:mod:`verl_env_tools.sandbox`);
* the built-in task ``verl run --env tools`` runs (:mod:`verl_env_tools.task`): two-digit
  multiplication with a calculator, its tiny model and its reward.
"""

__version__ = "0.1.0"
