"""Vision-language RL for verl.

* ``vision`` (``verl.environments``): :class:`~verl_env_vision.env.VisionEnvironment`, a one-turn
  environment whose built-in task ``verl run --env vision`` runs;
* the task (:mod:`verl_env_vision.task`): "what colour is the largest shape?" on images drawn
  locally with PIL, a tiny Qwen2-VL (the real architecture, built here) with a supervised warm
  start, and a rule reward; ``builtin:vision-shapes-blank`` is the text-only control.
"""

__version__ = "0.1.0"
