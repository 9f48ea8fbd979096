"""The reward manager: routing by data_source, custom rewards, weighted components, errors and time limits."""

import textwrap
import time

import pytest

from verl_core.config import RewardComponent, RewardConfig
from verl_core.registry import PluginRegistry
from verl_core.reward_plugins import RewardError, RewardSpecError, load_reward, per_sample
from verl_core.rewards import RewardManager

REWARDS_PY = '''
import asyncio

def length_bonus(response):
    return min(len(response), 10) / 10

def uses_extra(response, ground_truth, extra_info, data_source, prompt):
    # Everything the row carries is passed through.
    return float(extra_info["bonus"]) if response == ground_truth else -1.0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # verl's custom reward signature, returning verl's dict form.
    return {"score": 1.0 if solution_str.strip() == ground_truth else 0.0, "acc": 1.0}

def batch_lengths(inputs):
    return [len(r) for r in inputs.responses]

async def async_match(response, ground_truth, extra_info):
    await asyncio.sleep(extra_info.get("sleep", 0))
    return response == ground_truth

async def async_batch(inputs):
    await asyncio.sleep(0)
    return [0.5] * len(inputs.responses)

def flaky(response, ground_truth):
    if response == "boom":
        raise ValueError("cannot score this one")
    if response == "hang":
        while True:  # pure Python: only killing the process stops it
            pass
    return 1.0 if response == ground_truth else 0.0

def not_a_number(response):
    return "yes"
'''


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS_PY))
    return path


@pytest.fixture(scope="module")
def registry():
    return PluginRegistry()


def meta(truths, sources, extras=None):
    n = len(truths)
    return {"ground_truth": list(truths), "data_source": list(sources), "extra_info": extras or [{}] * n,
            "prompt_text": ["q"] * n}


def manager(registry, **kwargs):
    data_sources = kwargs.pop("data_sources", ())
    return RewardManager(registry=registry, tokenizer=None, config=RewardConfig(**kwargs), data_sources=data_sources)


def test_auto_routes_each_row_by_its_data_source_through_the_alias_table(registry):
    m = manager(registry, isolation="none")
    responses = ["#### 1,234", "\\boxed{\\frac12}", "46", "#### 5"]
    sources = ["openai/gsm8k", "DigitalLearningGmbH/MATH-lighteval", "arithmetic", "gsm8k"]
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


@pytest.mark.parametrize("isolation", ["none", "process"])
def test_file_rewards_in_every_shape(registry, rewards_file, isolation):
    def score(fn, responses, truths, extras=None):
        m = manager(registry, name=f"file:{rewards_file}:{fn}", isolation=isolation)
        try:
            return m.score_texts(responses, meta(truths, ["src"] * len(responses), extras))[0].tolist()
        finally:
            m.close()

    assert score("length_bonus", ["abcde", "x" * 30], ["", ""]) == [0.5, 1.0]
    assert score("uses_extra", ["a", "b"], ["a", "a"], [{"bonus": 0.25}, {"bonus": 0.5}]) == [0.25, -1.0]
    assert score("compute_score", [" 7 ", "8"], ["7", "7"]) == [1.0, 0.0]
    assert score("batch_lengths", ["ab", "abcd"], ["", ""]) == [2.0, 4.0]
    assert score("async_match", ["a", "b"], ["a", "a"]) == [1.0, 0.0]
    assert score("async_batch", ["a", "b"], ["", ""]) == [0.5, 0.5]


def test_bad_file_specs_name_the_problem(registry, rewards_file, tmp_path):
    with pytest.raises(RewardSpecError, match="does not exist"):
        manager(registry, name=f"file:{tmp_path / 'nope.py'}:fn")
    with pytest.raises(RewardSpecError, match=r"has no 'nope'; callables there: .*length_bonus"):
        manager(registry, name=f"file:{rewards_file}:nope")
    with pytest.raises(RewardSpecError, match="should look like 'file:/path/to/rewards.py:function_name'"):
        manager(registry, name=f"file:{rewards_file}")


