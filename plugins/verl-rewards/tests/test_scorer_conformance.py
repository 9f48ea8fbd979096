"""The default scorer (verl-rewards' RewardManager) against the core's scorer conformance suite, once per
installed reward it routes to, in the controller and in reward worker processes. Expected scores come
from each reward's definition: exact match, GSM8K's final number, and the arithmetic task's sum."""

import pytest

from verl_core.registry import PluginRegistry
from verl_core.testing import ScorerConformance, build_byte_tokenizer
from verl_rewards import RewardConfig
from verl_rewards.manager import RewardManager


def row(truth, source="test"):
    return {"ground_truth": truth, "data_source": source, "extra_info": {}, "prompt_text": "q"}


CASES = {
    # " 42 " equals "42" once stripped; "41" and "the answer is 42" do not.
    "exact_match": [("42", row("42"), 1.0), (" 42 ", row("42"), 1.0), ("41", row("42"), 0.0),
                    ("the answer is 42", row("42"), 0.0)],
    # The number after the last ####, else the last number; "1,234" is 1234.
    "gsm8k": [("so #### 1,234", row("1234"), 1.0), ("it is 7 then 9", row("9"), 1.0), ("#### 8", row("9"), 0.0),
              ("no number", row("3"), 0.0)],
}


class TestDefaultScorerConformance(ScorerConformance):
    @pytest.fixture(params=[(name, isolation) for name in sorted(CASES) for isolation in ("none", "process")],
                    ids=lambda p: f"{p[0]}-{p[1]}")
    def setting(self, request):
        return request.param

    @pytest.fixture
    def scorer(self, setting):
        name, isolation = setting
        scorer = RewardManager(config=RewardConfig(name=name, isolation=isolation), registry=PluginRegistry(),
                               tokenizer=build_byte_tokenizer(), data_sources=["test"])
        yield scorer
        scorer.close()

    @pytest.fixture
    def cases(self, setting):
        return CASES[setting[0]]

    @pytest.fixture
    def tokenizer(self):
        return build_byte_tokenizer()
