"""Rule rewards: GSM8K, MATH (equivalence checked with math-verify) and exact match.

Each is registered under ``verl.rewards`` in this package's ``pyproject.toml`` and is a per-sample
scorer (``__call__(response, ground_truth)``). ``data_sources`` names the datasets' ``data_source``
values a reward scores when ``reward.name = "auto"`` (a data_source equal to the reward's name needs
no entry). The answer extractors are public because ``verl data prepare`` uses the same ones to take
ground truths from the datasets' own solutions, so a prepared row and a response are read by the
same rules.

Nothing heavy is imported at module level: these run inside the reward worker processes.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

__all__ = [
    "GSM8KReward",
    "GSM8KConfig",
    "MathReward",
    "MathConfig",
    "ExactMatchReward",
    "ExactMatchConfig",
    "extract_gsm8k_answer",
    "last_number",
    "normalize_number",
    "last_boxed",
    "strip_boxed",
]

# "#### 1,234.5" in GSM8K solutions; the model is asked to answer in the same form.
_HASH_ANSWER = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?|-?\.[0-9]+)")
# A number with optional thousands separators ("1,234" but not "3,4"), an optional sign, decimals.
_NUMBER = re.compile(r"(?<![\w.])-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])")


def normalize_number(text: str) -> str | None:
    """A canonical string for a number written as in GSM8K: commas, ``$`` and trailing zeros removed.

    ``"1,234"`` -> ``"1234"``, ``"$3.50"`` -> ``"3.5"``, ``"-0.0"`` -> ``"0"``; ``None`` when ``text`` is not
    a number.
    """
    cleaned = str(text).strip().replace(",", "").replace("$", "").rstrip(".")
    if not cleaned:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_gsm8k_answer(text: str) -> str | None:
    """The number after the last ``####`` in ``text`` (normalised), or ``None`` if there is none."""
    found = _HASH_ANSWER.findall(text)
    return normalize_number(found[-1]) if found else None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (normalised), or ``None``."""
    found = _NUMBER.findall(text)
    return normalize_number(found[-1]) if found else None


@dataclass
class GSM8KConfig:
    """Options of the ``gsm8k`` reward (``reward.options.gsm8k``).

    Attributes:
        mode: ``"flexible"`` reads the number after ``####``, or else the last number in the response;
            ``"strict"`` only accepts an answer written after ``####``.
        correct_score: the score of a correct answer.
        format_score: the score of a wrong answer that was found in the expected form (0 by default).
    """

    mode: str = "flexible"
    correct_score: float = 1.0
    format_score: float = 0.0

    def validate(self) -> None:
        if self.mode not in ("flexible", "strict"):
            raise ValueError("mode: must be 'flexible' or 'strict'")


class GSM8KReward:
    """GSM8K: the final number of the response against the ground truth, as numbers (``1,234`` = ``1234``)."""

    Config = GSM8KConfig
    data_sources = ("openai/gsm8k",)

    def __init__(self, config: GSM8KConfig | None = None) -> None:
        self.config = config or GSM8KConfig()

    def extract(self, response: str) -> str | None:
        """The answer the response gives, or ``None`` when it gives none in the configured form."""
        answer = extract_gsm8k_answer(response)
        if answer is None and self.config.mode == "flexible":
            answer = last_number(response)
        return answer

    def __call__(self, response: str, ground_truth: Any) -> float:
        answer = self.extract(response)
        if answer is None:
            return 0.0
        truth = normalize_number(str(ground_truth))
        if truth is None:
            # A ground truth that is a full GSM8K solution ("... #### 42") also works.
            truth = extract_gsm8k_answer(str(ground_truth))
        if truth is None:
            raise ValueError(f"ground truth {ground_truth!r} is not a number (gsm8k reward)")
        return self.config.correct_score if answer == truth else self.config.format_score


# ----------------------------------------------------------------------------- MATH
def last_boxed(text: str) -> str | None:
    """The last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``, braces balanced, or ``None``."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    if text.startswith("\\boxed ", idx):
        rest = text[idx + len("\\boxed "):]
        m = re.match(r"[^\s$]+", rest)
        return "\\boxed " + m.group(0) if m else None
    depth = 0
    for j in range(idx, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[idx:j + 1]
    return None


def strip_boxed(boxed: str) -> str:
    """The content of ``\\boxed{x}`` / ``\\fbox{x}`` / ``\\boxed x``."""
    for prefix in ("\\boxed ",):
        if boxed.startswith(prefix):
            return boxed[len(prefix):]
    for prefix in ("\\boxed{", "\\fbox{"):
        if boxed.startswith(prefix) and boxed.endswith("}"):
            return boxed[len(prefix):-1]
    raise ValueError(f"{boxed!r} is not a \\boxed{{...}} expression")


@dataclass
class MathConfig:
    """Options of the ``math`` reward (``reward.options.math``).

    Attributes:
        answer_format: ``"boxed"`` scores the last ``\\boxed{}`` of the response (no box, no credit);
            ``"any"`` lets math-verify find the answer anywhere in the response.
        timeout: seconds math-verify may spend parsing and comparing one answer (in the main thread).
    """

    answer_format: str = "boxed"
    timeout: int = 5

    def validate(self) -> None:
        if self.answer_format not in ("boxed", "any"):
            raise ValueError("answer_format: must be 'boxed' or 'any'")


class MathReward:
    """MATH: the boxed answer is equivalent to the ground truth, checked with ``math-verify``.

    Equivalence is mathematical, not textual: ``\\frac{1}{2}``, ``\\dfrac12``, ``0.5`` and ``1/2`` agree.
    """

    Config = MathConfig
    data_sources = ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "lighteval/MATH-Hard",
                    "hendrycks/competition_math", "EleutherAI/hendrycks_math", "HuggingFaceH4/MATH-500",
                    "hiyouga/geometry3k")

    def __init__(self, config: MathConfig | None = None) -> None:
        self.config = config or MathConfig()
        try:
            import math_verify  # noqa: F401 - fail at start-up, not on the first response
        except ImportError as exc:  # pragma: no cover - a dependency of verl-reward-rules
            raise ImportError("the math reward needs math-verify: pip install 'math-verify>=0.7'") from exc

    def _timeout(self) -> int | None:
        # math-verify's timeouts use SIGALRM, which only the main thread may set; elsewhere the reward
        # worker's own timeout is the only limit.
        in_main = threading.current_thread() is threading.main_thread()
        return self.config.timeout if in_main and self.config.timeout > 0 else None

    def __call__(self, response: str, ground_truth: Any) -> float:
        from math_verify import parse, verify

        truth = str(ground_truth).strip()
        if truth.startswith("\\boxed") or truth.startswith("\\fbox"):
            truth = strip_boxed(last_boxed(truth) or truth)
        if self.config.answer_format == "boxed":
            boxed = last_boxed(response)
            if boxed is None:
                return 0.0
            answer_text = f"${strip_boxed(boxed)}$"
        else:
            answer_text = response
        timeout = self._timeout()
        gold = parse(f"${truth}$", parsing_timeout=timeout)
        if not gold:
            raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
        answer = parse(answer_text, parsing_timeout=timeout)
        if not answer:
            return 0.0
        return 1.0 if verify(gold, answer, timeout_seconds=timeout) else 0.0


# ----------------------------------------------------------------------------- exact match
@dataclass
class ExactMatchConfig:
    """Options of the ``exact_match`` reward.

    Attributes:
        ignore_case: compare case-insensitively.
        strip: ignore whitespace around the response and the ground truth.
    """

    ignore_case: bool = False
    strip: bool = True


class ExactMatchReward:
    """1.0 when the response equals the ground truth, else 0.0."""

    Config = ExactMatchConfig

    def __init__(self, config: ExactMatchConfig | None = None) -> None:
        self.config = config or ExactMatchConfig()

    def __call__(self, response: str, ground_truth: Any) -> float:
        a, b = str(response), str(ground_truth)
        if self.config.strip:
            a, b = a.strip(), b.strip()
        if self.config.ignore_case:
            a, b = a.lower(), b.lower()
        return 1.0 if a == b else 0.0

