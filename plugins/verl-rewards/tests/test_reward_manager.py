"""The reward manager: routing by data_source, custom rewards, weighted components, errors and time limits."""

import textwrap

import pytest

from verl_core.contracts import RewardError, RewardInput, RewardScorer
from verl_core.registry import PluginRegistry
from verl_rewards import RewardComponent, RewardConfig, RewardSpecError, per_sample
from verl_rewards.manager import RewardManager

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
    # "auto" routes the rows' data_source through reward.aliases, here to a file reward.
    m = manager(registry, isolation="none", aliases={"my/set": f"file:{rewards_file}:compute_score"},
                components=[RewardComponent("auto", 1.0), RewardComponent(f"file:{rewards_file}:length_bonus", 0.5)])
    scores, metrics = m.score_texts(["12", "1"], meta(["12", "12"], ["my/set"] * 2))
    assert scores.tolist() == pytest.approx([1.0 + 0.5 * 0.2, 0.0 + 0.5 * 0.1])
    assert metrics["reward/auto/mean"] == 0.5
    assert metrics["reward/length_bonus/mean"] == pytest.approx(0.15)
    assert metrics["reward/source/my/set/mean"] == pytest.approx((1.1 + 0.05) / 2)


def test_an_unknown_data_source_fails_at_construction_naming_the_fixes(registry):
    with pytest.raises(RewardSpecError) as info:
        manager(registry, data_sources=["my/private-set"])
    message = str(info.value)
    assert "my/private-set" in message and "reward.aliases" in message and "Installed rewards" in message


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
        # "hang" loops forever in pure Python: that the call returns at all, with that row counted as a
        # timeout, shows its worker was killed (no wall-clock bound: a slow machine is not a failure).
        scores, metrics = m.score_texts(["1", "hang", "1", "0"], meta(["1"] * 4, ["src"] * 4))
        assert scores.tolist() == [1.0, 0.0, 1.0, 0.0]
        assert metrics["reward/errors"] == 1.0 and metrics["reward/timeouts"] == 1.0
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


def test_per_sample_decorator(registry):
    @per_sample
    def close_enough(pred, gold):
        return abs(float(pred) - float(gold)) < 0.5

    inputs = RewardInput(responses=["1.2", "3"], prompts=["", ""], ground_truths=["1", "1"], data_sources=["", ""])
    assert close_enough(inputs) == [1.0, 0.0]


def test_the_default_scorer_owns_the_reward_section_and_round_trips(registry):
    # The whole config resolves, so this needs the default backend and model plugins installed too.
    from verl_core.config import config_to_dict, dump_toml, resolve_config, tomllib

    assert registry.load("scorer", "default") is RewardManager and issubclass(RewardManager, RewardScorer)
    assert registry.info("scorer", "default").distribution == "verl-rewards"
    # An old [reward] table (no `scorer` key) still means the default scorer; `name` is its reward.
    cfg = resolve_config({"reward": {"name": "gsm8k", "on_error": "zero"}}, registry)
    assert cfg.reward.name == "default" and isinstance(cfg.reward.config, RewardConfig)
    assert (cfg.reward.config.name, cfg.reward.config.on_error) == ("gsm8k", "zero")
    written = config_to_dict(cfg)["reward"]
    assert written["scorer"] == "default" and written["name"] == "gsm8k"
    assert resolve_config(tomllib.loads(dump_toml(config_to_dict(cfg))), registry).reward == cfg.reward


def test_the_reward_model_path_is_what_the_trainer_starts(registry, tmp_path):
    assert manager(registry, isolation="none").reward_model_path() is None
    m = manager(registry, isolation="none", model_path=str(tmp_path))
    assert m.reward_model_path() == str(tmp_path)
    with pytest.raises(RewardError, match="no reward model worker"):
        m.score_texts(["x"], meta(["x"], ["src"]))
    with pytest.raises(RewardSpecError, match="reward.model_path: .* is not a directory"):
        manager(registry, isolation="none", model_path=str(tmp_path / "missing"))


def test_building_a_reward_is_not_counted_against_its_time_limit(registry, tmp_path):
    """A reward module that takes longer to import than reward.timeout (math-verify, sympy) still scores:
    the limit starts when the worker says the reward is built, as the worker's comment promises."""
    slow = tmp_path / "slow_import.py"
    slow.write_text("import time\ntime.sleep(2.5)  # a heavy import\n\n"
                    "def exact(response, ground_truth):\n    return float(response == ground_truth)\n")
    m = manager(registry, name=f"file:{slow}:exact", timeout=1.0, workers=1)
    try:
        scores, metrics = m.score_texts(["1", "2"], meta(["1", "1"], ["src", "src"]))
        assert scores.tolist() == [1.0, 0.0] and metrics.get("reward/timeouts", 0.0) == 0.0
    finally:
        m.close()
