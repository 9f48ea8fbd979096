"""Rule rewards for verl: ``gsm8k``, ``math`` (math-verify) and ``exact_match``; see :mod:`verl_reward_rules.rules`.

Nothing heavy is imported here or there (math-verify loads when the ``math`` reward is built):
these run inside the reward worker processes.
"""

from verl_reward_rules.rules import (
    ExactMatchConfig,
    ExactMatchReward,
    GSM8KConfig,
    GSM8KReward,
    MathConfig,
    MathReward,
    extract_gsm8k_answer,
    last_boxed,
    last_number,
    normalize_number,
    strip_boxed,
)

__version__ = "0.1.0"

__all__ = [
    "ExactMatchConfig",
    "ExactMatchReward",
    "GSM8KConfig",
    "GSM8KReward",
    "MathConfig",
    "MathReward",
    "extract_gsm8k_answer",
    "last_boxed",
    "last_number",
    "normalize_number",
    "strip_boxed",
]
