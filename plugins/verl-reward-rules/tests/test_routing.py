"""The rule rewards through verl's reward manager: routing by data_source, options, math-verify in workers."""

import pytest

from verl_core.registry import PluginRegistry
from verl_rewards import RewardConfig, RewardSpecError, load_reward
from verl_rewards.manager import RewardManager


@pytest.fixture(scope="module")
def registry():
    return PluginRegistry()


def meta(truths, sources):
    n = len(truths)
    return {"ground_truth": list(truths), "data_source": list(sources), "extra_info": [{}] * n,
            "prompt_text": ["q"] * n}


def manager(registry, **kwargs):
    data_sources = kwargs.pop("data_sources", ())
    return RewardManager(registry=registry, tokenizer=None, config=RewardConfig(**kwargs), data_sources=data_sources)


def test_auto_routes_each_row_by_its_data_source_through_the_rewards_data_sources(registry):
    m = manager(registry, isolation="none")
    responses = ["#### 1,234", "\\boxed{\\frac12}", "#### 46", "#### 5"]
    # openai/gsm8k and the MATH sources are claimed through the rewards' data_sources (case-insensitively);
    # gsm8k is a reward's own name.
    sources = ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "OpenAI/GSM8K", "gsm8k"]
    scores, metrics = m.score_texts(responses, meta(["1234", "0.5", "46", "6"], sources))
    assert scores.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert metrics["reward/source/openai/gsm8k/mean"] == 1.0
    assert metrics["reward/source/gsm8k/mean"] == 0.0
    assert metrics["reward/errors"] == 0.0


def test_unknown_data_source_fails_at_construction_naming_the_fixes(registry):
    with pytest.raises(RewardSpecError) as info:
        manager(registry, data_sources=["my/private-set"])
    message = str(info.value)
    assert "my/private-set" in message and "reward.aliases" in message and "gsm8k" in message
    m = manager(registry, isolation="none", aliases={"my/private-set": "gsm8k"}, data_sources=["my/private-set"])
    assert m.score_texts(["#### 3"], meta(["3"], ["my/private-set"]))[0].tolist() == [1.0]


def test_options_configure_a_reward_and_are_checked(registry):
    strict = manager(registry, name="gsm8k", isolation="none", options={"gsm8k": {"mode": "strict"}})
    assert strict.score_texts(["The answer is 3"], meta(["3"], ["x"]))[0].tolist() == [0.0]
    with pytest.raises(RewardSpecError, match=r"reward.options.gsm8k.mdoe: unknown key \(did you mean 'mode'\?\)"):
        manager(registry, name="gsm8k", options={"gsm8k": {"mdoe": "strict"}})
    with pytest.raises(RewardSpecError, match="reward.options.gsm8k.mode: must be 'flexible' or 'strict'"):
        manager(registry, name="gsm8k", options={"gsm8k": {"mode": "lenient"}})
    with pytest.raises(RewardSpecError, match=r"reward.options.gsm8: no reward named 'gsm8' \(did you mean 'gsm8k'"):
        manager(registry, name="gsm8k", options={"gsm8": {"mode": "strict"}})


def test_the_rules_load_as_per_sample_plugins(registry):
    for name in ("gsm8k", "math", "exact_match"):
        loaded = load_reward(name, registry=registry)
        assert loaded.per_sample and not loaded.is_async and loaded.label == name
        assert registry.info("reward", name).distribution == "verl-reward-rules"


def test_building_a_reward_in_a_fresh_worker_does_not_count_against_its_time_limit(registry):
    # The math reward imports math-verify and sympy when built (about a second when idle, more under load); the
    # limit is per call, so a limit below the build time must still pass. 2 s leaves room for a loaded machine.
    m = manager(registry, name="math", timeout=2.0)
    try:
        scores, metrics = m.score_texts(["\\boxed{\\frac12}", "\\boxed{3}"], meta(["0.5", "0.5"], ["s", "s"]))
        assert scores.tolist() == [1.0, 0.0] and metrics["reward/timeouts"] == 0.0
    finally:
        m.close()
