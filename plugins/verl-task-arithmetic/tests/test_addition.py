"""The addition task and what it registers: tokenizer, data, reward, environment, and the builtin: names."""

import pytest

from verl_core.registry import PluginRegistry
from verl_task_arithmetic.addition import (build_model, build_tokenizer, evaluate_greedy, make_dataset,
                                           preference_pairs, reward)
from verl_task_arithmetic.plugins import Addition, ArithmeticEnvironment, TinyQwen2Addition, arithmetic_reward


@pytest.fixture(scope="module")
def registry():
    return PluginRegistry()


def test_every_prompt_is_seven_tokens_through_the_chat_template():
    tok = build_tokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "12+34="}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert ids[0] == tok.bos_token_id and len(ids) == 7
    assert tok.decode(ids[1:]) == "12+34="
    assert tok("46", add_special_tokens=False)["input_ids"] == tok.convert_tokens_to_ids(["4", "6"])


def test_the_split_is_deterministic_and_held_out():
    train, test = make_dataset(seed=0)
    assert (len(train), len(test)) == (7600, 500) and make_dataset(seed=0)[1] == test
    assert not {r["prompt"][0]["content"] for r in train} & {r["prompt"][0]["content"] for r in test}
    row = test[0]
    a, b = row["prompt"][0]["content"].rstrip("=").split("+")
    assert row["reward_model"]["ground_truth"] == str(int(a) + int(b)) and row["data_source"] == "arithmetic"


def test_rewards_and_environment_score_the_exact_sum():
    assert reward("46<eos><pad>", "46") == 1.0 and reward("47", "46") == 0.0
    assert arithmetic_reward(" 46 ", "46") == 1.0 and arithmetic_reward("47", "46") == 0.0
    env = ArithmeticEnvironment()
    prompt = [{"role": "user", "content": "12+34="}]
    assert env.reset(prompt=prompt, extra_info={"ground_truth": "46"}) == prompt
    result = env.step("46")
    assert result.reward == 1.0 and result.done
    with pytest.raises(RuntimeError, match="reset"):
        env.step("46")


def test_a_fresh_model_generates_within_the_budget():
    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    assert 0.0 <= evaluate_greedy(model, tok, make_dataset()[1][:20]) <= 1.0


def test_the_builtin_names_resolve_through_the_registry(registry):
    from verl_data import load_rows

    assert registry.load("model", "tiny-qwen2-addition") is TinyQwen2Addition
    assert registry.info("dataset", "addition").distribution == "verl-task-arithmetic"
    assert registry.info("reward", "arithmetic").distribution == "verl-task-arithmetic"
    assert registry.info("environment", "arithmetic").distribution == "verl-task-arithmetic"
    assert load_rows("builtin:addition", split="test", registry=registry) == make_dataset()[1]
    assert len(load_rows("builtin:addition", registry=registry)) == 7600
    with pytest.raises(ValueError, match="no split 'dev'"):
        Addition().rows(split="dev")


def test_preference_pairs_prefer_the_sum_to_a_near_miss(registry):
    from verl_data import load_rows

    assert Addition.formats == ("prompts", "preference_pairs")
    pairs = load_rows("builtin:addition", split="train", registry=registry, format="preference_pairs")
    train = make_dataset()[0]
    assert len(pairs) == len(train) == 7600
    for row, plain in zip(pairs, train):
        assert {k: row[k] for k in plain} == plain  # the prompt row, as it is
        assert row["chosen"] == plain["reward_model"]["ground_truth"]
        assert row["rejected"] != row["chosen"] and row["rejected"].isdigit()
        assert 0 < abs(int(row["rejected"]) - int(row["chosen"])) <= 900
    # The wrong answer belongs to the row, not to the order it was built in.
    assert preference_pairs(list(reversed(train[:50]))) == list(reversed(pairs[:50]))
    assert load_rows("builtin:addition", split="test", registry=registry) == make_dataset()[1]
    with pytest.raises(ValueError, match="no 'graded' rows"):
        Addition().rows(split="train", format="graded")


def test_the_model_preset_is_layered_under_the_users_config(registry):
    from verl_core.config import resolve_config

    cfg = resolve_config({"backend": {"lr": 3e-4}}, registry)  # model.path defaults to builtin:tiny-qwen2-addition
    assert cfg.model.path == "builtin:tiny-qwen2-addition" and cfg.data.train == "builtin:addition"
    assert cfg.backend.config.lr == 3e-4  # the user's setting wins
    assert cfg.rollout.config.max_new_tokens == 4 and cfg.data.max_prompt_length == 16 and cfg.run.max_steps == 100
    other = resolve_config({"model": {"path": "./somewhere"}}, registry)
    assert other.data.max_prompt_length != 16 and other.backend.config.lr != 1e-4  # no preset for a local model
