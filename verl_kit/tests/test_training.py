"""What the training backends share (verl_kit.training): micro-batch packing, padding, per-rank shares, weights."""

from __future__ import annotations

import pytest
import torch

from verl_core.testing import make_batch
from verl_kit.training import micro_batch_weights, rank_mini_batch, token_groups, trim_padding


def test_trim_padding_trims_response_aligned_extras():
    batch = make_batch(batch_size=2, group_size=2, response_length=6, tool_tokens=False)
    last_two_empty = batch.response_attention_mask * torch.tensor([1, 1, 1, 1, 0, 0])
    batch = batch.replace(response_attention_mask=last_two_empty,
                          extras={"w": torch.ones(2, 6), "label": torch.ones(2)})
    trimmed = trim_padding(batch)
    assert trimmed.response_ids.shape[1] == 4
    assert trimmed.extras["w"].shape == (2, 4) and trimmed.extras["label"].shape == (2,)


def test_token_groups_pack_consecutive_samples_up_to_the_budget():
    batch = make_batch(batch_size=4, group_size=1, prompt_length=3, response_length=5)
    lengths = (batch.prompt_mask.sum(-1) + batch.response_attention_mask.sum(-1)).tolist()
    budget = max(lengths) + 1
    groups = token_groups(batch, budget)
    assert [i for g in groups for i in g] == [0, 1, 2, 3]
    assert all(sum(lengths[i] for i in g) <= budget for g in groups)
    assert token_groups(batch, 1) == [[0], [1], [2], [3]]  # a sample over the budget is a group of its own


def test_rank_mini_batch_is_each_ranks_share_and_refuses_an_uneven_one():
    assert rank_mini_batch(0, 6, 2) == 6 and rank_mini_batch(8, 16, 4) == 2
    with pytest.raises(ValueError, match="not a multiple of the 4 data-parallel ranks"):
        rank_mini_batch(6, 16, 4)


def test_micro_batch_weights_count_each_micro_batch_by_its_units():
    class TokenMean:
        def units(self, batch):
            return float(batch.response_mask.sum())

    batch = make_batch(batch_size=4, group_size=1, response_length=6)
    micros = list(batch.split(1))
    weights = micro_batch_weights(TokenMean(), micros)
    tokens = [float(m.response_mask.sum()) for m in micros]
    assert weights == pytest.approx([t / sum(tokens) for t in tokens]) and sum(weights) == pytest.approx(1.0)
    # Two data-parallel ranks with the same tokens each: the average over ranks is undone.
    assert micro_batch_weights(TokenMean(), micros, dp_size=2, sum_over_ranks=lambda n: 2 * n) == pytest.approx(weights)
