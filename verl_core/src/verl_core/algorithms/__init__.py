"""Built-in algorithms (GRPO, PPO) and the reusable pieces in :mod:`.functional`."""
