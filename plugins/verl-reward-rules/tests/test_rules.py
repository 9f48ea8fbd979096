"""The rule rewards on tricky answers: commas, units, LaTeX fractions, missing answers."""

import pytest

from verl_reward_rules import (
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


@pytest.mark.parametrize("text, expected", [
    ("1,234", "1234"), ("$1,234.00", "1234"), ("3.50", "3.5"), ("-0.0", "0"), ("72.", "72"), ("abc", None),
    ("1e3", "1000"), ("", None),
])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize("response, truth, score", [
    ("She has 5 + 7 = 12 apples.\n#### 12", "12", 1.0),
    ("So the total is 1,234 bottles.\n#### 1,234", "1234", 1.0),   # commas in the answer
    ("#### 1234", "1,234", 1.0),                                   # commas in the ground truth
    ("The answer is $1,234.00.", "1234", 1.0),                     # no ####: last number, $ and .00
    ("Costs 3.50 dollars\n#### 3.50", "3.5", 1.0),
    ("It dropped to -8 degrees.", "-8", 1.0),
    ("#### 12 (I first thought 13)", "12", 1.0),                   # the #### answer wins over the last number
    ("I think 3,4 or maybe 7", "7", 1.0),                          # "3,4" is two numbers, not 34
    ("I am not sure.", "12", 0.0),                                 # missing answer
    ("#### 13", "12", 0.0),
])
def test_gsm8k_flexible(response, truth, score):
    assert GSM8KReward()(response, truth) == score


def test_gsm8k_strict_needs_the_marker_and_format_score_applies_to_wrong_answers():
    strict = GSM8KReward(GSM8KConfig(mode="strict", format_score=0.1))
    assert strict("The answer is 12", "12") == 0.0      # right number, wrong form
    assert strict("#### 12", "12") == 1.0
    assert strict("#### 13", "12") == 0.1
    assert extract_gsm8k_answer("a #### 5 then #### 6") == "6"
    assert last_number("no digits") is None


def test_gsm8k_ground_truth_may_be_a_full_solution_but_not_garbage():
    assert GSM8KReward()("#### 72", "She sold 48/2 = <<48/2=24>>24.\n#### 72") == 1.0
    with pytest.raises(ValueError, match="not a number"):
        GSM8KReward()("#### 72", "seventy-two")


def test_gsm8k_config_is_validated():
    with pytest.raises(ValueError, match="mode"):
        GSM8KConfig(mode="lenient").validate()


@pytest.mark.parametrize("response, truth, score", [
    ("So $x = \\boxed{\\frac{1}{2}}$.", "0.5", 1.0),                     # LaTeX fraction vs decimal
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),                          # \dfrac, no braces
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),                       # unreduced
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),          # nested braces
    ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),                            # symbolic equivalence
    ("\\boxed{(-\\infty, 2]}", "(-\\infty,2]", 1.0),                      # intervals
    ("\\boxed{\\text{(B)}}", "\\text{(B)}", 1.0),
    ("first \\boxed{3} then \\boxed{4}", "4", 1.0),                       # the last box counts
    ("\\boxed{3}", "\\frac{1}{2}", 0.0),
    ("the answer is 1/2", "\\frac{1}{2}", 0.0),                           # missing box: no credit
    ("", "5", 0.0),
])
def test_math_boxed_equivalence(response, truth, score):
    assert MathReward()(response, truth) == score


def test_math_any_format_reads_unboxed_answers():
    assert MathReward(MathConfig(answer_format="any"))("the answer is $\\frac{1}{2}$", "0.5") == 1.0


def test_math_ground_truth_given_boxed_is_unwrapped():
    assert MathReward()("\\boxed{6}", "\\boxed{6}") == 1.0


def test_boxed_helpers():
    assert last_boxed("a \\boxed{\\frac{a}{b}} b \\boxed{x_{1}}") == "\\boxed{x_{1}}"
    assert last_boxed("\\fbox{7}") == "\\fbox{7}"
    assert strip_boxed(last_boxed("so \\boxed 5$") or "") == "5"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("nothing") is None


def test_exact_match():
    assert ExactMatchReward()(" 46 ", "46") == 1.0
    assert ExactMatchReward()("Paris", "paris") == 0.0
    assert ExactMatchReward(ExactMatchConfig(ignore_case=True))("Paris", "paris") == 1.0
