"""The checks on what plugins hand the core (verl_core.boundary), value by value."""

import math

import pytest
import torch

from verl_core.batch import Batch
from verl_core.boundary import (Boundary, PluginOutputError, check_advantages, check_messages, check_prompt_rows,
                                check_response_budget, check_scores, check_step_result, finite_rows)
from verl_core.contracts import PromptIds, RolloutOutput, StepResult

ENV = "environment 'calc' (my-env 0.1)"


def fails(fn, *args, match, **kwargs):
    with pytest.raises(PluginOutputError, match=match) as info:
        fn(*args, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("result,match", [
    (StepResult(observation=None, reward=True, done=True), "bool True as the reward"),
    (StepResult(observation=None, reward="1", done=True), "str '1' as the reward"),
    (StepResult(observation=None, reward=None, done=True), "NoneType None as the reward"),
    (StepResult(observation=None, reward=1.0, done=1), "int 1 as done"),
    (StepResult(observation=None, reward=1.0, done=True, info=[]), "list \\[\\] as info"),
    (StepResult(observation=None, reward=1.0, done=True, info={"rewards": {"correct": "1"}}),
     "as info\\['rewards'\\]"),
    (StepResult(observation="try again", reward=0.0, done=False), "str 'try again' as the observation"),
    (StepResult(observation=[{"role": "tool"}], reward=0.0, done=False), "as the observation .*message 0"),
    ({"observation": None, "reward": 1.0, "done": True}, "expected a verl_core.contracts.StepResult"),
])
def test_malformed_step_results_name_the_environment_and_the_value(result, match):
    message = fails(check_step_result, result, source=ENV, where="from step() at step 3, row 5", match=match)
    assert message.startswith(ENV) and "step 3, row 5" in message


def test_well_formed_step_results_pass_and_a_nan_reward_is_left_to_the_reward_stage():
    ok = StepResult(observation=[{"role": "tool", "content": "4"}], reward=1, done=False, info={"tool_error": False})
    assert check_step_result(ok, source=ENV, where="") is ok
    check_step_result(StepResult(observation=None, reward=float("nan"), done=True), source=ENV, where="")
    assert check_messages([{"role": "user", "content": [{"type": "image"}]}], source=ENV, where="") is not None


READER = "data_reader 'mine' (my-reader 0.1)"


def prompt_row(**fields):
    return {"prompt_ids": [3, 4], "prompt_text": "hi", "prompt_messages": [{"role": "user", "content": "hi"}],
            "ground_truth": "5", "data_source": "sums", "extra_info": {}, "raw": {"prompt": "hi"}, **fields}


@pytest.mark.parametrize("row,match", [
    (prompt_row(prompt_ids=[]), r"list \[\] as prompt_ids of training row 1; expected a non-empty list of int"),
    (prompt_row(prompt_ids="3 4"), "str '3 4' as prompt_ids of training row 1"),
    (prompt_row(prompt_ids=[3, True]), "as prompt_ids of training row 1; expected a non-empty list of int"),
    (prompt_row(prompt_ids=[3, 4.0]), "as prompt_ids of training row 1"),
    (prompt_row(prompt_ids=[3, 10, -1]), r"list \[10, -1\] as prompt_ids of training row 1; expected token ids in "
                                         r"\[0, 10\), the model's vocabulary"),
    (prompt_row(data_source=""), "str '' as data_source of training row 1; expected a non-empty str"),
    (prompt_row(data_source=None), "NoneType None as data_source of training row 1"),
    ({k: v for k, v in prompt_row().items() if k != "prompt_text"}, "as prompt_text of training row 1"),
    (prompt_row(extra_info=None), "as extra_info of training row 1; expected a dict"),
    (prompt_row(prompt_messages="hi"), "as prompt_messages of training row 1"),
    ("a row", "str 'a row' as training row 1; expected a dict"),
])
def test_malformed_prompt_rows_name_the_reader_the_split_and_the_row(row, match):
    message = fails(check_prompt_rows, [prompt_row(), row], source=READER, split="training", vocab_size=10,
                    match=match)
    assert message.startswith(READER) and message.endswith("Nothing was trained; fix the plugin")


def test_well_formed_prompt_rows_pass_with_images_too():
    rows = [prompt_row(), prompt_row(prompt_ids=PromptIds([1, 9], multi_modal_data={"image": ["img"]}),
                                     prompt_messages=[{"role": "user", "content": [{"type": "image"}]}])]
    assert check_prompt_rows(rows, source=READER, split="validation", vocab_size=10) is rows
    assert check_prompt_rows([], source=READER, split="validation", vocab_size=10) == []
    fails(check_prompt_rows, ({},), source=READER, split="validation", vocab_size=10,
          match="tuple .* as the validation rows; expected a list of row dicts")


def test_scores_must_be_one_real_number_per_row():
    fails(check_scores, [1.0, 2.0], 2, source="scorer 'x'", step=1, match="list .* as the scores of step 1")
    fails(check_scores, torch.zeros(3), 2, source="scorer 'x'", step=1, match="expected 2 scores")
    fails(check_scores, torch.zeros(2, 1), 2, source="scorer 'x'", step=1, match="1-D real tensor")
    assert check_scores(torch.tensor([1, 0]), 2, source="s", step=1).dtype == torch.float32


def out(ids, lps=None, version=None, reasons=None):
    return RolloutOutput(response_ids=ids, log_probs=lps, finish_reasons=reasons or ["stop"] * len(ids),
                         weight_version=version)


def test_engine_output_is_checked_and_its_weight_version_never_goes_back():
    b = Boundary(rollout="rollout 'fast' (fast-engine 2.0)", vocab_size=10)
    b.engine_output(out([[1, 2], [9]], [[-0.5, 0.0], [-1e-5]], version=3), expected=2, step=4)
    assert b.last_version == 3
    b.engine_output(out([[1]], version=3), expected=1, step=5)  # the same version again is fine
    message = fails(b.engine_output, out([[1]], version=2), expected=1, step=6, match="weight_version")
    assert "rollout 'fast' (fast-engine 2.0) returned int 2" in message and "at least 3" in message
    fails(b.engine_output, out([[1], [2]]), expected=3, step=1, match="expected 3 responses")
    fails(b.engine_output, out([[1], [-1]]), expected=2, step=1, match=r"\[-1\] as token ids at step 1, row 1")
    fails(b.engine_output, out([[10]]), expected=1, step=1, match=r"integers in \[0, 10\)")
    fails(b.engine_output, out([[1, 2]], [[-0.1]]), expected=1, step=1, match="one per token")
    fails(b.engine_output, out([[1, 2]], [[-0.1, 0.3]]), expected=1, step=1, match=r"\[0.3\] as log-probs")
    fails(b.engine_output, out([[1, 2]], [[-0.1, -math.inf]]), expected=1, step=1, match="finite numbers <= 0")
    fails(b.engine_output, out([[1, 2]], [[-0.1, "x"]]), expected=1, step=1, match="as log-probs")


def test_non_finite_rewards_stop_naming_the_plugin_that_gave_them_or_are_skipped():
    scorer, env = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([[0.0, 0.0], [float("nan"), 0.0], [0.0, 0.0]])
    total = scorer + env.sum(-1)
    parts = [("scorer 'default' (verl-rewards 0.1)", scorer), (ENV, env)]
    message = fails(finite_rows, total, parts=parts, on_invalid="stop", step=7, match="non-finite reward")
    assert message.startswith(ENV) and "step 7, row 1 (1 of 3 rows)" in message and "on_invalid" in message
    assert finite_rows(total, parts=parts, on_invalid="skip", step=7).tolist() == [0, 2]
    assert finite_rows(scorer, parts=parts[:1], on_invalid="stop", step=7) is None
    fails(finite_rows, torch.full((2,), math.inf), parts=[("s", torch.full((2,), math.inf))], on_invalid="skip",
          step=1, match="every row is invalid")


def test_a_non_finite_advantage_on_a_loss_token_stops_naming_the_algorithm():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([[0.5, 0.5, float("nan")], [0.1, float("inf"), 0.0]])  # NaN/inf only off the loss tokens
    check_advantages(adv, mask, source="algorithm 'mine'", step=2)
    adv[1, 0] = float("nan")
    message = fails(check_advantages, adv, mask, source="algorithm 'mine'", step=2, match="non-finite advantage")
    assert "step 2, row 1, token 0" in message
    fails(check_advantages, adv[:, :2], mask, source="algorithm 'mine'", step=2, match="shape")


@pytest.mark.parametrize("budget,match", [(None, "NoneType None"), (3, "int 3"), ("8", "str '8'"), (True, "bool True")])
def test_an_episode_batch_must_record_a_response_budget_no_smaller_than_its_responses(budget, match):
    """Dr. GRPO's loss divides by the budget; without one it would divide by each trimmed micro-batch's width."""
    batch = Batch(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.long),
                  response_ids=torch.ones(2, 4, dtype=torch.long), response_attention_mask=torch.ones(2, 4, dtype=torch.long),
                  response_mask=torch.ones(2, 4, dtype=torch.long), group_ids=torch.zeros(2, dtype=torch.long))
    check_response_budget(batch.replace(info={"max_new_tokens": 4}), source=ENV, step=3)
    info = {} if budget is None else {"max_new_tokens": budget}
    message = fails(check_response_budget, batch.replace(info=info), source=ENV, step=3,
                    match=f"{match} as the batch's info\\['max_new_tokens'\\] at step 3")
    assert message.startswith(ENV) and "responses' width (4)" in message
