"""reasoning-gym tasks for verl: :mod:`verl_reasoning_gym.tasks` (imported only when selected)."""

__version__ = "0.1.0"