def test_components_are_weighted_and_each_is_logged(registry, rewards_file):
    m = manager(registry, isolation="none", components=[RewardComponent("auto", 1.0),
                                                         RewardComponent(f"file:{rewards_file}:length_bonus", 0.5)])
    scores, metrics = m.score_texts(["#### 12", "#### 1"], meta(["12", "12"], ["openai/gsm8k"] * 2))
    assert scores.tolist() == pytest.approx([1.0 + 0.5 * 0.7, 0.0 + 0.5 * 0.6])
    assert metrics["reward/auto/mean"] == 0.5
    assert metrics["reward/length_bonus/mean"] == pytest.approx(0.65)
    assert metrics["reward/source/openai/gsm8k/mean"] == pytest.approx((1.35 + 0.3) / 2)


def test_a_failing_reward_stops_the_run_with_the_row_or_scores_zero_and_is_counted(registry, rewards_file):
    spec = f"file:{rewards_file}:flaky"
    fail = manager(registry, name=spec, isolation="none")
    with pytest.raises(RewardError) as info:
        fail.score_texts(["1", "boom"], meta(["1", "1"], ["src", "src"]))
    message = str(info.value)
    assert "row 1" in message and "ValueError: cannot score this one" in message and "'boom'" in message
    assert 'reward.on_error="zero"' in message
    zero = manager(registry, name=spec, isolation="none", on_error="zero")
    scores, metrics = zero.score_texts(["1", "boom", "2"], meta(["1", "1", "1"], ["src"] * 3))
    assert scores.tolist() == [1.0, 0.0, 0.0] and metrics["reward/errors"] == 1.0
    bad = manager(registry, name=f"file:{rewards_file}:not_a_number", isolation="none")
    with pytest.raises(RewardError, match="a reward must be a number"):
        bad.score_texts(["x"], meta(["x"], ["src"]))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_hanging_reward_is_killed_at_the_time_limit_and_the_rest_is_scored(registry, rewards_file, workers):
    m = manager(registry, name=f"file:{rewards_file}:flaky", on_error="zero", timeout=1.0, workers=workers)
    try:
        start = time.monotonic()
        scores, metrics = m.score_texts(["1", "hang", "1", "0"], meta(["1"] * 4, ["src"] * 4))
        elapsed = time.monotonic() - start
        assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
        assert metrics["reward/errors"] == 1.0 and metrics["reward/timeouts"] == 1.0
        assert elapsed < 10, elapsed
        # The replacement worker keeps serving.
        assert m.score_texts(["1"], meta(["1"], ["src"]))[0].tolist() == [1.0]
    finally:
        m.close()
    fail = manager(registry, name=f"file:{rewards_file}:flaky", timeout=1.0)
    try:
        with pytest.raises(RewardError, match=r"timed out on row 0 .*exceeded reward.timeout=1s"):
            fail.score_texts(["hang"], meta(["1"], ["src"]))
    finally:
        fail.close()


def test_async_rewards_get_the_time_limit_even_in_the_controller(registry, rewards_file):
    m = manager(registry, name=f"file:{rewards_file}:async_match", isolation="none", on_error="zero", timeout=0.5)
    scores, metrics = m.score_texts(["a", "a"], meta(["a", "a"], ["s", "s"], [{}, {"sleep": 30}]))
    assert scores.tolist() == [1.0, 0.0] and metrics["reward/timeouts"] == 1.0


def test_per_sample_decorator_and_registry_plugins_load(registry):
    @per_sample
    def close_enough(pred, gold):
        return abs(float(pred) - float(gold)) < 0.5

    from verl_core.reward_plugins import RewardInput

    inputs = RewardInput(responses=["1.2", "3"], prompts=["", ""], ground_truths=["1", "1"], data_sources=["", ""])
    assert close_enough(inputs) == [1.0, 0.0]
    loaded = load_reward("math", registry=registry)
    assert loaded.per_sample and not loaded.is_async and loaded.label == "math"


def test_building_a_reward_in_a_fresh_worker_does_not_count_against_its_time_limit(registry):
    # The math reward imports math-verify and sympy when built (about a second when idle, more under load); the
    # limit is per call, so a limit below the build time must still pass. 2 s leaves room for a loaded machine.
    m = manager(registry, name="math", timeout=2.0)
    try:
        scores, metrics = m.score_texts(["\\boxed{\\frac12}", "\\boxed{3}"], meta(["0.5", "0.5"], ["s", "s"]))
        assert scores.tolist() == [1.0, 0.0] and metrics["reward/timeouts"] == 0.0
    finally:
        m.close()
